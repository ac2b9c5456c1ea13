//! One SRP channel as an initiator runs it, over any verbs that give IU buffers and memory
//! the peer reaches: a real device (rdma-sys) or a software fabric's endpoint. The login is the
//! caller's (it is how the connection is made: rdma_cm's private data, or a switch's); from
//! its SRP_LOGIN_RSP on, the channel counts credits, sends SRP_CMDs whose data buffers lie in
//! its [`DataMemory`], answers the target's SRP_CRED_REQs, notes an SRP_T_LOGOUT, and hands
//! back each SRP_RSP with the data-in that reached its memory.
//!
//! Time comes in with each command ([`InitiatorChannel::send`]); with a timeout set
//! ([`InitiatorChannel::set_timeout`]), a command unanswered by its deadline ends the channel:
//! the caller sleeps until [`InitiatorChannel::poll_timeout`] and calls
//! [`InitiatorChannel::handle_timeout`], which disconnects the queue pair (so the target can
//! no longer reach the memory the commands lent it) and gives every command in flight back.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use scsi_core::Residual;

use super::{DataMemory, ExposeError, Registration};
use crate::iu::{
    DataBufferDescriptor, Iu, SrpAerRsp, SrpCmd, SrpCredRsp, SrpILogout, SrpLoginRsp,
    TargetLogoutReason, TaskAttribute,
};
use rdma::verbs::{MessageBuffers, PeerMemory, Verbs, VerbsError, WorkOp};

/// Receives posted beyond the credit: for the target's own requests (SRP_CRED_REQ,
/// SRP_T_LOGOUT, SRP_AER_REQ), which take none.
pub const SPARE_RECEIVES: u32 = 4;

/// A command as the channel sends it.
#[derive(Debug, Clone, Copy)]
pub struct Command<'a> {
    /// Its tag, unique among the channel's commands in flight.
    pub tag: u64,
    /// The 8-byte LUN field.
    pub lun: u64,
    /// The CDB.
    pub cdb: &'a [u8],
    /// Data-out, copied into the channel's memory.
    pub data_out: Option<&'a [u8]>,
    /// Bytes of data-in expected (without data-out).
    pub data_in: u32,
    /// Regions the data buffer is cut into, each registered apart (1: a direct descriptor).
    pub regions: usize,
    /// Put only the first descriptor in the IU: the target fetches the table.
    pub partial: bool,
    /// Task attribute.
    pub attribute: TaskAttribute,
}

/// What came back for a command (or a task management function).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Its tag.
    pub tag: u64,
    /// STATUS.
    pub status: u8,
    /// Sense data.
    pub sense: Vec<u8>,
    /// Data-in residual.
    pub data_in_residual: Residual,
    /// Data-out residual.
    pub data_out_residual: Residual,
    /// The data-in that reached the channel's memory (a read's).
    pub data: Vec<u8>,
}

impl Answer {
    /// Sense key, ASC and ASCQ (fixed format).
    pub fn sense_code(&self) -> Option<(u8, u8, u8)> {
        (self.sense.len() >= 14).then(|| (self.sense[2] & 0x0f, self.sense[12], self.sense[13]))
    }
}

/// Why a command was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// No credit left: wait for a response.
    #[error("no credit left")]
    NoCredit,
    /// The channel is over (logged out, or its queue pair broken).
    #[error("the channel is over")]
    Gone,
    /// The verbs have no IU buffer free.
    #[error("no IU buffer free")]
    NoIuBuffer,
    /// The data buffer could not be laid out or registered.
    #[error("data buffer: {0}")]
    Buffer(#[from] ExposeError),
}

/// Where a command in flight keeps its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// A place of the channel's memory; data-in comes back into it when `read`.
    Memory {
        /// A read's.
        read: bool,
    },
    /// Nowhere: a write whose data went in its SRP_CMD.
    Immediate,
}

