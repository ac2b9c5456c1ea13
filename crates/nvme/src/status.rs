//! The status a command completes with (NVMe Base Specification 2.0, "Status Field"): a
//! Status Code Type, a Status Code, and the More and Do Not Retry bits.

/// Status Code Type (SCT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusCodeType {
    /// 0h: Generic Command Status.
    Generic,
    /// 1h: Command Specific Status (Connect's, Abort's, reservations').
    CommandSpecific,
    /// 2h: Media and Data Integrity Errors.
    Media,
    /// 3h: Path Related Status (ANA states, transport errors).
    Path,
    /// 7h: Vendor Specific.
    VendorSpecific,
    /// Any other value, kept as it was read.
    Other(u8),
}

impl StatusCodeType {
    /// The three-bit code.
    pub fn code(self) -> u8 {
        match self {
            StatusCodeType::Generic => 0,
            StatusCodeType::CommandSpecific => 1,
            StatusCodeType::Media => 2,
            StatusCodeType::Path => 3,
            StatusCodeType::VendorSpecific => 7,
            StatusCodeType::Other(c) => c & 7,
        }
    }

    /// From the three-bit code.
    pub fn from_code(code: u8) -> StatusCodeType {
        match code & 7 {
            0 => StatusCodeType::Generic,
            1 => StatusCodeType::CommandSpecific,
            2 => StatusCodeType::Media,
            3 => StatusCodeType::Path,
            7 => StatusCodeType::VendorSpecific,
            c => StatusCodeType::Other(c),
        }
    }
}

/// The status of a completed command: what the CQE's Status Field says, but the phase tag
/// (which fabrics do not use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status {
    /// SCT.
    pub sct: StatusCodeType,
    /// SC.
    pub sc: u8,
    /// M: more status information in the Error Information log page.
    pub more: bool,
    /// DNR: the same command would fail again; the host should not retry it.
    pub dnr: bool,
}

impl Status {
    const fn generic(sc: u8, dnr: bool) -> Status {
        Status {
            sct: StatusCodeType::Generic,
            sc,
            more: false,
            dnr,
        }
    }

    const fn specific(sc: u8, dnr: bool) -> Status {
        Status {
            sct: StatusCodeType::CommandSpecific,
            sc,
            more: false,
            dnr,
        }
    }

    const fn path(sc: u8, dnr: bool) -> Status {
        Status {
            sct: StatusCodeType::Path,
            sc,
            more: false,
            dnr,
        }
    }

