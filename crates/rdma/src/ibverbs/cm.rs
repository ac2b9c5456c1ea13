//! Connections through rdma_cm: an initiator's connect, a target's listener, its connect
//! requests accepted or rejected with private data, and the descriptors a reactor watches.

use super::*;

impl<B: Registered> RdmaVerbs<B> {
    /// Moves connection id `id` onto this device's rdma_cm channel, so that its events come
    /// to [`RdmaVerbs::poll_connection`].
    fn adopt(&self, id: *mut rdma_cm_id) -> Result<(), RdmaError> {
        // Safety: `id` and the channel are valid; the id's old channel sees no more events
        // of it.
        if unsafe { rdma_migrate_id(id, self.cm) } != 0 {
            return Err(os("rdma_migrate_id"));
        }
        Ok(())
    }

    fn conn_param(&self, private: &[u8]) -> rdma_conn_param {
        rdma_conn_param {
            private_data: private.as_ptr().cast(),
            private_data_len: private.len().min(255) as u8,
            responder_resources: self.max_rd_atom,
            initiator_depth: self.max_rd_atom,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: 0,
            qp_num: 0,
        }
    }

    /// Accepts a connect request with `private` as the reply's private data (an
    /// SRP_LOGIN_RSP): the new queue pair, with `receives` posted on it before the initiator
    /// hears it may send (work request id 0).
    pub fn accept(
        &mut self,
        request: ConnectRequest,
        depth: QueueDepth,
        receives: impl IntoIterator<Item = B>,
        private: &[u8],
    ) -> Result<QpHandle, RdmaError> {
        // Safety: the request's id is valid until it is destroyed (by `request`'s drop, or
        // by ours once the queue pair is made).
        if unsafe { (*request.id).verbs } != self.context {
            return Err(RdmaError::OtherDevice);
        }
        let (request_responder, request_depth) =
            (request.responder_resources, request.initiator_depth);
        let id = request.take();
        let qp = match self.adopt(id).and_then(|()| self.create_qp(id, depth)) {
            Ok(qp) => qp,
            Err(e) => {
                // Safety: the id is ours, rejected and destroyed once.
                unsafe {
                    rdma_reject(id, ptr::null(), 0);
                    rdma_destroy_id(id);
                }
                return Err(e);
            }
        };
        for b in receives {
            self.post_recv(qp, 0, b);
        }
        let mut param = self.conn_param(private);
        // No more than the request offered, nor than the device can (conn_param's): Linux's
        // ib_srp offers 4 responder resources and an initiator depth of 0, which the event
        // gives as this side's initiator depth 4 and responder resources 0; a real HCA may
        // refuse an accept beyond what was offered. (Read the other way round, the target's
        // initiator depth was 0 and its RDMA READs of data-out never went out: seen with
        // ib_srp in the soft-RoCE guest.)
        param.initiator_depth = param.initiator_depth.min(request_depth);
        param.responder_resources = param.responder_resources.min(request_responder);
        // Safety: the id has its queue pair; `param` points at `private`, alive for the call.
        if unsafe { rdma_accept(id, &mut param) } != 0 {
            let e = os("rdma_accept");
            self.destroy(qp);
            return Err(e);
        }
        Ok(qp)
    }

