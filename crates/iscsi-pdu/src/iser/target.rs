//! iSER's datamover for the iSCSI target connection (RFC 7145 sections 7.3 and 10): the
//! [`Connection`] machine makes every iSCSI decision as over TCP, and this layer moves what
//! it decides over RDMA:
//!
//! - a SCSI Command's iSER header names the initiator's buffers; a read whose data-in has
//!   nowhere to go, or a write whose solicited data-out has nowhere to come from, is
//!   rejected on arrival;
//! - an R2T is not sent: the target reads the burst itself with an RDMA READ from the
//!   initiator's write buffer ([`Work::RdmaRead`]), and hands it to the machine as the
//!   Data-Out that answers the R2T once the read completes. One read per task at a time (the
//!   task's buffer is lent to it); R2Ts of several tasks are read at once;
//! - Data-In is not sent: the data goes by RDMA WRITE into the initiator's read buffer
//!   ([`Work::RdmaWrite`]) and the status follows in a SCSI Response, sent after it on the same
//!   queue pair, so the initiator sees the data before the status;
//! - every other PDU goes in a Send behind an iSER header ([`Work::Send`]).
//!
//! The write buffer's base offset is the first byte the target solicits: the initiator
//! sends the unsolicited data (immediate data and unsolicited Data-Out) itself, as Linux's
//! initiator, libiscsi, LIO and tgt all take it.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use scsi_core::transport::TaskBuffer;

use super::header::{Hello, HelloReply, IserHeader, RemoteBuffer};
use super::message::{decode, Message, Received};
use super::IserError;
use crate::target_node::{Connection, Core, NoBuffer, Payload, Plan, Transmit};
use crate::{
    DataOut, Pdu, ReadyToTransfer, RejectReason, Residual, ScsiCommand, ScsiResponse, RESERVED_TAG,
};

/// What the connection asks of the RDMA shell, in order: post them on the queue pair in the
/// order given.
#[derive(Debug)]
#[must_use = "work is what the queue pair must carry out, in order"]
pub enum Work<B> {
    /// Send this PDU (behind an iSER header without buffers; [`super::encode`]).
    Send(Pdu),
    /// Answer an iSER Hello.
    HelloReply(HelloReply),
    /// Write `payload[..len]` into the initiator's buffer `remote` (a read's data-in).
    RdmaWrite {
        /// The command's Initiator Task Tag.
        itt: u32,
        /// The data.
        payload: Payload<B>,
        /// Bytes of it to write.
        len: u32,
        /// Where.
        remote: RemoteBuffer,
    },
    /// Read `len` bytes of the initiator's buffer `remote` into `buffer[at..at + len]` (an
    /// R2T's burst of data-out); hand the buffer back with
    /// [`IserConnection::handle_rdma_read`], naming `read`.
    RdmaRead {
        /// What the read answers.
        read: DataOutRead,
        /// The task's buffer, lent to the read.
        buffer: B,
        /// Where in it the burst goes.
        at: usize,
        /// Bytes.
        len: usize,
        /// Where from.
        remote: RemoteBuffer,
    },
}

/// An RDMA READ in flight: the Data-Out it stands for.
#[derive(Debug)]
pub struct DataOutRead {
    data_out: DataOut,
    len: u32,
}

impl DataOutRead {
    /// The command's Initiator Task Tag.
    pub fn itt(&self) -> u32 {
        self.data_out.initiator_task_tag
    }
}

/// What to do with the message just handed in.
#[derive(Debug)]
#[must_use = "a plan says what the message's data needs; its receive buffer waits on it"]
pub enum IserPlan<B> {
    /// Nothing more: its receive buffer may be posted again.
    Next,
    /// A write wants its data buffer ([`Plan::Allocate`]): allocate it and call
    /// [`IserConnection::handle_allocated`], keeping the message.
    Allocate(u32),
    /// Copy `msg[from..from + len]` into `buffer[at..at + len]`, then hand the buffer back
    /// with [`IserConnection::handle_payload`].
    Copy {
        /// The task's buffer.
        buffer: B,
        /// Where the data goes in it.
        at: usize,
        /// Where it is in the message.
        from: usize,
        /// Bytes.
        len: usize,
    },
}

