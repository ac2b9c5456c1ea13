//! The controller's end of an NVMe/TCP connection with its commands carried out: the
//! connection every transport shares ([`crate::connection::ControllerConnection`]) over the
//! NVMe/TCP queue machine ([`ControllerQueue`]), with what only a byte stream has: bytes in,
//! PDUs out.

use std::ops::DerefMut;

use bytes::BytesMut;

use super::queue::{ControllerQueue, QueueSettings, Transmit};

/// The controller's end of one NVMe/TCP connection, with its commands carried out; `B` the
/// shell's buffers (the reactor's arena).
pub type ControllerConnection<B> = crate::connection::ControllerConnection<B, ControllerQueue<B>>;

impl<B: DerefMut<Target = [u8]>> ControllerConnection<B> {
    /// An NVMe/TCP connection just accepted, waiting for ICReq.
    pub fn new(settings: QueueSettings) -> ControllerConnection<B> {
        ControllerConnection::on(ControllerQueue::new(settings))
    }

    /// Its part of a handover ([`crate::handover::QueueState`]) once quiescent: its binding
    /// and SQ head, what ICReq settled and the bytes read ahead.
    pub fn handover(&self) -> Result<crate::handover::QueueState, crate::handover::Busy> {
        let (bound, sqhd) = self.quiescent()?;
        let mut state = self.transport().handover()?;
        state.qid = bound.qid;
        state.size = bound.size;
        state.sq_flow_control_disabled = bound.sq_flow_control_disabled;
        state.sqhd = sqhd;
        Ok(state)
    }

    /// The connection a handover describes, bound to `bound` (what
    /// [`crate::controller::Subsystem::adopt_controller`] gave for it), taking commands where
    /// the old process stopped; `digests` what this controller grants when asked.
    pub fn resume(
        state: &crate::handover::QueueState,
        bound: crate::controller::Queue,
        digests: super::pdu::Digests,
    ) -> ControllerConnection<B> {
        ControllerConnection::bound_on(ControllerQueue::resume(state, digests), bound, state.sqhd)
    }

    /// The connection machine (what ICReq settled).
    pub fn queue(&self) -> &ControllerQueue<B> {
        self.transport()
    }

    /// How many more bytes the next PDU needs: what to read next.
    pub fn needed(&self) -> usize {
        self.transport().needed()
    }

    /// Bytes from the host; [`ControllerConnection::handle`] takes what they carry.
    pub fn receive(&mut self, bytes: &[u8]) {
        self.transport_mut().receive(bytes);
    }

    /// The buffer received bytes go in, for a shell that reads straight into it (one copy
    /// fewer than [`Self::receive`]); reserve [`Self::needed`] first and call
    /// [`Self::received`] after.
    pub fn receive_buffer(&mut self) -> &mut BytesMut {
        self.transport_mut().receive_buffer()
    }

    /// Makes room in [`Self::receive_buffer`] for a read of at least `read` bytes, the
    /// buffer sized once for every later read so that steady state allocates nothing
    /// ([`super::Deframer::reserve_for_read`]).
    pub fn reserve_for_read(&mut self, read: usize) {
        self.transport_mut().reserve_for_read(read);
    }

    /// Takes the PDUs the bytes read into [`Self::receive_buffer`] complete.
    pub fn received(&mut self) {
        self.transport_mut().received();
    }

    /// The next bytes to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit<B>> {
        self.transport_mut().poll_transmit()
    }
}
