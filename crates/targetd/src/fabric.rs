//! What the RDMA ports run on, whatever their protocol: a [`Fabric`] is queue-pair verbs
//! (storage-target-rdma's) with connection management in rdma_cm's shape. Two of them: the
//! software switch in the process ([`FabricPort`]: embedding and tests) and, with the feature
//! `rdma`, a real device through rdma_cm (`device::RdmaPort`). SRP's ports (`crate::srp`) and
//! iSER's portals (`crate::iser`) both run on any fabric; each reads its own private data.

use std::net::SocketAddr;
use std::ops::DerefMut;
use std::sync::Arc;
use std::task::{Context, Poll};

use backend::{Buffer, Share};
use rdma::fabric::NodeId;
use rdma::switch::{ConnectRequest, Endpoint, Switch, SwitchError};
use rdma::verbs::{MessageBuffers, PortBuffer, Verbs};

#[cfg(feature = "rdma")]
pub mod device;

/// A queue pair of a fabric.
pub type Qp<F> = <<F as Fabric>::Verbs as Verbs>::Qp;

/// A buffer a port gives its verbs: one of the fabric's message buffers, or a task's data in
/// a slot run of the reactor's arena.
pub type FabricBuffer<I> = PortBuffer<I, Buffer>;

/// What an RDMA port runs on, whatever its protocol (SRP, iSER): queue-pair verbs over
/// [`FabricBuffer`]s, and connection management as rdma_cm does it (connect requests carrying
/// the protocol's private data, answered with private data of its own).
pub trait Fabric {
    /// Whether a connect request's private data is in rdma_cm's form (a device's rdma_cm,
    /// which Linux's initiators lay out as their own structures) rather than whole protocol
    /// messages (the software switch).
    const RDMA_CM: bool;
    /// A message buffer: registered memory of the fabric's own, [`MESSAGE_LEN`] bytes.
    type Message: DerefMut<Target = [u8]>;
    /// Its queue-pair verbs, which hand out its message buffers.
    type Verbs: Verbs<Buffer = FabricBuffer<Self::Message>>
        + MessageBuffers<Message = Self::Message>;
    /// A connect request.
    type Request;
    /// The verbs.
    fn verbs(&mut self) -> &mut Self::Verbs;
    /// Ready when something may have changed: a completion, a connect request, a
    /// disconnection.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()>;
    /// The next connect request.
    fn next_request(&mut self) -> Option<Self::Request>;
    /// The private data it carries (SRP's login request, iSER's connection parameters).
    fn private<'r>(&self, request: &'r Self::Request) -> &'r [u8];
    /// Accepts it: a queue pair with `receives` posted, answered with `private`.
    fn accept(
        &mut self,
        request: Self::Request,
        receives: Vec<FabricBuffer<Self::Message>>,
        private: &[u8],
    ) -> Result<Qp<Self>, String>;
    /// Refuses it with `private`.
    fn reject(&mut self, request: Self::Request, private: &[u8]);
    /// A channel's queue pair is done with (disconnected, its completions taken): its
    /// resources go.
    fn release(&mut self, qp: Qp<Self>) {
        let _ = qp;
    }
    /// The portal, as the admin interface names it.
    fn portal(&self) -> String;
    /// The IP address and port it listens on, when the fabric has IP addressing (rdma_cm):
    /// what names its own terms in the config (`server.srp_ports`).
    fn address(&self) -> Option<SocketAddr> {
        None
    }
    /// The initiator's address and the one it reached, when the fabric has IP addressing
    /// (rdma_cm does; the software fabric does not): what network ACLs and the session list
    /// see.
    fn addresses(&self, request: &Self::Request) -> Option<(SocketAddr, SocketAddr)> {
        let _ = request;
        None
    }

    /// The portal as a protocol's port names it in logs and lists (`iser`: "iser:ADDR" on a
    /// device, "iser-fabric:SERVICE" on the software fabric).
    fn portal_of(&self, protocol: &str) -> String {
        self.portal()
            .replacen("fabric:", &format!("{protocol}-fabric:"), 1)
            .replacen("rdma:", &format!("{protocol}:"), 1)
    }
}

/// The length of every message buffer: the largest SRP IU an initiator may send (srp's
/// `PortSettings` default), every iSER message within 8 KiB of immediate data, and more than
/// any message a target sends.
pub const MESSAGE_LEN: usize = rdma::verbs::MESSAGE_BUFFER_LEN;

/// The most in-capsule data an NVMe/RDMA command capsule may carry: what a message buffer
/// holds behind the SQE, in the 16-byte units IOCCSZ counts.
pub const NVME_MAX_IN_CAPSULE_DATA: u32 = ((MESSAGE_LEN - nvme::Sqe::LEN) as u32) & !15;

/// `bytes` (parameter data: an Identify, a log page, an INQUIRY) in registered memory for an
/// RDMA WRITE: one of the verbs' message buffers when they fit, else slots of the port's share
/// of the arena; `None` while neither has room (the work waits for the next turn).
pub fn registered<F: Fabric>(
    verbs: &mut F::Verbs,
    share: &Share,
    bytes: &[u8],
) -> Option<FabricBuffer<F::Message>> {
    let n = bytes.len();
    if n <= MESSAGE_LEN {
        return verbs.message_buffer().map(|mut b| {
            b[..n].copy_from_slice(bytes);
            PortBuffer::Message(b)
        });
    }
    share.try_alloc(n).ok().flatten().map(|mut b| {
        b[..n].copy_from_slice(bytes);
        PortBuffer::Data(b)
    })
}

/// The address a connection on a fabric without IP addressing is known by: a network ACL
/// admits none such.
pub const NO_ADDRESS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// A port on the software fabric: a [`Switch`] endpoint listening on a service name.
#[derive(Debug)]
pub struct FabricPort {
    endpoint: Endpoint<FabricBuffer<Vec<u8>>>,
    service: String,
}

impl FabricPort {
    /// The port of node `node` of `switch`, listening on `service`.
    pub fn listen(
        switch: &Arc<Switch>,
        node: NodeId,
        service: &str,
    ) -> Result<FabricPort, SwitchError> {
        switch.listen(node, service)?;
        Ok(FabricPort {
            endpoint: switch.endpoint(node),
            service: service.to_string(),
        })
    }
}

impl Drop for FabricPort {
    fn drop(&mut self) {
        self.endpoint.switch().unlisten(&self.service);
    }
}

impl Fabric for FabricPort {
    const RDMA_CM: bool = false;
    type Message = Vec<u8>;
    type Verbs = Endpoint<FabricBuffer<Vec<u8>>>;
    type Request = ConnectRequest;

    fn verbs(&mut self) -> &mut Self::Verbs {
        &mut self.endpoint
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.endpoint.poll_ready(cx)
    }

    fn next_request(&mut self) -> Option<ConnectRequest> {
        self.endpoint.next_request(&self.service)
    }

    fn private<'r>(&self, request: &'r ConnectRequest) -> &'r [u8] {
        &request.private
    }

    fn accept(
        &mut self,
        request: ConnectRequest,
        receives: Vec<FabricBuffer<Vec<u8>>>,
        private: &[u8],
    ) -> Result<Qp<Self>, String> {
        Ok(self.endpoint.accept(request, receives, private))
    }

    fn reject(&mut self, request: ConnectRequest, private: &[u8]) {
        self.endpoint.reject(request, private);
    }

    fn portal(&self) -> String {
        format!("fabric:{}", self.service)
    }
}
