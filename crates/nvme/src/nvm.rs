//! The NVM command set's I/O commands (NVM Command Set Specification 1.0) decoded into the
//! block operations every backend of this project runs (`scsi_core::Op`): Read, Write,
//! Flush, Write Zeroes, Dataset Management (deallocate), Compare and Verify. Decoding checks
//! what a controller must refuse before any data moves: a namespace that is not there, an
//! LBA range beyond its end, a transfer longer than MDTS, a data length that is not the
//! blocks', an SGL the transport cannot carry.

use scsi_core::Op;

use crate::opcode::NvmOpcode;
use crate::sqe::{SglKind, Sqe};
use crate::status::Status;

/// What a namespace is, to an I/O command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceGeometry {
    /// The logical block size.
    pub block_size: u32,
    /// The size in blocks.
    pub blocks: u64,
    /// Writes are refused (write protected).
    pub read_only: bool,
}

/// Where a command's data is, and which way it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// No data.
    None,
    /// `len` bytes from the host: in the capsule, or asked for with R2Ts.
    FromHost {
        /// Bytes.
        len: u32,
        /// They came in the capsule.
        in_capsule: bool,
    },
    /// `len` bytes to the host.
    ToHost {
        /// Bytes.
        len: u32,
    },
}

/// An I/O command, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoCommand {
    /// One block operation on the command's data buffer (offset 0), with the data it moves.
    Op {
        /// The operation.
        op: Op,
        /// Its data.
        transfer: Transfer,
    },
    /// Dataset Management with deallocation: the ranges are in the data (16 bytes each),
    /// to read with [`dsm_ranges`] once it is here.
    Deallocate {
        /// Ranges (1 to 256).
        ranges: u16,
        /// The data's transfer.
        transfer: Transfer,
    },
    /// Nothing to do but succeed (Dataset Management with only hints).
    Nothing,
}

/// The transfer an SGL describes for `len` bytes going `to_host` or not; Data SGL Length
/// Invalid when its length is not `len`, SGL Descriptor Type Invalid for a descriptor this
/// transport does not carry.
pub fn transfer(sqe: &Sqe, len: u32, to_host: bool) -> Result<Transfer, Status> {
    if len == 0 {
        return Ok(Transfer::None);
    }
    let (sgl_len, in_capsule) = match sqe.sgl().kind() {
        SglKind::InCapsule { offset, length } if !to_host => {
            if offset != 0 {
                return Err(Status::SGL_OFFSET_INVALID);
            }
            (length, true)
        }
        SglKind::Transport { length } => (length, false),
        // Keyed descriptors belong to RDMA; in-capsule data cannot go to the host.
        _ => return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
    };
    if sgl_len != len {
        return Err(Status::DATA_SGL_LENGTH_INVALID);
    }
    Ok(if to_host {
        Transfer::ToHost { len }
    } else {
        Transfer::FromHost { len, in_capsule }
    })
}

