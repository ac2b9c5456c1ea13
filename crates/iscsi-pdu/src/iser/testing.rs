//! The iSER datamover on a bench: the target rig's SCSI core and session
//! ([`Rig`]), an [`IserConnection`] on it, and an initiator whose
//! registered memory is a map of STags to buffers. RDMA READs and WRITEs are copies into and
//! out of it, done at once or held by the caller, on a virtual clock; a key or range the
//! initiator never registered is a remote access error that closes the connection, as on a
//! real queue pair. Tests and the fuzz target drive it.

use std::collections::HashMap;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use scsi_core::Backend;

use super::{encode, DataOutRead, IserConnection, IserHeader, IserPlan, RemoteBuffer, Work};
use crate::chap::ENTROPY_LEN;
use crate::negotiation::{
    DigestAlgorithm, Negotiator, OperationalParams, Role, SessionType, Settings,
};
use crate::target_node::testing::{Options, Rig, INITIATOR, TARGET};
use crate::target_node::{Connection, Event, NoBuffer};
use crate::text::TextParams;
use crate::{Lun, Pdu, ScsiCommand, ScsiStatus, SerialNumber, Stage};

/// Where the initiator's buffers start in its address space.
pub const BASE: u64 = 0x7f00_0000_0000;

/// The target's settings on an iSER connection: digests None, InitialR2T=Yes (unsolicited
/// data only as immediate data), bursts of 64 KiB.
pub fn settings() -> Settings {
    Settings {
        header_digest: vec![DigestAlgorithm::None],
        data_digest: vec![DigestAlgorithm::None],
        max_recv_data_segment_length: 8192,
        operational: OperationalParams {
            initial_r2t: true,
            immediate_data: true,
            max_burst_length: 65_536,
            first_burst_length: 65_536,
            max_outstanding_r2t: 4,
            rdma_extensions: true,
            ..OperationalParams::default()
        },
        ..Settings::default()
    }
}