    /// Connects to an SRP target at `addr` with `private` (an SRP_LOGIN_REQ in rdma_cm's
    /// layout) and waits until it is set up: the queue pair and the target's private data
    /// (its SRP_LOGIN_RSP).
    pub fn connect(
        &mut self,
        addr: SocketAddr,
        depth: QueueDepth,
        private: &[u8],
    ) -> Result<(QpHandle, Vec<u8>), RdmaError> {
        // Safety: creates an event channel, destroyed with the queue pair or below.
        let channel = unsafe { rdma_create_event_channel() };
        if channel.is_null() {
            return Err(os("rdma_create_event_channel"));
        }
        let mut id = ptr::null_mut();
        // Safety: `channel` is valid; the id is destroyed with the queue pair or below.
        if unsafe {
            rdma_create_id(
                channel,
                &mut id,
                ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            let e = os("rdma_create_id");
            // Safety: unused, destroyed once.
            unsafe { rdma_destroy_event_channel(channel) };
            return Err(e);
        }
        let cleanup = |e: RdmaError| {
            // Safety: the id and channel are ours, destroyed once, in order.
            unsafe {
                rdma_destroy_id(id);
                rdma_destroy_event_channel(channel);
            }
            e
        };
        let mut sa = SockAddr::from(addr);
        // Safety: `sa` is a valid socket address of its family for the call.
        if unsafe { rdma_resolve_addr(id, ptr::null_mut(), sa.as_mut_ptr(), 2000) } != 0 {
            return Err(cleanup(os("rdma_resolve_addr")));
        }
        if let Err(e) = wait_event(channel, rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED) {
            return Err(cleanup(e));
        }
        // Safety: the id's address is resolved.
        if unsafe { rdma_resolve_route(id, 2000) } != 0 {
            return Err(cleanup(os("rdma_resolve_route")));
        }
        if let Err(e) = wait_event(channel, rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED) {
            return Err(cleanup(e));
        }
        // Safety: a resolved id names its device.
        if unsafe { (*id).verbs } != self.context {
            return Err(cleanup(RdmaError::OtherDevice));
        }
        let qp = match self.create_qp(id, depth) {
            Ok(qp) => qp,
            Err(e) => return Err(cleanup(e)),
        };
        let mut param = self.conn_param(private);
        // Safety: the id has a route and its queue pair; `param` points at `private` for the
        // call.
        if unsafe { rdma_connect(id, &mut param) } != 0 {
            let e = os("rdma_connect");
            self.destroy(qp);
            // Safety: no id is on the channel any more.
            unsafe { rdma_destroy_event_channel(channel) };
            return Err(e);
        }
        let reply = wait_event(channel, rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED);
        // The id moves to this device's channel; the connect channel is then empty.
        let moved = self.adopt(id).is_ok();
        // Safety: no id is on the channel any more; destroyed once.
        unsafe { rdma_destroy_event_channel(channel) };
        match reply {
            Ok(reply) if moved => Ok((qp, reply)),
            Ok(_) => {
                self.destroy(qp);
                Err(os("rdma_migrate_id"))
            }
            Err(e) => {
                self.destroy(qp);
                Err(e)
            }
        }
    }
}

/// A connection's change of state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// Set up: the peer may send.
    Established,
    /// The peer (or the fabric) ended it.
    Disconnected,
}

/// A socket address as the C calls take it.
struct SockAddr(libc::sockaddr_storage);

impl From<SocketAddr> for SockAddr {
    fn from(addr: SocketAddr) -> SockAddr {
        // Safety: an all-zero sockaddr_storage is valid; the family's struct is written into
        // its start, which is large and aligned enough for either.
        let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // Safety: see above.
                unsafe { ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin) };
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // Safety: see above.
                unsafe { ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin6) };
            }
        }
        SockAddr(st)
    }
}