/// An initiator's SRP channel. See the module's documentation.
#[derive(Debug)]
pub struct InitiatorChannel<V: Verbs + PeerMemory> {
    qp: V::Qp,
    memory: DataMemory<V::Memory>,
    credit: i64,
    /// Commands in flight, by tag: where their data is, and when they time out.
    buffers: HashMap<u64, (Held, Option<Instant>)>,
    /// A command's timeout ([`InitiatorChannel::set_timeout`]).
    timeout: Option<Duration>,
    /// Deadlines in the order they were set (monotonic); an entry whose command was answered
    /// is skipped.
    deadlines: VecDeque<(Instant, u64)>,
    /// Whether the SRP_LOGIN_RSP granted immediate data.
    immediate_granted: bool,
    /// Where immediate data starts in an SRP_CMD, once it is used.
    imm_data_offset: Option<usize>,
    max_it_iu_len: usize,
    logged_out: Option<TargetLogoutReason>,
    /// Asynchronous events the target reported (SRP_AER_REQ), not yet taken.
    events: Vec<AsyncEvent>,
    scratch: Vec<u8>,
}

/// An asynchronous event a target reported (SRP_AER_REQ): a logical unit's sense data, a
/// unit attention such as CAPACITY DATA HAS CHANGED.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AsyncEvent {
    /// The 8-byte LUN.
    pub lun: u64,
    /// The sense data.
    pub sense: Vec<u8>,
}