/// Decodes I/O command `sqe` for a namespace of `geometry` (`None`: the NSID names no
/// active namespace), with transfers of at most `max_transfer` bytes.
pub fn decode(
    sqe: &Sqe,
    geometry: Option<&NamespaceGeometry>,
    max_transfer: u32,
) -> Result<IoCommand, Status> {
    let op = NvmOpcode::from_code(sqe.opcode()).ok_or(Status::INVALID_OPCODE)?;
    if sqe.reserved_flags() != 0 {
        return Err(Status::INVALID_FIELD);
    }
    let g = geometry.ok_or(Status::INVALID_NAMESPACE)?;
    let slba = sqe.qword(10);
    let blocks = (sqe.cdw(12) & 0xffff) + 1;
    let fua = sqe.cdw(12) & 1 << 30 != 0;
    let bytes = u64::from(blocks) * u64::from(g.block_size);
    let range = |blocks: u64| -> Result<(), Status> {
        match slba.checked_add(blocks) {
            Some(end) if end <= g.blocks => Ok(()),
            _ => Err(Status::LBA_OUT_OF_RANGE),
        }
    };
    let sized = |to_host: bool| -> Result<Transfer, Status> {
        range(u64::from(blocks))?;
        if bytes > u64::from(max_transfer) {
            return Err(Status::INVALID_FIELD);
        }
        transfer(sqe, bytes as u32, to_host)
    };
    let writes = matches!(
        op,
        NvmOpcode::Write | NvmOpcode::WriteZeroes | NvmOpcode::DatasetManagement
    );
    if writes && g.read_only {
        // Namespace is Write Protected (generic 20h).
        return Err(Status {
            sc: 0x20,
            ..Status::INVALID_FIELD
        });
    }
    let op_of = |op: Op, transfer: Transfer| Ok(IoCommand::Op { op, transfer });
    match op {
        NvmOpcode::Read => op_of(
            Op::Read {
                lba: slba,
                blocks,
                offset: 0,
                fua,
            },
            sized(true)?,
        ),
        NvmOpcode::Write => op_of(
            Op::Write {
                lba: slba,
                blocks,
                offset: 0,
                fua,
            },
            sized(false)?,
        ),
        NvmOpcode::Compare => op_of(
            Op::Compare {
                lba: slba,
                blocks,
                offset: 0,
                same: false,
            },
            sized(false)?,
        ),
        NvmOpcode::Verify => {
            // Reads the blocks and checks them (a backend's read fails on a medium error);
            // no data reaches the host. The blocks pass through a buffer of the
            // controller's, so the same transfer limit holds.
            range(u64::from(blocks))?;
            if bytes > u64::from(max_transfer) {
                return Err(Status::INVALID_FIELD);
            }
            op_of(
                Op::Read {
                    lba: slba,
                    blocks,
                    offset: 0,
                    fua: true,
                },
                Transfer::None,
            )
        }
        NvmOpcode::Flush => op_of(Op::Flush { lba: 0, blocks: 0 }, Transfer::None),
        NvmOpcode::WriteZeroes => {
            range(u64::from(blocks))?;
            op_of(
                Op::WriteSame {
                    lba: slba,
                    blocks: u64::from(blocks),
                    zeros: true,
                    // DEAC: the blocks may be deallocated (they read back as zeros).
                    unmap: sqe.cdw(12) & 1 << 25 != 0,
                    fua,
                },
                Transfer::None,
            )
        }
        NvmOpcode::DatasetManagement => {
            let ranges = (sqe.cdw(10) & 0xff) as u16 + 1;
            // Linux's host sends room for all 256 ranges (4 KiB) whatever NR says: data up
            // to that, beyond the ranges, is taken and not read.
            let need = u32::from(ranges) * 16;
            let len = sqe.sgl().length();
            let len = if (need..=4096).contains(&len) {
                len
            } else {
                need
            };
            let t = transfer(sqe, len, false)?;
            if sqe.cdw(11) & 1 << 2 == 0 {
                // Only attributes (integral read, write hints): nothing to do.
                return Ok(IoCommand::Nothing);
            }
            Ok(IoCommand::Deallocate {
                ranges,
                transfer: t,
            })
        }
        _ => Err(Status::INVALID_OPCODE),
    }
}

