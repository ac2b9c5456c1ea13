//! An RDMA port on a real device (feature `rdma`): storage-target-rdma's rdma-sys binding as
//! a [`Fabric`], for SRP's ports and iSER's portals alike. The reactor's arena is registered
//! with the device once, when the port starts; message buffers are the binding's pool of
//! slots, registered once too. The reactor watches three
//! descriptors: the listener's rdma_cm channel (connect requests), the device's rdma_cm
//! channel (connections established and lost) and its completion channel.

use std::net::SocketAddr;
use std::task::{Context, Poll};

use std::os::fd::BorrowedFd;

use backend::Readiness as Watch;
use rdma::ibverbs::{ConnectRequest, Listener, QpHandle, QueueDepth, RdmaError, RdmaVerbs, Slot};

use super::{Fabric, FabricBuffer, MESSAGE_LEN};

/// An RDMA port on a device.
pub struct RdmaPort {
    listening: Watch,
    connections: Watch,
    completions: Watch,
    listener: Listener,
    verbs: RdmaVerbs<FabricBuffer<Slot>>,
    addr: SocketAddr,
    depth: QueueDepth,
    ready: Vec<QpHandle>,
}

impl std::fmt::Debug for RdmaPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaPort")
            .field("addr", &self.addr)
            .field("verbs", &self.verbs)
            .finish()
    }
}

impl RdmaPort {
    /// Opens the device that serves `addr` (the first one), registers `arena` with it, and
    /// listens, with `slots` message buffers for all its connections and `depth` for each
    /// queue pair (SRP sizes them by its request limit, iSER by its command window). Call on
    /// the reactor whose arena it is (the watchers are its runtime's).
    pub fn open(
        addr: SocketAddr,
        arena: &backend::Arena,
        slots: u32,
        depth: QueueDepth,
    ) -> Result<RdmaPort, RdmaError> {
        let mut verbs = RdmaVerbs::open(None, slots, MESSAGE_LEN)?;
        verbs.register_arena(arena)?;
        let listener = Listener::bind(addr, 64)?;
        let watch = |fd: BorrowedFd<'_>| {
            Watch::new(fd).map_err(|source| RdmaError::Os {
                call: "epoll (AsyncFd)",
                source,
            })
        };
        Ok(RdmaPort {
            listening: watch(listener.fd())?,
            connections: watch(verbs.connection_fd())?,
            completions: watch(verbs.completion_fd())?,
            listener,
            verbs,
            addr,
            depth,
            ready: Vec::new(),
        })
    }
}

impl Fabric for RdmaPort {
    const RDMA_CM: bool = true;
    type Message = Slot;
    type Verbs = RdmaVerbs<FabricBuffer<Slot>>;
    type Request = ConnectRequest;

    fn verbs(&mut self) -> &mut Self::Verbs {
        &mut self.verbs
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // Each is polled, so that each has the waker.
        let requests = readable(&self.listening, cx);
        let connections = readable(&self.connections, cx);
        let completions = readable(&self.completions, cx);
        if completions {
            // Acknowledged and armed again; the port polls every queue pair anyway.
            self.ready.clear();
            self.verbs.ack_events(&mut self.ready);
        }
        if connections {
            // A lost connection puts its queue pair in the error state, which the port sees.
            while self.verbs.poll_connection().is_some() {}
        }
        if requests || connections || completions {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn next_request(&mut self) -> Option<ConnectRequest> {
        self.listener.accept()
    }

    fn private<'r>(&self, request: &'r ConnectRequest) -> &'r [u8] {
        &request.private
    }

    fn accept(
        &mut self,
        request: ConnectRequest,
        receives: Vec<FabricBuffer<Slot>>,
        private: &[u8],
    ) -> Result<QpHandle, String> {
        self.verbs
            .accept(request, self.depth, receives, private)
            .map_err(|e| e.to_string())
    }

    fn reject(&mut self, request: ConnectRequest, private: &[u8]) {
        request.reject(private);
    }

    fn release(&mut self, qp: QpHandle) {
        self.verbs.destroy(qp);
    }

    fn portal(&self) -> String {
        format!("rdma:{}", self.addr)
    }

    fn address(&self) -> Option<SocketAddr> {
        Some(self.addr)
    }

    fn addresses(&self, request: &ConnectRequest) -> Option<(SocketAddr, SocketAddr)> {
        Some((request.peer?, request.local.unwrap_or(self.addr)))
    }
}

/// Whether `watch` was readable since it last said so; a failing watch is logged and reads as
/// not ready.
fn readable(watch: &Watch, cx: &mut Context<'_>) -> bool {
    watch.poll_readable(cx).unwrap_or_else(|e| {
        tracing::error!("watching an RDMA channel: {e}");
        false
    })
}