impl<V> InitiatorChannel<V>
where
    V: Verbs + PeerMemory + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    /// The channel of queue pair `qp`, logged in with `rsp`: its receives posted, its data
    /// memory of `places` places of `place_len` bytes made and registered as `registration`
    /// says.
    pub fn new(
        verbs: &mut V,
        qp: V::Qp,
        rsp: &SrpLoginRsp,
        registration: Registration,
        places: usize,
        place_len: usize,
    ) -> Result<InitiatorChannel<V>, VerbsError> {
        for _ in 0..rsp.req_lim_delta + SPARE_RECEIVES {
            let b = verbs.message_buffer().ok_or(VerbsError::Registration)?;
            verbs.post_recv(qp, 0, b);
        }
        let memory = DataMemory::new(verbs, registration, places, place_len)?;
        Ok(InitiatorChannel {
            qp,
            memory,
            credit: i64::from(rsp.req_lim_delta),
            buffers: HashMap::new(),
            timeout: None,
            deadlines: VecDeque::new(),
            immediate_granted: rsp.immediate_data,
            imm_data_offset: None,
            max_it_iu_len: rsp.max_it_iu_len as usize,
            logged_out: None,
            events: Vec::new(),
            scratch: Vec::new(),
        })
    }

    /// The queue pair.
    pub fn qp(&self) -> V::Qp {
        self.qp
    }

    /// Requests it may still send.
    pub fn credit(&self) -> i64 {
        self.credit
    }

    /// Commands sent and not answered.
    pub fn in_flight(&self) -> usize {
        self.buffers.len()
    }

    /// Sends the data of writes that fit in the IU as immediate data at `offset`, the
    /// IMMEDIATE DATA OFFSET the login asked for, if the SRP_LOGIN_RSP granted it
    /// (IMMEDIATE DATA SUPPORTED). Returns whether it will.
    pub fn use_immediate_data(&mut self, offset: u16) -> bool {
        if self.immediate_granted {
            self.imm_data_offset = Some(usize::from(offset));
        }
        self.immediate_granted
    }

    /// Whether writes of up to this many bytes go as immediate data.
    pub fn immediate_data_limit(&self) -> usize {
        self.imm_data_offset
            .map_or(0, |o| self.max_it_iu_len.saturating_sub(o))
    }

    /// Why the target logged the channel out, if it did.
    pub fn logged_out(&self) -> Option<TargetLogoutReason> {
        self.logged_out
    }

    /// Whether the channel is over: logged out by the target, or its queue pair broken.
    pub fn is_gone(&self, verbs: &V) -> bool {
        self.logged_out.is_some() || verbs.is_error(self.qp)
    }

    /// The largest command it can send as `regions` regions.
    pub fn max_len(&self, regions: usize) -> usize {
        self.memory.max_len(regions)
    }

    /// Gives commands sent from now on `timeout` to be answered (`None`: forever).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// When [`InitiatorChannel::handle_timeout`] is next due: the oldest command's deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.front().map(|&(at, _)| at)
    }

    /// Time has come to `now`: if a command is past its deadline, the channel ends. Its queue
    /// pair is disconnected, so that the target can no longer read or write the memory the
    /// commands lent it, then that memory is released and the tags of every command in flight
    /// are returned (none are answered after). Empty when nothing was due.
    pub fn handle_timeout(&mut self, now: Instant, verbs: &mut V) -> Vec<u64> {
        self.prune_deadlines();
        if self.deadlines.front().is_none_or(|&(at, _)| at > now) {
            return Vec::new();
        }
        verbs.disconnect(self.qp);
        self.deadlines.clear();
        let mut tags: Vec<u64> = self.buffers.keys().copied().collect();
        tags.sort_unstable();
        for &tag in &tags {
            if let Some((Held::Memory { .. }, _)) = self.buffers.remove(&tag) {
                self.memory.release(verbs, tag);
            }
        }
        self.buffers.clear();
        tags
    }

    /// Drops the deadlines at the front whose commands were answered.
    fn prune_deadlines(&mut self) {
        while let Some(&(at, tag)) = self.deadlines.front() {
            if self.buffers.get(&tag).is_some_and(|&(_, d)| d == Some(at)) {
                break;
            }
            self.deadlines.pop_front();
        }
    }

    /// Enters a command sent at `now`, with its deadline.
    fn enter(&mut self, now: Instant, tag: u64, held: Held) {
        let deadline = self.timeout.map(|t| now + t);
        if let Some(at) = deadline {
            self.deadlines.push_back((at, tag));
        }
        self.buffers.insert(tag, (held, deadline));
    }

    /// Sends `cmd` at `now`, taking a credit.
    pub fn send(
        &mut self,
        now: Instant,
        verbs: &mut V,
        cmd: &Command<'_>,
    ) -> Result<(), SendError> {
        if self.is_gone(verbs) {
            return Err(SendError::Gone);
        }
        if self.credit <= 0 {
            return Err(SendError::NoCredit);
        }
        let base = SrpCmd {
            sol_not: 0,
            tag: cmd.tag,
            lun: cmd.lun,
            task_attribute: cmd.attribute,
            cdb: cmd.cdb,
            ..SrpCmd::default()
        };
        if let (Some(data), Some(offset)) = (cmd.data_out, self.imm_data_offset) {
            self.scratch.clear();
            if cmd.regions <= 1
                && !cmd.partial
                && super::encode_immediate_write(
                    &base,
                    data,
                    offset,
                    self.max_it_iu_len,
                    &mut self.scratch,
                )
            {
                // The data goes in the SRP_CMD: no place of the memory's.
                self.post(verbs)?;
                self.credit -= 1;
                self.enter(now, cmd.tag, Held::Immediate);
                return Ok(());
            }
        }
        let len = cmd.data_out.map_or(cmd.data_in as usize, <[u8]>::len);
        let exposed =
            self.memory
                .expose(verbs, cmd.tag, len, cmd.regions, cmd.partial, cmd.data_out)?;
        let descriptor = exposed.descriptor();
        let (data_out, data_in) = match cmd.data_out {
            Some(_) => (descriptor, DataBufferDescriptor::None),
            None => (DataBufferDescriptor::None, descriptor),
        };
        let iu = SrpCmd {
            data_out,
            data_in,
            ..base
        };
        self.scratch.clear();
        iu.encode(&mut self.scratch);
        let sent = self.post(verbs);
        if sent.is_err() || self.scratch.len() > self.max_it_iu_len {
            self.memory.release(verbs, cmd.tag);
            return Err(sent
                .err()
                .unwrap_or(SendError::Buffer(ExposeError::TooLarge {
                    len,
                    regions: cmd.regions,
                    place: self.max_it_iu_len,
                })));
        }
        self.credit -= 1;
        let read = cmd.data_out.is_none() && len > 0;
        self.enter(now, cmd.tag, Held::Memory { read });
        Ok(())
    }

    /// Sends what `scratch` holds.
    fn post(&mut self, verbs: &mut V) -> Result<(), SendError> {
        let mut b = verbs.message_buffer().ok_or(SendError::NoIuBuffer)?;
        let len = self.scratch.len();
        if len > b.len() {
            return Err(SendError::NoIuBuffer);
        }
        b[..len].copy_from_slice(&self.scratch);
        verbs.post_send(self.qp, 0, b, len);
        Ok(())
    }

    /// The asynchronous events reported since the last call (each answered already).
    pub fn take_events(&mut self) -> Vec<AsyncEvent> {
        std::mem::take(&mut self.events)
    }

    /// Logs the channel out (SRP_I_LOGOUT); the target then disconnects it.
    pub fn logout(&mut self, verbs: &mut V) -> Result<(), SendError> {
        self.scratch.clear();
        SrpILogout { tag: 0 }.encode(&mut self.scratch);
        self.post(verbs)
    }

    /// Takes the channel's completions until an SRP_RSP comes: its answer (with the data-in
    /// gathered from memory), or `None` when there is nothing more now.
    pub fn poll(&mut self, verbs: &mut V) -> Option<Answer> {
        while let Some(wc) = verbs.poll(self.qp) {
            if wc.op != WorkOp::Recv || wc.result.is_err() {
                // A send's buffer goes back; a flushed receive with the channel.
                verbs.recycle_message(wc.buffer);
                continue;
            }
            let answer = match Iu::decode(&wc.buffer[..wc.len]) {
                Ok(Iu::Rsp(r)) => {
                    self.credit += i64::from(r.req_lim_delta);
                    let mut data = Vec::new();
                    let held = self.buffers.remove(&r.tag).map(|(held, _)| held);
                    self.prune_deadlines();
                    if let Some(Held::Memory { read }) = held {
                        if read {
                            self.memory.read_data(verbs, r.tag, &mut data);
                            let residual = match r.data_in_residual {
                                Residual::Underflow(n) => n as usize,
                                _ => 0,
                            };
                            data.truncate(data.len().saturating_sub(residual));
                        }
                        self.memory.release(verbs, r.tag);
                    }
                    Some(Answer {
                        tag: r.tag,
                        status: r.status,
                        sense: r.sense.to_vec(),
                        data_in_residual: r.data_in_residual,
                        data_out_residual: r.data_out_residual,
                        data,
                    })
                }
                Ok(Iu::CredReq(r)) => {
                    self.credit += i64::from(r.req_lim_delta);
                    self.scratch.clear();
                    SrpCredRsp { tag: r.tag }.encode(&mut self.scratch);
                    let _ = self.post(verbs);
                    None
                }
                Ok(Iu::AerReq(r)) => {
                    self.credit += i64::from(r.req_lim_delta);
                    self.events.push(AsyncEvent {
                        lun: r.lun,
                        sense: r.sense.to_vec(),
                    });
                    self.scratch.clear();
                    SrpAerRsp { tag: r.tag }.encode(&mut self.scratch);
                    let _ = self.post(verbs);
                    None
                }
                Ok(Iu::TLogout(t)) => {
                    self.logged_out = Some(t.reason);
                    None
                }
                // Anything else from a target is ignored (a malformed IU).
                _ => None,
            };
            verbs.post_recv(self.qp, 0, wc.buffer);
            if answer.is_some() {
                return answer;
            }
        }
        None
    }
}
