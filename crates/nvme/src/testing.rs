//! The test kit (feature `testing`): a subsystem's terms, a namespace, and the Connect and
//! Property Set commands a host sends first, as the tests, benches and fuzz targets of this
//! project build them, so that each says only what differs.

use crate::controller::{Namespace, SubsystemConfig};
use crate::fabrics::{property, Connect, ConnectData, PropertyAccess, CC_EN};
use crate::nvm::NamespaceGeometry;
use crate::opcode::{AdminOpcode, FabricsType};
use crate::sqe::{Sgl, Sqe};

/// The terms of subsystem `nqn` admitting `hosts` (none: any): 4 I/O queues of 128 entries,
/// 8 KiB in a capsule, 128 KiB in one transfer (MDTS 5).
pub fn subsystem_config(nqn: &str, hosts: &[&str]) -> SubsystemConfig {
    SubsystemConfig {
        nqn: nqn.into(),
        serial: "test".into(),
        model: "targetd".into(),
        firmware: "0.1.0".into(),
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        max_io_queues: 4,
        max_queue_entries: 128,
        max_in_capsule_data: 8192,
        mdts: 5,
        cntlids: crate::controller::ALL_CNTLIDS,
    }
}

/// Namespace `nsid` of `blocks` blocks of `block_size` bytes: thin, a volatile write cache,
/// fused Compare and Write of up to 8 blocks, in the default ANA group, with reservations.
pub fn namespace(nsid: u32, block_size: u32, blocks: u64) -> Namespace {
    Namespace {
        nsid,
        geometry: NamespaceGeometry {
            block_size,
            blocks,
            read_only: false,
        },
        nguid: [1; 16],
        uuid: [2; 16],
        thin: true,
        write_cache: true,
        compare_and_write: 8,
        ana_group: crate::ana::DEFAULT_GROUP,
        reservations: true,
        shared_reservations: false,
    }
}

/// A Connect command (CID `cid`) for queue `qid` of `sqsize + 1` entries with the keep alive
/// timeout `kato` (ms) and attributes `cattr`, its data in the capsule.
pub fn connect_sqe(cid: u16, qid: u16, sqsize: u16, kato: u32, cattr: u8) -> Sqe {
    let mut sqe = Sqe::new(AdminOpcode::Fabrics.code(), cid);
    sqe.set_fctype(FabricsType::Connect.code());
    sqe.set_sgl(Sgl::in_capsule(0, 1024));
    Connect {
        recfmt: 0,
        qid,
        sqsize,
        cattr,
        kato,
    }
    .to_sqe(&mut sqe);
    sqe
}

/// Connect's 1024 bytes of data: the host's identifier and NQN, the subsystem's NQN, and the
/// controller asked for.
pub fn connect_data(hostid: [u8; 16], cntlid: u16, subnqn: &str, hostnqn: &str) -> Vec<u8> {
    ConnectData {
        hostid,
        cntlid,
        subnqn: subnqn.into(),
        hostnqn: hostnqn.into(),
    }
    .to_bytes()
    .to_vec()
}

/// Property Set (CID `cid`) of CC: enabled, with 64-byte SQEs and 16-byte CQEs.
pub fn enable_sqe(cid: u16) -> Sqe {
    let mut set = Sqe::new(AdminOpcode::Fabrics.code(), cid);
    set.set_fctype(FabricsType::PropertySet.code());
    PropertyAccess {
        eight_bytes: false,
        offset: property::CC,
        value: u64::from(CC_EN | 6 << 16 | 4 << 20),
    }
    .to_sqe(&mut set);
    set
}