    /// Successful Completion.
    pub const SUCCESS: Status = Status::generic(0x00, false);
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::generic(0x01, true);
    /// Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::generic(0x02, true);
    /// Command ID Conflict.
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03, true);
    /// Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04, false);
    /// Internal Error.
    pub const INTERNAL_ERROR: Status = Status::generic(0x06, false);
    /// Command Abort Requested.
    pub const ABORT_REQUESTED: Status = Status::generic(0x07, false);
    /// Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08, false);
    /// Command Aborted due to Failed Fused Command.
    pub const ABORTED_FAILED_FUSED: Status = Status::generic(0x09, false);
    /// Command Aborted due to Missing Fused Command.
    pub const ABORTED_MISSING_FUSED: Status = Status::generic(0x0a, true);
    /// Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b, true);
    /// Command Sequence Error.
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0c, true);
    /// Invalid SGL Segment Descriptor.
    pub const INVALID_SGL_SEGMENT: Status = Status::generic(0x0d, true);
    /// Data SGL Length Invalid.
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x0f, true);
    /// SGL Descriptor Type Invalid.
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11, true);
    /// SGL Offset Invalid.
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16, true);
    /// Keep Alive Timer Expired.
    pub const KEEP_ALIVE_EXPIRED: Status = Status::generic(0x19, false);
    /// Host Identifier Inconsistent Format: a 64-bit Host Identifier asked of a host that has
    /// a 128-bit one (as every NVMe over Fabrics host has).
    pub const HOST_ID_INCONSISTENT: Status = Status::generic(0x18, true);
    /// Keep Alive Timeout Invalid.
    pub const KEEP_ALIVE_INVALID: Status = Status::generic(0x1a, true);
    /// Command Aborted due to Preempt and Abort.
    pub const ABORTED_PREEMPT: Status = Status::generic(0x1b, false);
    /// Transient Transport Error: a data digest mismatch; the host may retry.
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::generic(0x22, false);
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80, true);
    /// Capacity Exceeded.
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81, true);
    /// Namespace Not Ready (the host may retry).
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82, false);
    /// Reservation Conflict.
    pub const RESERVATION_CONFLICT: Status = Status::generic(0x83, true);

    /// Invalid Queue Identifier (Create/Delete queue; Connect uses its own).
    pub const INVALID_QUEUE_IDENTIFIER: Status = Status::specific(0x01, true);
    /// Invalid Queue Size.
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02, true);
    /// Abort Command Limit Exceeded.
    pub const ABORT_LIMIT_EXCEEDED: Status = Status::specific(0x03, true);
    /// Asynchronous Event Request Limit Exceeded.
    pub const AER_LIMIT_EXCEEDED: Status = Status::specific(0x05, true);
    /// Invalid Log Page.
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09, true);
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0d, true);
    /// Feature Not Changeable.
    pub const FEATURE_NOT_CHANGEABLE: Status = Status::specific(0x0e, true);
    /// Connect: Incompatible Format.
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80, true);
    /// Connect: Controller Busy.
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::specific(0x81, false);
    /// Connect: Invalid Parameters (the CQE's DW0 points at the field).
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::specific(0x82, true);
    /// Connect: Restart Discovery.
    pub const CONNECT_RESTART_DISCOVERY: Status = Status::specific(0x83, true);
    /// Connect: Invalid Host (the host may not reach the subsystem).
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84, true);
    /// Compare Failure (Compare, and Compare and Write's compare).
    pub const COMPARE_FAILURE: Status = Status {
        sct: StatusCodeType::Media,
        sc: 0x85,
        more: false,
        dnr: true,
    };

    /// Write Fault (the medium could not be written).
    pub const WRITE_FAULT: Status = Status {
        sct: StatusCodeType::Media,
        sc: 0x80,
        more: false,
        dnr: false,
    };
    /// Unrecovered Read Error.
    pub const UNRECOVERED_READ_ERROR: Status = Status {
        sct: StatusCodeType::Media,
        sc: 0x81,
        more: false,
        dnr: false,
    };
    /// Namespace is Write Protected.
    pub const NAMESPACE_WRITE_PROTECTED: Status = Status::generic(0x20, true);

    /// Asymmetric Access Inaccessible.
    pub const ANA_INACCESSIBLE: Status = Status::path(0x02, false);
    /// Asymmetric Access Persistent Loss.
    pub const ANA_PERSISTENT_LOSS: Status = Status::path(0x01, false);
    /// Asymmetric Access Transition.
    pub const ANA_TRANSITION: Status = Status::path(0x03, false);

    /// How a command whose block operation failed with `e` ends: a medium error as a disk
    /// reports it, storage that does not answer (a Ceph cluster down) as Namespace Not Ready
    /// without DNR, which hosts retry.
    pub fn of_backend(e: scsi_core::BackendError) -> Status {
        use scsi_core::BackendError as E;
        match e {
            E::Read { .. } => Status::UNRECOVERED_READ_ERROR,
            E::Write { .. } => Status::WRITE_FAULT,
            E::NoSpace => Status::CAPACITY_EXCEEDED,
            E::Miscompare { .. } => Status::COMPARE_FAILURE,
            E::Unsupported => Status::INVALID_OPCODE,
            E::Unavailable => Status::NAMESPACE_NOT_READY,
            E::WriteProtected => Status::NAMESPACE_WRITE_PROTECTED,
            _ => Status::INTERNAL_ERROR,
        }
    }

    /// Whether the command succeeded.
    pub fn is_success(self) -> bool {
        self.sct == StatusCodeType::Generic && self.sc == 0
    }

    /// The CQE's Status Field (bits 15:1 of its last word), phase tag `phase`.
    pub fn to_field(self, phase: bool) -> u16 {
        u16::from(phase)
            | u16::from(self.sc) << 1
            | u16::from(self.sct.code()) << 9
            | u16::from(self.more) << 14
            | u16::from(self.dnr) << 15
    }

    /// From a CQE's Status Field; the phase tag and the Command Retry Delay are dropped.
    pub fn from_field(field: u16) -> Status {
        Status {
            sc: (field >> 1) as u8,
            sct: StatusCodeType::from_code((field >> 9) as u8),
            more: field & 1 << 14 != 0,
            dnr: field & 1 << 15 != 0,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SCT {:x}h SC {:02x}h", self.sct.code(), self.sc)?;
        if self.dnr {
            f.write_str(" DNR")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_field_has_sc_sct_more_and_dnr_where_the_specification_puts_them() {
        // LBA Out of Range with DNR: SC 80h at bits 8:1, SCT 0, DNR at bit 15.
        assert_eq!(Status::LBA_OUT_OF_RANGE.to_field(false), 0x8100);
        assert_eq!(Status::RESERVATION_CONFLICT.to_field(true), 0x8107);
        // Connect Invalid Host: SCT 1, SC 84h, DNR.
        assert_eq!(Status::CONNECT_INVALID_HOST.to_field(false), 0x8308);
        for s in [
            Status::SUCCESS,
            Status::ANA_TRANSITION,
            Status::COMPARE_FAILURE,
            Status::TRANSIENT_TRANSPORT_ERROR,
        ] {
            assert_eq!(Status::from_field(s.to_field(true)), s);
        }
        assert!(Status::from_field(1).is_success());
    }
}
