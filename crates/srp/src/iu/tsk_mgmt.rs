//! SRP_TSK_MGMT (SRP-2 section 6.7): a task management function for a logical unit.

use nom::bytes::complete::take;
use nom::number::complete::{be_u64, be_u8};
use nom::Parser;
use scsi_core::TmfFunction;

use super::{parsed, IuError, IuType};

/// TASK MANAGEMENT FUNCTION (SRP-2 table 20).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskManagementFunction {
    /// ABORT TASK (01h).
    AbortTask,
    /// ABORT TASK SET (02h).
    AbortTaskSet,
    /// CLEAR TASK SET (04h).
    ClearTaskSet,
    /// LOGICAL UNIT RESET (08h).
    LogicalUnitReset,
    /// CLEAR ACA (40h).
    ClearAca,
    /// QUERY TASK (80h).
    QueryTask,
    /// QUERY TASK SET (81h).
    QueryTaskSet,
    /// QUERY ASYNCHRONOUS EVENT (82h).
    QueryAsynchronousEvent,
    /// A code this implementation does not support (answered TASK MANAGEMENT FUNCTION NOT
    /// SUPPORTED).
    Other(u8),
}

impl TaskManagementFunction {
    /// The code.
    pub fn code(self) -> u8 {
        match self {
            TaskManagementFunction::AbortTask => 0x01,
            TaskManagementFunction::AbortTaskSet => 0x02,
            TaskManagementFunction::ClearTaskSet => 0x04,
            TaskManagementFunction::LogicalUnitReset => 0x08,
            TaskManagementFunction::ClearAca => 0x40,
            TaskManagementFunction::QueryTask => 0x80,
            TaskManagementFunction::QueryTaskSet => 0x81,
            TaskManagementFunction::QueryAsynchronousEvent => 0x82,
            TaskManagementFunction::Other(c) => c,
        }
    }

    /// The function named by `c`.
    pub fn from_code(c: u8) -> TaskManagementFunction {
        match c {
            0x01 => TaskManagementFunction::AbortTask,
            0x02 => TaskManagementFunction::AbortTaskSet,
            0x04 => TaskManagementFunction::ClearTaskSet,
            0x08 => TaskManagementFunction::LogicalUnitReset,
            0x40 => TaskManagementFunction::ClearAca,
            0x80 => TaskManagementFunction::QueryTask,
            0x81 => TaskManagementFunction::QueryTaskSet,
            0x82 => TaskManagementFunction::QueryAsynchronousEvent,
            c => TaskManagementFunction::Other(c),
        }
    }

    /// The function as the SCSI core takes it, with the tag of the task managed; `None` for
    /// one it does not support.
    pub fn to_core(self, task_tag: u64) -> Option<TmfFunction> {
        Some(match self {
            TaskManagementFunction::AbortTask => TmfFunction::AbortTask(task_tag),
            TaskManagementFunction::AbortTaskSet => TmfFunction::AbortTaskSet,
            TaskManagementFunction::ClearTaskSet => TmfFunction::ClearTaskSet,
            TaskManagementFunction::LogicalUnitReset => TmfFunction::LogicalUnitReset,
            TaskManagementFunction::ClearAca => TmfFunction::ClearAca,
            TaskManagementFunction::QueryTask => TmfFunction::QueryTask(task_tag),
            TaskManagementFunction::QueryTaskSet => TmfFunction::QueryTaskSet,
            TaskManagementFunction::QueryAsynchronousEvent => TmfFunction::QueryAsynchronousEvent,
            TaskManagementFunction::Other(_) => return None,
        })
    }
}

/// SRP_TSK_MGMT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrpTskMgmt {
    /// Byte 1: SCSOLNT and UCSOLNT.
    pub sol_not: u8,
    /// TAG of this request.
    pub tag: u64,
    /// LOGICAL UNIT NUMBER.
    pub lun: u64,
    /// TASK MANAGEMENT FUNCTION.
    pub function: TaskManagementFunction,
    /// TAG OF TASK TO BE MANAGED (ABORT TASK, QUERY TASK).
    pub task_tag: u64,
}

impl SrpTskMgmt {
    pub(crate) fn decode(b: &[u8]) -> Result<SrpTskMgmt, IuError> {
        let (_, sol_not, _, tag, _, lun, _, function, _, task_tag) = parsed(
            (
                be_u8,
                be_u8,
                take(6usize),
                be_u64,
                take(4usize),
                be_u64,
                take(2usize),
                be_u8,
                be_u8,
                be_u64,
            )
                .parse(b),
        );
        Ok(SrpTskMgmt {
            sol_not,
            tag,
            lun,
            function: TaskManagementFunction::from_code(function),
            task_tag,
        })
    }

    /// Appends the 48 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        super::head(out, IuType::TskMgmt, self.sol_not, [0; 6], self.tag);
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.lun.to_be_bytes());
        out.extend_from_slice(&[0, 0, self.function.code(), 0]);
        out.extend_from_slice(&self.task_tag.to_be_bytes());
        out.extend_from_slice(&[0; 8]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iu::Iu;

    #[test]
    fn abort_task_names_the_task() {
        let t = SrpTskMgmt {
            sol_not: 0,
            tag: 100,
            lun: 0x0001_0000_0000_0000,
            function: TaskManagementFunction::AbortTask,
            task_tag: 42,
        };
        let mut b = Vec::new();
        t.encode(&mut b);
        assert_eq!(b.len(), 48);
        assert_eq!(b[30], 0x01);
        assert_eq!(&b[20..28], &0x0001_0000_0000_0000u64.to_be_bytes());
        assert_eq!(&b[32..40], &42u64.to_be_bytes());
        assert_eq!(Iu::decode(&b), Ok(Iu::TskMgmt(t)));
        assert_eq!(t.function.to_core(42), Some(TmfFunction::AbortTask(42)));
        assert_eq!(TaskManagementFunction::from_code(0x20).to_core(0), None);
    }
}
