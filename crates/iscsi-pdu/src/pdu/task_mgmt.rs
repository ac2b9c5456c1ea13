//! SCSI Task Management Function Request and Response (RFC 7143 sections 11.5 and 11.6, with the
//! SAM-4 functions of RFC 7144 section 4).

use bytes::Bytes;

use super::{code_enum, no_ahs, no_data, Body, Pdu, EMPTY};
use crate::bhs::{Fields, Opcode, View};
use crate::error::DecodeError;
use crate::serial::SerialNumber;
use crate::types::Lun;

code_enum! {
    /// Function of a Task Management Function Request.
    TaskManagementFunction: u8 {
        /// 1: ABORT TASK.
        AbortTask = 1,
        /// 2: ABORT TASK SET.
        AbortTaskSet = 2,
        /// 3: CLEAR ACA.
        ClearAca = 3,
        /// 4: CLEAR TASK SET.
        ClearTaskSet = 4,
        /// 5: LOGICAL UNIT RESET.
        LogicalUnitReset = 5,
        /// 6: TARGET WARM RESET.
        TargetWarmReset = 6,
        /// 7: TARGET COLD RESET.
        TargetColdReset = 7,
        /// 8: TASK REASSIGN.
        TaskReassign = 8,
        /// 9: QUERY TASK (RFC 7144).
        QueryTask = 9,
        /// 10: QUERY TASK SET (RFC 7144).
        QueryTaskSet = 10,
        /// 11: I_T NEXUS RESET (RFC 7144).
        ItNexusReset = 11,
        /// 12: QUERY ASYNCHRONOUS EVENT (RFC 7144).
        QueryAsynchronousEvent = 12,
    }
}

code_enum! {
    /// Response of a Task Management Function Response.
    TmfResponse: u8 {
        /// 0: Function complete.
        FunctionComplete = 0,
        /// 1: Task does not exist.
        TaskDoesNotExist = 1,
        /// 2: LUN does not exist.
        LunDoesNotExist = 2,
        /// 3: Task still allegiant.
        TaskStillAllegiant = 3,
        /// 4: Task allegiance reassignment not supported.
        ReassignmentNotSupported = 4,
        /// 5: Task management function not supported.
        NotSupported = 5,
        /// 6: Function authorization failed.
        AuthorizationFailed = 6,
        /// 7: Function succeeded (RFC 7144: the queried task or event exists).
        FunctionSucceeded = 7,
        /// 255: Function rejected.
        FunctionRejected = 255,
    }
}

/// Task Management Function Request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskManagementRequest {
    /// I bit (TMF requests are normally immediate).
    pub immediate: bool,
    /// Function.
    pub function: TaskManagementFunction,
    /// LUN.
    pub lun: Lun,
    /// Initiator Task Tag of this request.
    pub initiator_task_tag: u32,
    /// Referenced Task Tag (ABORT TASK, QUERY TASK, TASK REASSIGN), else `0xffffffff`.
    pub referenced_task_tag: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// RefCmdSN: the referenced task's CmdSN (ABORT TASK), or this request's.
    pub ref_cmd_sn: SerialNumber,
    /// ExpDataSN (TASK REASSIGN).
    pub exp_data_sn: u32,
}

impl Default for TaskManagementRequest {
    fn default() -> Self {
        TaskManagementRequest {
            immediate: true,
            function: TaskManagementFunction::AbortTask,
            lun: Lun::ZERO,
            initiator_task_tag: 0,
            referenced_task_tag: 0xffff_ffff,
            cmd_sn: SerialNumber(0),
            exp_stat_sn: SerialNumber(0),
            ref_cmd_sn: SerialNumber(0),
            exp_data_sn: 0,
        }
    }
}

impl Body for TaskManagementRequest {
    const OPCODE: Opcode = Opcode::TaskManagementRequest;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        no_data(&data)?;
        Ok(Pdu::TaskManagementRequest(TaskManagementRequest {
            immediate: f.b(0) & 0x40 != 0,
            function: TaskManagementFunction::from(f.b(1) & 0x7f),
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            referenced_task_tag: f.w(1),
            cmd_sn: SerialNumber(f.w(2)),
            exp_stat_sn: SerialNumber(f.w(3)),
            ref_cmd_sn: SerialNumber(f.w(4)),
            exp_data_sn: f.w(5),
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80 | (u8::from(self.function) & 0x7f);
        f.lun = self.lun.0;
        f.w[0] = self.initiator_task_tag;
        f.w[1] = self.referenced_task_tag;
        f.w[2] = self.cmd_sn.0;
        f.w[3] = self.exp_stat_sn.0;
        f.w[4] = self.ref_cmd_sn.0;
        f.w[5] = self.exp_data_sn;
    }

    fn immediate(&self) -> bool {
        self.immediate
    }

    fn data(&self) -> &Bytes {
        &EMPTY
    }
}

/// Task Management Function Response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskManagementResponse {
    /// Response.
    pub response: TmfResponse,
    /// Initiator Task Tag of the request.
    pub initiator_task_tag: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// Additional Response Information (RFC 7144: the sense key, ASC and ASCQ of a pending
    /// asynchronous event for QUERY ASYNCHRONOUS EVENT).
    pub additional_response_information: [u8; 3],
}

impl Default for TaskManagementResponse {
    fn default() -> Self {
        TaskManagementResponse {
            response: TmfResponse::FunctionComplete,
            initiator_task_tag: 0,
            stat_sn: SerialNumber(0),
            exp_cmd_sn: SerialNumber(0),
            max_cmd_sn: SerialNumber(0),
            additional_response_information: [0; 3],
        }
    }
}

impl Body for TaskManagementResponse {
    const OPCODE: Opcode = Opcode::TaskManagementResponse;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        no_data(&data)?;
        let info = f.w(5).to_be_bytes();
        Ok(Pdu::TaskManagementResponse(TaskManagementResponse {
            response: TmfResponse::from(f.b(2)),
            initiator_task_tag: f.w(0),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            additional_response_information: [info[0], info[1], info[2]],
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80;
        f.b[2] = self.response.into();
        f.w[0] = self.initiator_task_tag;
        f.w[2] = self.stat_sn.0;
        f.w[3] = self.exp_cmd_sn.0;
        f.w[4] = self.max_cmd_sn.0;
        let i = self.additional_response_information;
        f.w[5] = u32::from_be_bytes([i[0], i[1], i[2], 0]);
    }

    fn data(&self) -> &Bytes {
        &EMPTY
    }
}