/// The initiator's buffers of one command.
#[derive(Debug, Clone, Copy)]
struct Remote {
    read: Option<RemoteBuffer>,
    write: Option<RemoteBuffer>,
    /// The buffer offset of the first R2T: the byte the write buffer's base offset names.
    solicited_from: Option<u32>,
}

/// One iSER connection of the target in full feature phase. `B` is the task buffer type.
#[derive(Debug)]
pub struct IserConnection<B> {
    conn: Connection<B>,
    /// The buffers of the commands in the connection, by ITT.
    remote: HashMap<u32, Remote>,
    /// R2Ts waiting for their task's earlier read to finish: (Data-Out, length, where).
    reads: VecDeque<(DataOut, u32, RemoteBuffer)>,
    /// Tasks with an RDMA READ in flight, by ITT.
    reading: Vec<u32>,
    work: VecDeque<Work<B>>,
    /// Where the payload of the message being handled starts, while it waits for a buffer.
    payload_from: usize,
    /// The RDMA READs this side issues at once at most (ORD), for a Hello's reply.
    ord: u16,
}

/// The most zeros written after parameter data that falls short of the expected length.
pub const MAX_ZERO_FILL: u32 = 64 * 1024;

/// Parameter data shorter than the initiator's buffer (an INQUIRY answer of 96 bytes for an
/// allocation length of 255) is written with zeros after it, up to the expected length
/// (at most [`MAX_ZERO_FILL`]): over iSER no Data-In PDU counts the bytes, and an initiator
/// that takes its whole buffer as the answer instead of subtracting the residual the SCSI
/// Response carries (libiscsi up to 1.20 does) then reads zeros, not whatever its buffer
/// held. The residual still says how much was data. Medium data is left as it is: it fills
/// what the command asked for.
fn zero_filled<B>(payload: Payload<B>, len: u32, residual: Option<Residual>) -> (Payload<B>, u32) {
    match (payload, residual) {
        (Payload::Bytes(b), Some(Residual::Underflow(short))) if short > 0 => {
            let data = &b[..(len as usize).min(b.len())];
            let total = data.len() + short.min(MAX_ZERO_FILL) as usize;
            let mut filled = bytes::BytesMut::with_capacity(total);
            filled.extend_from_slice(data);
            filled.resize(total, 0);
            (Payload::Bytes(filled.freeze()), total as u32)
        }
        (payload, _) => (payload, len),
    }
}

impl<B: TaskBuffer> IserConnection<B> {
    /// iSER around a connection whose login agreed RDMAExtensions=Yes; `ord` is how many RDMA
    /// READs the queue pair issues at once.
    pub fn new(conn: Connection<B>, ord: u16) -> IserConnection<B> {
        IserConnection {
            conn,
            remote: HashMap::with_capacity(256),
            reads: VecDeque::new(),
            reading: Vec::new(),
            work: VecDeque::with_capacity(256),
            payload_from: 0,
            ord,
        }
    }

    /// The iSCSI machine: its events, backend completions, buffers, timers and close are
    /// driven as over TCP; its transmits only through [`IserConnection::poll_work`].
    pub fn connection(&self) -> &Connection<B> {
        &self.conn
    }

    /// See [`IserConnection::connection`].
    pub fn connection_mut(&mut self) -> &mut Connection<B> {
        &mut self.conn
    }

    /// RDMA READs in flight.
    pub fn reads_in_flight(&self) -> usize {
        self.reading.len()
    }