/// What Linux's iSER initiator offers.
pub fn offers() -> Vec<(String, String)> {
    [
        ("RDMAExtensions", "Yes"),
        ("TargetRecvDataSegmentLength", "8192"),
        ("InitiatorRecvDataSegmentLength", "262144"),
        ("MaxOutstandingR2T", "4"),
        ("MaxBurstLength", "65536"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// An RDMA READ issued and not yet done: what it answers, the task's buffer, where in it,
/// how much, from where.
pub type Read = (DataOutRead, Vec<u8>, usize, usize, RemoteBuffer);

/// The target's iSER connection and its initiator.
#[derive(Debug)]
pub struct IserRig {
    /// The target behind the connection (its connection 0 holds the session; the iSER
    /// machine takes its place on it).
    pub rig: Rig,
    /// The machine under test.
    pub iser: IserConnection<Vec<u8>>,
    /// The initiator's registered memory, by STag.
    pub memory: HashMap<u32, Vec<u8>>,
    /// PDUs the target sent.
    pub sent: Vec<Pdu>,
    /// RDMA READs issued and not yet done.
    pub reads: Vec<Read>,
    /// Hold RDMA READs instead of doing them at once.
    pub hold_reads: bool,
    /// The order of work requests, for the ordering checks: 'W' write, 'R' read, 'S' send.
    pub posted: String,
    /// The connection has closed, and why.
    pub closed: Option<String>,
    /// The virtual clock.
    pub now: Instant,
    /// The next CmdSN.
    pub cmd_sn: u32,
}

impl Default for IserRig {
    fn default() -> Self {
        IserRig::new()
    }
}

impl IserRig {
    /// A session logged in as Linux's iSER initiator does, its unit attention taken.
    pub fn new() -> IserRig {
        let options = Options {
            target: settings(),
            offers: offers(),
            ..Options::default()
        };
        let settings = options.settings;
        let rig = Rig::new(options);
        // The rig's connection 0 holds the session; this machine takes its place on it.
        let mut n = Negotiator::new(Role::Target, self::settings(), true, [0; ENTROPY_LEN]);
        let mut keys = TextParams::new();
        keys.push("InitiatorName", INITIATOR);
        keys.push("SessionType", "Normal");
        keys.push("TargetName", TARGET);
        for (k, v) in offers() {
            keys.push(k, v);
        }
        n.receive(Stage::LoginOperationalNegotiation, &keys)
            .unwrap();
        assert!(n.session().operational.rdma_extensions);
        assert_eq!(settings.session_type, SessionType::Normal);
        let op = n.session().operational;
        let conn = Connection::new(rig.now, settings, n, op, SerialNumber(1));
        assert_eq!(conn.max_recv_data_segment_length(), 8192);
        assert_eq!(conn.max_send_data_segment_length(), 8192);
        let mut p = IserRig {
            now: rig.now,
            closed: None,
            rig,
            iser: IserConnection::new(conn, 4),
            memory: HashMap::new(),
            sent: Vec::new(),
            reads: Vec::new(),
            hold_reads: false,
            posted: String::new(),
            cmd_sn: 1,
        };
        // TEST UNIT READY takes the unit attention of the new session (POWER ON).
        let mut tur = p.command(0x7f, false, 0, 0, Bytes::new());
        if let Pdu::ScsiCommand(c) = &mut tur {
            c.cdb = [0; 16];
            c.read = false;
        }
        p.send(&tur, IserHeader::default());
        assert_eq!(p.status(0x7f), Some(ScsiStatus::CHECK_CONDITION));
        p.sent.clear();
        p.posted.clear();
        p
    }

    /// An initiator's datamover ([`IserInitiator`](super::IserInitiator)) on a session as this
    /// rig's target negotiates it ([`settings`]: ImmediateData=Yes, InitialR2T=Yes, bursts of
    /// 64 KiB), its next CmdSN the rig's, receiving data segments of up to 256 KiB.
    pub fn initiator(&self) -> super::IserInitiator {
        use crate::initiator::Session;
        use crate::negotiation::{ConnectionParams, SessionParams};
        let params = SessionParams {
            operational: settings().operational,
            ..SessionParams::default()
        };
        let sn = SerialNumber(self.cmd_sn);
        let mut session = Session::new(params, 1, sn, SerialNumber(self.cmd_sn + 64));
        let conn = session.add_connection(ConnectionParams::default(), SerialNumber(0));
        super::IserInitiator::new(session, conn, 262_144)
    }

    /// Registers `data` as initiator memory named `stag` at [`BASE`].
    pub fn register(&mut self, stag: u32, data: Vec<u8>) -> RemoteBuffer {
        self.memory.insert(stag, data);
        RemoteBuffer { stag, va: BASE }
    }

    /// Sends a control-type message and follows its plan.
    pub fn send(&mut self, pdu: &Pdu, iser: IserHeader) {
        let mut m = BytesMut::new();
        encode(pdu, &iser, &mut m);
        self.message(&m);
    }

    /// Hands in a received Send and follows its plan; an error closes the connection.
    pub fn message(&mut self, m: &[u8]) {
        if self.closed.is_some() {
            return;
        }
        let now = self.now;
        let plan = {
            let mut nx = self.rig.core(0);
            self.iser.handle_message(now, m, &mut nx)
        };
        let mut plan = match plan {
            Ok(p) => p,
            Err(e) => {
                self.closed = Some(e.to_string());
                return;
            }
        };
        loop {
            let mut nx = self.rig.core(0);
            plan = match plan {
                IserPlan::Next => break,
                IserPlan::Allocate(len) => {
                    let b: Result<Vec<u8>, NoBuffer> = Ok(vec![0; len as usize]);
                    self.iser.handle_allocated(now, b, &mut nx)
                }
                IserPlan::Copy {
                    mut buffer,
                    at,
                    from,
                    len,
                } => {
                    buffer[at..at + len].copy_from_slice(&m[from..from + len]);
                    self.iser.handle_payload(now, buffer, &mut nx);
                    break;
                }
            };
        }
        self.run();
    }

    /// Runs the machine's requests and the work until neither has anything left.
    pub fn run(&mut self) {
        let now = self.now;
        loop {
            let mut moved = false;
            loop {
                let ev = {
                    let mut nx = self.rig.core(0);
                    self.iser.connection_mut().poll_event(now, &mut nx)
                };
                let Some(ev) = ev else { break };
                moved = true;
                match ev {
                    Event::Backend {
                        task, op, buffer, ..
                    } => {
                        self.rig.backend.submit(0, op, buffer);
                        while let Some((_, r, b)) = self.rig.backend.poll_completion() {
                            let mut nx = self.rig.core(0);
                            let c = self.iser.connection_mut();
                            c.handle_backend_done(now, task, b, r, &mut nx);
                        }
                    }
                    Event::BufferWanted { tag, len } => {
                        let mut nx = self.rig.core(0);
                        let c = self.iser.connection_mut();
                        c.handle_buffer(now, tag, Some(vec![0; len]), &mut nx);
                    }
                    Event::Completed(_) => {}
                }
            }
            loop {
                let w = {
                    let mut nx = self.rig.core(0);
                    self.iser.poll_work(&mut nx)
                };
                let Some(w) = w else { break };
                moved = true;
                match w {
                    Work::Send(pdu) => {
                        self.posted.push('S');
                        self.sent.push(pdu)
                    }
                    Work::HelloReply(_) => self.posted.push('S'),
                    Work::RdmaWrite {
                        payload,
                        len,
                        remote,
                        ..
                    } => {
                        self.posted.push('W');
                        let len = len as usize;
                        match self.remote(remote, len) {
                            Some(at) => {
                                let m = self.memory.get_mut(&remote.stag).expect("checked");
                                m[at..at + len].copy_from_slice(&payload.as_slice()[..len]);
                            }
                            None => self.remote_access_error(remote),
                        }
                    }
                    Work::RdmaRead {
                        read,
                        buffer,
                        at,
                        len,
                        remote,
                    } => {
                        self.posted.push('R');
                        self.reads.push((read, buffer, at, len, remote));
                    }
                }
            }
            if !self.hold_reads && !self.reads.is_empty() {
                self.complete_reads(usize::MAX);
                moved = true;
            }
            if !moved {
                return;
            }
        }
    }

    /// Where `len` bytes at `remote` are in the initiator's memory, if it registered them.
    fn remote(&self, remote: RemoteBuffer, len: usize) -> Option<usize> {
        let m = self.memory.get(&remote.stag)?;
        let at = usize::try_from(remote.va.checked_sub(BASE)?).ok()?;
        (at.checked_add(len)? <= m.len()).then_some(at)
    }

    /// A key or range the initiator never registered: the queue pair goes to the error state.
    fn remote_access_error(&mut self, remote: RemoteBuffer) {
        self.closed
            .get_or_insert_with(|| format!("remote access error at {remote:?}"));
    }

    /// Does up to `n` of the RDMA READs issued, oldest first (a read of memory the initiator
    /// never registered fails, and the connection closes).
    pub fn complete_reads(&mut self, n: usize) {
        let n = n.min(self.reads.len());
        let done: Vec<_> = self.reads.drain(..n).collect();
        for (read, mut buffer, at, len, remote) in done {
            let placed = match self.remote(remote, len) {
                Some(from) => {
                    let m = &self.memory[&remote.stag];
                    buffer[at..at + len].copy_from_slice(&m[from..from + len]);
                    true
                }
                None => {
                    self.remote_access_error(remote);
                    false
                }
            };
            let mut nx = self.rig.core(0);
            self.iser
                .handle_rdma_read(self.now, read, buffer, placed, &mut nx);
        }
        if !self.hold_reads {
            self.run();
        }
    }

    /// A READ (10) or WRITE (10) of `blocks` at `lba` with immediate data `imm`, taking the next
    /// CmdSN.
    pub fn command(&mut self, itt: u32, write: bool, lba: u32, blocks: u16, imm: Bytes) -> Pdu {
        let op = if write { 0x2a } else { 0x28 };
        let mut cdb = [0u8; 16];
        cdb[0] = op;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        let sn = self.cmd_sn;
        self.cmd_sn += 1;
        Pdu::ScsiCommand(ScsiCommand {
            final_bit: true,
            read: !write,
            write,
            lun: Lun::ZERO,
            initiator_task_tag: itt,
            expected_data_transfer_length: u32::from(blocks) * 512,
            cmd_sn: SerialNumber(sn),
            cdb,
            data: imm,
            ..ScsiCommand::default()
        })
    }

    /// A write of `data` at `lba` from buffer `stag`, its first `imm` bytes as immediate data
    /// (the write buffer named past them, as Linux's initiator and libiscsi do).
    pub fn write(&mut self, itt: u32, stag: u32, lba: u32, data: &[u8], imm: usize) {
        let mut b = self.register(stag, data.to_vec());
        b.va += imm as u64;
        let blocks = (data.len() / 512) as u16;
        let cmd = self.command(itt, true, lba, blocks, Bytes::copy_from_slice(&data[..imm]));
        let write = (imm < data.len()).then_some(b);
        self.send(&cmd, IserHeader { write, read: None });
    }

    /// A read of `blocks` at `lba` into a new buffer `stag`.
    pub fn read(&mut self, itt: u32, stag: u32, lba: u32, blocks: u16) {
        let b = self.register(stag, vec![0; usize::from(blocks) * 512]);
        let cmd = self.command(itt, false, lba, blocks, Bytes::new());
        self.send(
            &cmd,
            IserHeader {
                write: None,
                read: Some(b),
            },
        );
    }

    /// The status of `itt`, which must have come in a SCSI Response.
    pub fn status(&self, itt: u32) -> Option<ScsiStatus> {
        self.sent.iter().find_map(|p| match p {
            Pdu::ScsiResponse(r) if r.initiator_task_tag == itt => Some(r.status),
            _ => None,
        })
    }
}
