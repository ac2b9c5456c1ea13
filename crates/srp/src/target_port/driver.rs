//! What every shell of a target [`Channel`] does with its queue pair, whatever its verbs and
//! buffers: hand each completion to the machine (an IU received, then its receive posted
//! again; the data-out or descriptor table an RDMA READ brought), and post what the machine
//! wants transmitted, in its order (sends, RDMA WRITEs of data-in, RDMA READs of data-out and
//! of descriptor tables). targetd's reactor and the test rig both drive their channels
//! through it; what differs between them, where buffers come from, is [`Buffers`].

use std::collections::HashMap;
use std::time::Instant;

use scsi_core::transport::TaskBuffer;

use super::channel::{Channel, Core, Payload, Transmit};
use rdma::verbs::{Completion, Verbs, WorkOp};

/// How a shell's buffers become its verbs' and back.
pub trait Buffers<V: Verbs, B> {
    /// A buffer holding `iu` (an IU the channel encoded), to send.
    fn iu(&mut self, verbs: &mut V, iu: &[u8]) -> Option<V::Buffer>;
    /// A task's data buffer, to RDMA from or into.
    fn data(&mut self, buffer: B) -> V::Buffer;
    /// A task buffer of `len` bytes now, for a write's immediate data, if there is room
    /// without waiting.
    fn immediate(&mut self, len: usize) -> Option<B>;
    /// A task's data buffer back from its RDMA READ (`None`: not a task's).
    fn task(&mut self, buffer: V::Buffer) -> Option<B>;
    /// Parameter data the core built, in memory the verbs may RDMA WRITE from.
    fn payload(&mut self, verbs: &mut V, bytes: Vec<u8>) -> Option<V::Buffer>;
    /// A buffer of `len` bytes for a descriptor table.
    fn table(&mut self, verbs: &mut V, len: usize) -> Option<V::Buffer>;
    /// A buffer back from a send, an RDMA WRITE or a flushed receive.
    fn recycle(&mut self, verbs: &mut V, buffer: V::Buffer);
}

/// Why a channel's queue pair must be disconnected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Broken {
    /// A send or RDMA WRITE failed: what follows must not tell the initiator all went well.
    #[error("a send or RDMA WRITE failed")]
    TransferFailed,
    /// No buffer to send an IU with.
    #[error("no IU buffer left to send with")]
    NoIuBuffer,
    /// No registered memory for the core's parameter data.
    #[error("no registered memory for parameter data")]
    NoPayloadBuffer,
}

/// What an RDMA READ in flight was for.
#[derive(Debug, Clone, Copy)]
enum Read {
    /// A command's data-out.
    DataOut(u64),
    /// A command's descriptor table.
    Table(u64),
}

/// One channel's queue pair, as a shell drives it.
#[derive(Debug)]
pub struct Driver<Q> {
    qp: Q,
    /// RDMA READs in flight, by transfer (their work request ids).
    reads: HashMap<u64, Read>,
    /// Where the machine encodes the IUs it sends.
    scratch: Vec<u8>,
}

impl<Q: Copy> Driver<Q> {
    /// The driver of queue pair `qp`.
    pub fn new(qp: Q) -> Driver<Q> {
        Driver {
            qp,
            reads: HashMap::new(),
            scratch: Vec::with_capacity(256),
        }
    }

    /// The queue pair.
    pub fn qp(&self) -> Q {
        self.qp
    }

    /// Hands a completion of the queue pair to `machine`.
    pub fn complete<V, B>(
        &mut self,
        now: Instant,
        wc: Completion<V::Buffer>,
        machine: &mut Channel<B>,
        core: &mut impl Core,
        verbs: &mut V,
        buffers: &mut impl Buffers<V, B>,
    ) -> Result<(), Broken>
    where
        V: Verbs<Qp = Q>,
        B: TaskBuffer,
    {
        let ok = wc.result.is_ok();
        match wc.op {
            WorkOp::Recv if ok => {
                machine.handle_iu(now, &wc.buffer[..wc.len], core, &mut |len| {
                    buffers.immediate(len)
                });
                verbs.post_recv(self.qp, 0, wc.buffer);
            }
            WorkOp::RdmaRead => match self.reads.remove(&wc.wr_id) {
                Some(Read::DataOut(tag)) => match buffers.task(wc.buffer) {
                    Some(b) => machine.handle_data_out(now, tag, wc.wr_id, b, ok, core),
                    // Only the shell's own `data` makes the buffers of data-out reads.
                    None => tracing::error!(tag, "a data-out read came back in an IU buffer"),
                },
                Some(Read::Table(tag)) => {
                    let table = ok.then_some(&wc.buffer[..wc.len]);
                    machine.handle_table(now, tag, wc.wr_id, table, core);
                    buffers.recycle(verbs, wc.buffer);
                }
                None => buffers.recycle(verbs, wc.buffer),
            },
            WorkOp::Send | WorkOp::RdmaWrite if !ok => {
                buffers.recycle(verbs, wc.buffer);
                return Err(Broken::TransferFailed);
            }
            _ => buffers.recycle(verbs, wc.buffer),
        }
        Ok(())
    }

    /// Posts everything `machine` wants transmitted, in its order. Returns whether there was
    /// anything.
    pub fn transmit<V, B>(
        &mut self,
        now: Instant,
        machine: &mut Channel<B>,
        core: &mut impl Core,
        verbs: &mut V,
        buffers: &mut impl Buffers<V, B>,
    ) -> Result<bool, Broken>
    where
        V: Verbs<Qp = Q>,
        B: TaskBuffer,
    {
        let mut any = false;
        let qp = self.qp;
        while let Some(t) = machine.poll_transmit(&mut self.scratch) {
            any = true;
            match t {
                Transmit::Send { len, .. } => {
                    let b = buffers
                        .iu(verbs, &self.scratch[..len])
                        .ok_or(Broken::NoIuBuffer)?;
                    verbs.post_send(qp, 0, b, len);
                }
                Transmit::RdmaWrite {
                    payload,
                    len,
                    regions,
                    ..
                } => {
                    let data = match payload {
                        Payload::Buffer(b) => buffers.data(b),
                        Payload::Bytes(v) => {
                            buffers.payload(verbs, v).ok_or(Broken::NoPayloadBuffer)?
                        }
                    };
                    verbs.post_rdma_write(qp, 0, data, 0, len as usize, &regions);
                    machine.recycle(regions);
                }
                Transmit::RdmaRead {
                    tag,
                    transfer,
                    buffer,
                    len,
                    regions,
                } => {
                    self.reads.insert(transfer, Read::DataOut(tag));
                    let data = buffers.data(buffer);
                    verbs.post_rdma_read(qp, transfer, data, 0, len as usize, &regions);
                    machine.recycle(regions);
                }
                Transmit::ReadTable {
                    tag,
                    transfer,
                    table,
                } => {
                    let len = table.len as usize;
                    match buffers.table(verbs, len) {
                        Some(b) => {
                            self.reads.insert(transfer, Read::Table(tag));
                            verbs.post_rdma_read(qp, transfer, b, 0, len, &[table]);
                        }
                        // No room for the table now: the command fails.
                        None => machine.handle_table(now, tag, transfer, None, core),
                    }
                }
            }
        }
        Ok(any)
    }
}