    /// A received Send. An error closes the connection: the message cannot be trusted (a
    /// malformed PDU in a sound message is rejected here instead, and the connection goes on).
    pub fn handle_message(
        &mut self,
        now: Instant,
        msg: &[u8],
        nexus: &mut impl Core,
    ) -> Result<IserPlan<B>, IserError> {
        let max = self.conn.max_recv_data_segment_length();
        let (iser, received) = match decode(msg, max) {
            Ok(Message::Control(iser, r)) => (iser, r),
            Ok(Message::Hello(h)) => {
                self.hello(h);
                return Ok(IserPlan::Next);
            }
            Ok(Message::HelloReply(_)) => return Err(IserError::Unexpected("HelloReply")),
            Err(e) => {
                let Some((reason, header)) = e.reject() else {
                    return Err(e);
                };
                self.conn.handle_reject(now, reason, header, nexus);
                return Ok(IserPlan::Next);
            }
        };
        let plan = match received {
            Received::Pdu(pdu) => {
                if let Pdu::ScsiCommand(cmd) = &pdu {
                    if let Err(reason) = self.command(cmd, &iser, 0) {
                        self.conn.handle_reject(now, reason, &pdu.bhs(), nexus);
                        return Ok(IserPlan::Next);
                    }
                }
                self.conn.handle_pdu(now, pdu, nexus)
            }
            Received::Header {
                pdu,
                header,
                payload,
            } => {
                let len = payload.len() as u32;
                if let Pdu::ScsiCommand(cmd) = &pdu {
                    if let Err(reason) = self.command(cmd, &iser, len) {
                        self.conn.handle_reject(now, reason, &header, nexus);
                        return Ok(IserPlan::Next);
                    }
                }
                self.payload_from = payload.start;
                self.conn.handle_header(now, pdu, &header, len, nexus)
            }
        };
        Ok(self.plan(plan))
    }

    /// The buffer an [`IserPlan::Allocate`] asked for, or why there is none.
    pub fn handle_allocated(
        &mut self,
        now: Instant,
        buffer: Result<B, NoBuffer>,
        nexus: &mut impl Core,
    ) -> IserPlan<B> {
        let plan = self.conn.handle_allocated(now, buffer, nexus);
        self.plan(plan)
    }

    /// The payload of an [`IserPlan::Copy`] is in `buffer`.
    pub fn handle_payload(&mut self, now: Instant, buffer: B, nexus: &mut impl Core) {
        self.conn.handle_payload(now, buffer, nexus);
    }

    /// An RDMA READ has ended; `placed` false when it failed (the queue pair is then in the
    /// error state, and the task ends with an error).
    pub fn handle_rdma_read(
        &mut self,
        now: Instant,
        read: DataOutRead,
        buffer: B,
        placed: bool,
        nexus: &mut impl Core,
    ) {
        let itt = read.itt();
        self.reading.retain(|&t| t != itt);
        self.conn
            .handle_placed_data_out(now, read.data_out, read.len, buffer, placed, nexus);
    }

    /// The next work request, in the order they must be posted.
    pub fn poll_work(&mut self, nexus: &mut impl Core) -> Option<Work<B>> {
        loop {
            if let Some(w) = self.work.pop_front() {
                return Some(w);
            }
            if let Some(t) = self.conn.poll_transmit() {
                self.transmit(t, nexus);
                continue;
            }
            // Reads wait for the transmits before them: an R2T's read starts once the
            // responses queued before it are out.
            if !self.start_read() {
                return None;
            }
        }
    }

    /// Records a command's buffers, or why it cannot run over iSER.
    fn command(
        &mut self,
        cmd: &ScsiCommand,
        iser: &IserHeader,
        immediate: u32,
    ) -> Result<(), RejectReason> {
        let edtl = cmd.expected_data_transfer_length;
        let op = self.conn.operational();
        let data_in = match (cmd.read, cmd.write) {
            (true, false) => edtl,
            (true, true) => cmd.bidirectional_read_length.unwrap_or(0),
            _ => 0,
        };
        let unsolicited = if !cmd.write {
            0
        } else if op.initial_r2t {
            immediate
        } else {
            op.first_burst_length.min(edtl).max(immediate)
        };
        let solicits = cmd.write && edtl > unsolicited;
        if (data_in > 0 && iser.read.is_none()) || (solicits && iser.write.is_none()) {
            tracing::debug!(
                itt = cmd.initiator_task_tag,
                data_in,
                solicits,
                ?iser,
                "a command without the buffers its data needs"
            );
            return Err(RejectReason::ProtocolError);
        }
        let itt = cmd.initiator_task_tag;
        if itt == RESERVED_TAG {
            return Ok(());
        }
        // Commands that ended without a response (aborted) leave their entries behind: drop
        // them once they outnumber the tasks, so a peer cannot grow the map.
        if self.remote.len() > 2 * self.conn.task_count() + 64 {
            let conn = &self.conn;
            self.remote.retain(|&t, _| conn.has_task(t));
        }
        self.remote.insert(
            itt,
            Remote {
                read: iser.read,
                write: iser.write,
                solicited_from: None,
            },
        );
        Ok(())
    }