/// The ranges of a Dataset Management's data, as deallocations, each checked against the
/// namespace: (first block, blocks). Empty ranges are skipped.
pub fn dsm_ranges(data: &[u8], geometry: &NamespaceGeometry) -> Result<Vec<Op>, Status> {
    let mut ops = Vec::new();
    for r in data.chunks_exact(16) {
        let blocks = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
        let lba = u64::from_le_bytes(r[8..16].try_into().unwrap_or_default());
        if blocks == 0 {
            continue;
        }
        if lba
            .checked_add(blocks)
            .is_none_or(|end| end > geometry.blocks)
        {
            return Err(Status::LBA_OUT_OF_RANGE);
        }
        ops.push(Op::Unmap { lba, blocks });
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqe::Sgl;

    const G: NamespaceGeometry = NamespaceGeometry {
        block_size: 512,
        blocks: 2048,
        read_only: false,
    };

    fn cmd(op: NvmOpcode, slba: u64, nlb0: u32, sgl: Sgl) -> Sqe {
        let mut s = Sqe::new(op.code(), 1);
        s.set_nsid(1);
        s.set_qword(10, slba);
        s.set_cdw(12, nlb0);
        s.set_sgl(sgl);
        s
    }

    #[test]
    fn reads_and_writes_become_block_operations() {
        let r = decode(
            &cmd(NvmOpcode::Read, 8, 7, Sgl::transport(4096)),
            Some(&G),
            1 << 20,
        );
        assert_eq!(
            r,
            Ok(IoCommand::Op {
                op: Op::Read {
                    lba: 8,
                    blocks: 8,
                    offset: 0,
                    fua: false
                },
                transfer: Transfer::ToHost { len: 4096 }
            })
        );
        let w = decode(
            &cmd(NvmOpcode::Write, 0, 1 | 1 << 30, Sgl::in_capsule(0, 1024)),
            Some(&G),
            1 << 20,
        );
        assert!(matches!(
            w,
            Ok(IoCommand::Op {
                op: Op::Write {
                    blocks: 2,
                    fua: true,
                    ..
                },
                transfer: Transfer::FromHost {
                    len: 1024,
                    in_capsule: true
                }
            })
        ));
    }

    #[test]
    fn what_a_controller_must_refuse() {
        let d = |s: &Sqe, g: Option<&NamespaceGeometry>| decode(s, g, 8192);
        // Past the end; wrapping around.
        assert_eq!(
            d(
                &cmd(NvmOpcode::Read, 2047, 1, Sgl::transport(1024)),
                Some(&G)
            ),
            Err(Status::LBA_OUT_OF_RANGE)
        );
        assert_eq!(
            d(
                &cmd(NvmOpcode::Read, u64::MAX, 0, Sgl::transport(512)),
                Some(&G)
            ),
            Err(Status::LBA_OUT_OF_RANGE)
        );
        // No namespace; longer than MDTS; SGL length not the blocks'; in-capsule data for a
        // read; an unknown opcode.
        assert_eq!(
            d(&cmd(NvmOpcode::Read, 0, 0, Sgl::transport(512)), None),
            Err(Status::INVALID_NAMESPACE)
        );
        assert_eq!(
            d(
                &cmd(NvmOpcode::Read, 0, 31, Sgl::transport(16384)),
                Some(&G)
            ),
            Err(Status::INVALID_FIELD)
        );
        assert_eq!(
            d(&cmd(NvmOpcode::Write, 0, 0, Sgl::transport(4096)), Some(&G)),
            Err(Status::DATA_SGL_LENGTH_INVALID)
        );
        assert_eq!(
            d(
                &cmd(NvmOpcode::Read, 0, 0, Sgl::in_capsule(0, 512)),
                Some(&G)
            ),
            Err(Status::SGL_DESCRIPTOR_TYPE_INVALID)
        );
        let odd = Sqe::new(0x7e, 1);
        assert_eq!(d(&odd, Some(&G)), Err(Status::INVALID_OPCODE));
        // A write to a write-protected namespace.
        let ro = NamespaceGeometry {
            read_only: true,
            ..G
        };
        assert_eq!(
            d(&cmd(NvmOpcode::Write, 0, 0, Sgl::transport(512)), Some(&ro))
                .unwrap_err()
                .sc,
            0x20
        );
    }

    #[test]
    fn write_zeroes_flush_and_deallocate() {
        let wz = decode(
            &cmd(NvmOpcode::WriteZeroes, 10, 99 | 1 << 25, Sgl::transport(0)),
            Some(&G),
            4096,
        );
        assert!(matches!(
            wz,
            Ok(IoCommand::Op {
                op: Op::WriteSame {
                    lba: 10,
                    blocks: 100,
                    zeros: true,
                    unmap: true,
                    ..
                },
                transfer: Transfer::None
            })
        ));
        let mut dsm = cmd(NvmOpcode::DatasetManagement, 0, 0, Sgl::in_capsule(0, 32));
        dsm.set_cdw(10, 1);
        dsm.set_cdw(11, 1 << 2);
        assert_eq!(
            decode(&dsm, Some(&G), 4096),
            Ok(IoCommand::Deallocate {
                ranges: 2,
                transfer: Transfer::FromHost {
                    len: 32,
                    in_capsule: true
                }
            })
        );
        let mut data = [0u8; 32];
        data[4..8].copy_from_slice(&16u32.to_le_bytes());
        data[8..16].copy_from_slice(&100u64.to_le_bytes());
        assert_eq!(
            dsm_ranges(&data, &G),
            Ok(vec![Op::Unmap {
                lba: 100,
                blocks: 16
            }])
        );
        data[8..16].copy_from_slice(&2040u64.to_le_bytes());
        assert_eq!(dsm_ranges(&data, &G), Err(Status::LBA_OUT_OF_RANGE));
        dsm.set_cdw(11, 0);
        assert_eq!(decode(&dsm, Some(&G), 4096), Ok(IoCommand::Nothing));
    }
}
