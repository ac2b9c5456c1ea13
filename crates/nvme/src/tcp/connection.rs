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