    fn hello(&mut self, h: Hello) {
        self.work.push_back(Work::HelloReply(h.reply(self.ord)));
    }

    fn plan(&mut self, plan: Plan<B>) -> IserPlan<B> {
        match plan {
            Plan::Next | Plan::Discard => IserPlan::Next,
            Plan::Allocate(len) => IserPlan::Allocate(len),
            Plan::Receive { buffer, at, len } => IserPlan::Copy {
                buffer,
                at,
                from: self.payload_from,
                len,
            },
        }
    }

    /// Turns one of the machine's transmits into work.
    fn transmit(&mut self, t: Transmit<B>, nexus: &mut impl Core) {
        match t {
            Transmit::Pdu(Pdu::ReadyToTransfer(r2t)) => self.solicit(r2t),
            Transmit::Pdu(Pdu::ScsiResponse(mut r)) => {
                // No Data-In or R2T PDU went on the wire.
                r.exp_data_sn = 0;
                self.remote.remove(&r.initiator_task_tag);
                self.work.push_back(Work::Send(Pdu::ScsiResponse(r)));
            }
            Transmit::Pdu(pdu) => self.work.push_back(Work::Send(pdu)),
            Transmit::DataIn {
                itt,
                payload,
                len,
                status,
                ..
            } => {
                let (payload, len) = zero_filled(payload, len, status.map(|s| s.residual));
                // A command with data-in has a read buffer: `command` made sure of it.
                match self.remote.get(&itt).and_then(|r| r.read) {
                    Some(remote) => self.work.push_back(Work::RdmaWrite {
                        itt,
                        payload,
                        len,
                        remote,
                    }),
                    None => tracing::error!(itt, "data-in without a read buffer is dropped"),
                }
                let Some(st) = status else { return };
                self.remote.remove(&itt);
                let (exp, max) = nexus.window();
                let r = ScsiResponse {
                    residual: st.residual,
                    status: st.status,
                    initiator_task_tag: itt,
                    stat_sn: st.stat_sn,
                    exp_cmd_sn: exp,
                    max_cmd_sn: max,
                    exp_data_sn: 0,
                    ..ScsiResponse::default()
                };
                self.work.push_back(Work::Send(Pdu::ScsiResponse(r)));
            }
        }
    }

    /// An R2T: its burst is read from the initiator's write buffer.
    fn solicit(&mut self, r2t: ReadyToTransfer) {
        let itt = r2t.initiator_task_tag;
        let Some(r) = self.remote.get_mut(&itt) else {
            return;
        };
        let Some(write) = r.write else {
            return;
        };
        let from = *r.solicited_from.get_or_insert(r2t.buffer_offset);
        let remote = RemoteBuffer {
            stag: write.stag,
            va: write
                .va
                .wrapping_add(u64::from(r2t.buffer_offset.saturating_sub(from))),
        };
        let d = DataOut {
            final_bit: true,
            lun: r2t.lun,
            initiator_task_tag: itt,
            target_transfer_tag: r2t.target_transfer_tag,
            data_sn: 0,
            buffer_offset: r2t.buffer_offset,
            ..DataOut::default()
        };
        self.reads
            .push_back((d, r2t.desired_data_transfer_length, remote));
    }

    /// Starts the first waiting read whose task has none in flight; false when none can start.
    fn start_read(&mut self) -> bool {
        let reading = &self.reading;
        let Some(i) = self
            .reads
            .iter()
            .position(|(d, ..)| !reading.contains(&d.initiator_task_tag))
        else {
            return false;
        };
        let (d, len, remote) = self.reads.remove(i).expect("found");
        let itt = d.initiator_task_tag;
        // None: the task ended meanwhile (aborted); nothing is read for it.
        if let Some(buffer) = self.conn.lend_data_out_buffer(&d, len) {
            self.reading.push(itt);
            let at = d.buffer_offset as usize;
            self.work.push_back(Work::RdmaRead {
                read: DataOutRead { data_out: d, len },
                buffer,
                at,
                len: len as usize,
                remote,
            });
        }
        true
    }
}