impl SockAddr {
    fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        (&mut self.0 as *mut libc::sockaddr_storage).cast()
    }

    /// The address a C sockaddr names, if it is IPv4 or IPv6.
    fn read(sa: &libc::sockaddr_storage) -> Option<SocketAddr> {
        let p = (sa as *const libc::sockaddr_storage).cast::<u8>();
        match i32::from(sa.ss_family) {
            libc::AF_INET => {
                // Safety: the family says a sockaddr_in starts the storage, which is large and
                // aligned enough for it.
                let sin = unsafe { ptr::read(p.cast::<libc::sockaddr_in>()) };
                let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                // Safety: as above, a sockaddr_in6.
                let sin6 = unsafe { ptr::read(p.cast::<libc::sockaddr_in6>()) };
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                    ip,
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// The peer's and this side's addresses of a connection id (its route's destination and
/// source), as rdma_cm resolved them.
fn route_addresses(id: *mut rdma_cm_id) -> (Option<SocketAddr>, Option<SocketAddr>) {
    if id.is_null() {
        return (None, None);
    }
    // Safety: a live id from an event; its route's addresses are plain sockaddr storage that
    // rdma_cm filled in for a connect request (an all-zero one has no family: `None`).
    unsafe {
        let addr = &(*id).route.addr;
        (
            SockAddr::read(&addr.dst_addr_union.dst_storage),
            SockAddr::read(&addr.src_addr_union.src_storage),
        )
    }
}

/// The next event of `channel` (`None`: none yet on a non-blocking channel, or it failed).
pub(super) fn next_event(channel: *mut rdma_event_channel) -> Option<CmEvent> {
    let mut event = ptr::null_mut();
    // Safety: the channel is valid.
    if unsafe { rdma_get_cm_event(channel, &mut event) } != 0 {
        return None;
    }
    // Safety: the event is valid until acknowledged, after its kind, id and private data are
    // copied out.
    unsafe {
        let conn = &(*event).param.conn;
        let private = if conn.private_data.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                conn.private_data_len as usize,
            )
            .to_vec()
        };
        let copied = CmEvent {
            kind: (*event).event,
            id: (*event).id,
            private,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
        };
        rdma_ack_cm_event(event);
        Some(copied)
    }
}

/// Waits on a blocking rdma_cm channel for `expected`: the event's private data.
fn wait_event(
    channel: *mut rdma_event_channel,
    expected: rdma_cm_event_type::Type,
) -> Result<Vec<u8>, RdmaError> {
    let event = next_event(channel).ok_or_else(|| os("rdma_get_cm_event"))?;
    let (kind, private) = (event.kind, event.private);
    match kind {
        k if k == expected => Ok(private),
        rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => Err(RdmaError::Rejected(private)),
        k => Err(RdmaError::Unexpected(k)),
    }
}

/// An SRP target's rdma_cm listener.
#[derive(Debug)]
pub struct Listener {
    channel: *mut rdma_event_channel,
    id: *mut rdma_cm_id,
}

impl Listener {
    /// Listens on `addr` (an address of an RDMA device, or the wildcard).
    pub fn bind(addr: SocketAddr, backlog: i32) -> Result<Listener, RdmaError> {
        // Safety: creates a channel, destroyed in `drop` (or below).
        let channel = unsafe { rdma_create_event_channel() };
        if channel.is_null() {
            return Err(os("rdma_create_event_channel"));
        }
        let mut listener = Listener {
            channel,
            id: ptr::null_mut(),
        };
        // Safety: the channel is valid; the id is destroyed in `drop`.
        if unsafe {
            rdma_create_id(
                channel,
                &mut listener.id,
                ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            return Err(os("rdma_create_id"));
        }
        let mut sa = SockAddr::from(addr);
        // Safety: the id is valid and `sa` a socket address of its family.
        if unsafe { rdma_bind_addr(listener.id, sa.as_mut_ptr()) } != 0 {
            return Err(os("rdma_bind_addr"));
        }
        // Safety: the id is bound.
        if unsafe { rdma_listen(listener.id, backlog) } != 0 {
            return Err(os("rdma_listen"));
        }
        // Safety: the channel is valid.
        set_nonblocking(unsafe { (*channel).fd })?;
        Ok(listener)
    }

    /// The descriptor to watch: readable when [`Listener::accept`] may have a request. A
    /// shell watches it in its own event loop (targetd: tokio's `AsyncFd` over a duplicate).
    pub fn fd(&self) -> BorrowedFd<'_> {
        // Safety: the channel is valid, and its descriptor open, while `self` is, which the
        // borrow does not outlive.
        unsafe { BorrowedFd::borrow_raw((*self.channel).fd) }
    }

    /// The next connect request, if one has come (its private data is an SRP_LOGIN_REQ).
    pub fn accept(&mut self) -> Option<ConnectRequest> {
        loop {
            let e = next_event(self.channel)?;
            if e.kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                let (peer, local) = route_addresses(e.id);
                return Some(ConnectRequest {
                    id: e.id,
                    private: e.private,
                    responder_resources: e.responder_resources,
                    initiator_depth: e.initiator_depth,
                    peer,
                    local,
                });
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Safety: the listening id (requests taken from it are ids of their own, moved to
        // a device's channel when accepted, destroyed when rejected) and then its channel,
        // each once.
        unsafe {
            if !self.id.is_null() {
                rdma_destroy_id(self.id);
            }
            rdma_destroy_event_channel(self.channel);
        }
    }
}

/// A connect request: accept it with [`RdmaVerbs::accept`], or reject it; dropped, it is
/// rejected with no private data.
#[derive(Debug)]
pub struct ConnectRequest {
    id: *mut rdma_cm_id,
    /// The initiator's private data: its SRP_LOGIN_REQ.
    pub private: Vec<u8>,
    /// RDMA READs this side may have to answer at once: the initiator's initiator depth (the
    /// connection manager gives the request's values from the accepting side's view).
    pub responder_resources: u8,
    /// RDMA READs this side may have outstanding toward the initiator: its responder
    /// resources.
    pub initiator_depth: u8,
    /// The initiator's address (the IP address of its RDMA device's interface), when rdma_cm
    /// knows it.
    pub peer: Option<SocketAddr>,
    /// The address the request came to.
    pub local: Option<SocketAddr>,
}

impl ConnectRequest {
    fn take(mut self) -> *mut rdma_cm_id {
        std::mem::replace(&mut self.id, ptr::null_mut())
    }

    /// Refuses the connection with `private` (an SRP_LOGIN_REJ) as the reply.
    pub fn reject(mut self, private: &[u8]) {
        let id = std::mem::replace(&mut self.id, ptr::null_mut());
        // Safety: the id is the request's, rejected and destroyed once; `private` is alive
        // for the call.
        unsafe {
            rdma_reject(id, private.as_ptr().cast(), private.len().min(255) as u8);
            rdma_destroy_id(id);
        }
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        if !self.id.is_null() {
            // Safety: as in `reject`.
            unsafe {
                rdma_reject(self.id, ptr::null(), 0);
                rdma_destroy_id(self.id);
            }
        }
    }
}
