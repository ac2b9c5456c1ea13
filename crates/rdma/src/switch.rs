//! The software [`Fabric`] shared by hosts on different threads: a target in a daemon's
//! reactor and an initiator in a test or a benchmark, each with its own [`Endpoint`].
//!
//! A host's buffers stay on its thread, as they stay in a host's memory on real hardware: an
//! endpoint keeps the buffers of its posted work requests and gives the fabric staging copies
//! of their bytes (the wire), copying a received message or an RDMA READ's data into the real
//! buffer when its completion is polled. So an endpoint's buffers may be anything that derefs
//! to bytes (a reactor's arena slots, which are neither `Send` nor `Sync`), and what the peer
//! reaches, its registered memory, lives in the fabric behind the switch's lock.
//!
//! Connections are set up as rdma_cm sets them up: a target listens on a service name; an
//! initiator connects with private data (an SRP_LOGIN_REQ); the target accepts with private
//! data of its own (an SRP_LOGIN_RSP) once it has posted its receives, or rejects (with an
//! SRP_LOGIN_REJ). Every change an endpoint should look at (a completion, a connect request,
//! a reply, a disconnection) wakes the endpoint's task ([`Endpoint::poll_ready`]).

use std::collections::{HashMap, VecDeque};
use std::ops::DerefMut;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::fabric::{Access, Fabric, MemoryId, MemoryRegion, NodeId, QpId, VerbsError};
use crate::verbs::RemoteRegion;
use crate::verbs::{Completion, MessageBuffers, PeerMemory, Verbs, WorkOp, MESSAGE_BUFFER_LEN};

/// Why a connection could not be asked for or set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SwitchError {
    /// Nobody listens on the service.
    #[error("no target listens on {0:?}")]
    NoListener(String),
    /// Somebody listens on it already.
    #[error("{0:?} has a listener already")]
    InUse(String),
}

/// The target's answer to a connect request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Connected: the initiator's queue pair and the target's private data.
    Accepted {
        /// The initiator's queue pair.
        qp: QpId,
        /// The target's private data (an SRP_LOGIN_RSP).
        private: Vec<u8>,
    },
    /// Refused, with the target's private data (an SRP_LOGIN_REJ).
    Rejected(Vec<u8>),
}

/// A connect request as the listening target sees it: accept it with [`Endpoint::accept`] or
/// refuse it with [`Endpoint::reject`].
#[derive(Debug, PartialEq, Eq)]
pub struct ConnectRequest {
    id: u64,
    from: NodeId,
    /// The initiator's private data (an SRP_LOGIN_REQ).
    pub private: Vec<u8>,
}

#[derive(Debug, Default)]
struct NodeState {
    waker: Option<Waker>,
    /// Something changed since the node last looked.
    changed: bool,
}

#[derive(Debug, Default)]
struct Inner {
    fabric: Fabric,
    nodes: HashMap<NodeId, NodeState>,
    /// Listeners by service: their node and the requests waiting for them.
    services: HashMap<String, (NodeId, VecDeque<ConnectRequest>)>,
    /// Answers not yet taken by their initiators, by request.
    replies: HashMap<u64, Reply>,
    next_request: u64,
}

impl Inner {
    fn wake(&mut self, node: NodeId) {
        let n = self.nodes.entry(node).or_default();
        n.changed = true;
        if let Some(w) = &n.waker {
            w.wake_by_ref();
        }
    }

    /// Wakes the node at the other end of `qp`, if it is still connected.
    fn wake_peer(&mut self, qp: QpId) {
        if let Some(node) = self.fabric.peer_node(qp) {
            self.wake(node);
        }
    }
}

/// A fabric shared between threads, and the connection manager of its hosts.
#[derive(Debug, Default)]
pub struct Switch {
    inner: Mutex<Inner>,
}

impl Switch {
    /// An empty fabric with no costs.
    pub fn new() -> Arc<Switch> {
        Arc::new(Switch {
            inner: Mutex::new(Inner {
                fabric: Fabric::new(),
                ..Inner::default()
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the fabric: its memory, regions, counters and costs.
    pub fn with<R>(&self, f: impl FnOnce(&mut Fabric) -> R) -> R {
        f(&mut self.lock().fabric)
    }

    /// The verbs of `node`, for a host whose buffers are `B`.
    pub fn endpoint<B>(self: &Arc<Self>, node: NodeId) -> Endpoint<B> {
        Endpoint {
            switch: Arc::clone(self),
            node,
            posted: Vec::new(),
            free: Vec::new(),
            staging: Vec::new(),
            receives: 0,
            receives_high: 0,
        }
    }

    /// Asks the target listening on `service` for a connection from `from`, with `private`
    /// (an SRP_LOGIN_REQ): the request's number, whose [`Switch::reply`] comes later.
    pub fn connect(&self, from: NodeId, service: &str, private: &[u8]) -> Result<u64, SwitchError> {
        let mut inner = self.lock();
        inner.next_request += 1;
        let id = inner.next_request;
        let Some((node, requests)) = inner.services.get_mut(service) else {
            return Err(SwitchError::NoListener(service.to_string()));
        };
        requests.push_back(ConnectRequest {
            id,
            from,
            private: private.to_vec(),
        });
        let node = *node;
        inner.wake(node);
        Ok(id)
    }

    /// Node `node` listens for connect requests on `service` (its endpoint takes them with
    /// [`Endpoint::next_request`]).
    pub fn listen(&self, node: NodeId, service: &str) -> Result<(), SwitchError> {
        let mut inner = self.lock();
        if inner.services.contains_key(service) {
            return Err(SwitchError::InUse(service.to_string()));
        }
        inner
            .services
            .insert(service.to_string(), (node, VecDeque::new()));
        Ok(())
    }

    /// The target's answer to request `id`, once it has come.
    pub fn reply(&self, id: u64) -> Option<Reply> {
        self.lock().replies.remove(&id)
    }

    /// Stops listening on `service`; requests still waiting are rejected with no private data.
    pub fn unlisten(&self, service: &str) {
        let mut inner = self.lock();
        if let Some((_, requests)) = inner.services.remove(service) {
            for r in requests {
                inner.replies.insert(r.id, Reply::Rejected(Vec::new()));
                inner.wake(r.from);
            }
        }
    }
}

/// One host's verbs on a [`Switch`]: queue pairs, sends and receives, RDMA, its wake-ups, and
/// (for a target) listening and accepting.
#[derive(Debug)]
pub struct Endpoint<B> {
    switch: Arc<Switch>,
    node: NodeId,
    /// Work requests posted and not completed, by the number the fabric knows them by: the
    /// caller's id and buffer.
    /// Buffers the verbs hold, by the fabric's request id: the caller's id, the buffer, and
    /// where in it a transfer starts.
    posted: Vec<Option<(u64, B, usize)>>,
    free: Vec<usize>,
    /// Staging copies back from the fabric, for reuse: steady state allocates none.
    staging: Vec<Vec<u8>>,
    /// Receives posted and not completed.
    receives: usize,
    /// The most receives ever posted at once: the endpoint has provisioned for that many.
    receives_high: usize,
}

/// Staging copies an endpoint keeps for reuse, at least.
const KEPT_STAGING: usize = 1024;

/// Copies made ahead for each receive beyond the most ever posted: each receive stands for a
/// request, whose answer may take an RDMA transfer (a staging copy), an IU and the send's
/// staging copy while the receive itself is posted again. Made when the receives are posted
/// (at login), so how busy the steady state gets never makes one.
const STAGING_PER_RECEIVE: usize = 3;

/// The staging pool, for buffers of any kind.
impl<B> Endpoint<B> {
    /// Staging copies this endpoint keeps for reuse.
    fn kept(&self) -> usize {
        KEPT_STAGING.max(self.receives_high * (STAGING_PER_RECEIVE + 1))
    }

    /// Keeps `copy` for reuse, if the endpoint keeps that many.
    fn keep(&mut self, copy: Vec<u8>) {
        if self.staging.len() < self.kept() {
            self.staging.push(copy);
        }
    }

    /// One more receive is posted: beyond the most ever posted, the copies its request will
    /// need are made now, and the tables that hold work requests grow for them.
    fn count_receive(&mut self) {
        self.receives += 1;
        if self.receives <= self.receives_high {
            return;
        }
        self.receives_high = self.receives;
        let per = STAGING_PER_RECEIVE + 1;
        self.posted.reserve(per);
        self.free.reserve(per);
        self.staging
            .reserve(self.kept() - self.staging.len().min(self.kept()));
        for _ in 0..STAGING_PER_RECEIVE {
            self.staging.push(Vec::with_capacity(MESSAGE_BUFFER_LEN));
        }
    }
}

impl<B: DerefMut<Target = [u8]>> Endpoint<B> {
    /// The switch.
    pub fn switch(&self) -> &Arc<Switch> {
        &self.switch
    }

    /// The node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Ready when something changed for this node since it last was: a completion, a
    /// connect request or reply, a disconnection. The caller then polls what it has.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut inner = self.switch.lock();
        let n = inner.nodes.entry(self.node).or_default();
        if std::mem::take(&mut n.changed) {
            return Poll::Ready(());
        }
        if !n.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            n.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Listens for connect requests on `service` ([`Switch::listen`]).
    pub fn listen(&self, service: &str) -> Result<(), SwitchError> {
        self.switch.listen(self.node, service)
    }

    /// The next connect request on `service`.
    pub fn next_request(&self, service: &str) -> Option<ConnectRequest> {
        let mut inner = self.switch.lock();
        match inner.services.get_mut(service) {
            Some((node, requests)) if *node == self.node => requests.pop_front(),
            _ => None,
        }
    }

    /// Accepts `request`: connects a queue pair, posts `receives` on it (before the initiator
    /// can send), then answers with `private` (an SRP_LOGIN_RSP).
    pub fn accept(
        &mut self,
        request: ConnectRequest,
        receives: impl IntoIterator<Item = B>,
        private: &[u8],
    ) -> QpId {
        let (qp, theirs) = self.switch.with(|f| f.connect(self.node, request.from));
        for b in receives {
            self.post_recv(qp, 0, b);
        }
        let mut inner = self.switch.lock();
        inner.replies.insert(
            request.id,
            Reply::Accepted {
                qp: theirs,
                private: private.to_vec(),
            },
        );
        inner.wake(request.from);
        qp
    }

    /// Refuses `request` with `private` (an SRP_LOGIN_REJ).
    pub fn reject(&self, request: ConnectRequest, private: &[u8]) {
        let mut inner = self.switch.lock();
        inner
            .replies
            .insert(request.id, Reply::Rejected(private.to_vec()));
        inner.wake(request.from);
    }

    /// Keeps a posted request's id and buffer until its completion; the fabric's number for it.
    fn park(&mut self, wr_id: u64, buffer: B, at: usize) -> u64 {
        let entry = Some((wr_id, buffer, at));
        match self.free.pop() {
            Some(i) => {
                self.posted[i] = entry;
                i as u64
            }
            None => {
                self.posted.push(entry);
                self.posted.len() as u64 - 1
            }
        }
    }

    /// A staging copy of `len` bytes, filled from `from` when given.
    fn stage(&mut self, len: usize, from: Option<&[u8]>) -> Vec<u8> {
        // New copies hold an IU at least, so a copy made for a short send is not grown later.
        let mut s = self
            .staging
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(len.max(MESSAGE_BUFFER_LEN)));
        match from {
            Some(bytes) => {
                s.clear();
                s.extend_from_slice(&bytes[..len.min(bytes.len())]);
            }
            // A copy that receives (a receive, an RDMA READ) is written before it is read, and
            // only the bytes written leave it: what an earlier use left is not zeroed again.
            None if s.len() >= len => s.truncate(len),
            None => s.resize(len, 0),
        }
        s
    }

    /// Posts through the fabric, then wakes both ends: this one polls its completion, the
    /// peer its receive.
    fn post(&mut self, qp: QpId, f: impl FnOnce(&mut Fabric)) {
        let mut inner = self.switch.lock();
        f(&mut inner.fabric);
        let me = self.node;
        inner.wake(me);
        inner.wake_peer(qp);
    }
}

/// IU buffers are vectors, reused from the endpoint's staging copies.
impl<B> MessageBuffers for Endpoint<B> {
    type Message = Vec<u8>;

    fn message_buffer(&mut self) -> Option<Vec<u8>> {
        Some(self.staging.pop().map_or_else(
            || vec![0; MESSAGE_BUFFER_LEN],
            |mut v| {
                // The IU is encoded over what an earlier use of this host's copy left.
                v.resize(MESSAGE_BUFFER_LEN, 0);
                v
            },
        ))
    }

    fn recycle_message(&mut self, iu: Vec<u8>) {
        self.keep(iu);
    }
}

/// Memory the peer reaches lives in the fabric, behind the switch's lock: an initiator on
/// one thread exposes it, a target on another reads and writes it by RDMA.
impl<B> PeerMemory for Endpoint<B> {
    type Memory = MemoryId;

    fn alloc(&mut self, len: usize) -> Result<MemoryId, VerbsError> {
        let node = self.node;
        self.switch.with(|f| f.port(node).alloc(len))
    }

    fn read(&self, m: &MemoryId, offset: usize, out: &mut [u8]) {
        let node = self.node;
        self.switch.with(|f| f.port(node).read(m, offset, out));
    }

    fn write(&mut self, m: &MemoryId, offset: usize, data: &[u8]) {
        let node = self.node;
        self.switch.with(|f| f.port(node).write(m, offset, data));
    }

    fn register(
        &mut self,
        m: &MemoryId,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        let node = self.node;
        self.switch
            .with(|f| f.port(node).register(m, offset, len, access))
    }

    fn deregister(&mut self, region: MemoryRegion) {
        let node = self.node;
        self.switch.with(|f| f.port(node).deregister(region));
    }
}

impl<B: DerefMut<Target = [u8]>> Verbs for Endpoint<B> {
    type Qp = QpId;
    type Buffer = B;

    fn post_recv(&mut self, qp: QpId, wr_id: u64, buffer: B) {
        self.count_receive();
        let stage = self.stage(buffer.len(), None);
        let id = self.park(wr_id, buffer, 0);
        self.post(qp, |f| f.post_recv(qp, id, stage));
    }

    fn post_send(&mut self, qp: QpId, wr_id: u64, buffer: B, len: usize) {
        let stage = self.stage(len, Some(&buffer));
        let id = self.park(wr_id, buffer, 0);
        self.post(qp, |f| f.post_send(qp, id, stage, len));
    }

    fn post_rdma_write(
        &mut self,
        qp: QpId,
        wr_id: u64,
        buffer: B,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        let stage = self.stage(len, buffer.get(at..));
        let id = self.park(wr_id, buffer, at);
        self.post(qp, |f| f.post_rdma_write(qp, id, stage, 0, len, remote));
    }

    fn post_rdma_read(
        &mut self,
        qp: QpId,
        wr_id: u64,
        buffer: B,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        let stage = self.stage(len.min(buffer.len().saturating_sub(at)), None);
        let id = self.park(wr_id, buffer, at);
        self.post(qp, |f| f.post_rdma_read(qp, id, stage, 0, len, remote));
    }

    fn poll(&mut self, qp: QpId) -> Option<Completion<B>> {
        let c = self.switch.lock().fabric.poll(qp)?;
        let i = c.wr_id as usize;
        let (wr_id, mut buffer, at) = self.posted.get_mut(i)?.take()?;
        self.free.push(i);
        if c.op == WorkOp::Recv {
            self.receives = self.receives.saturating_sub(1);
        }
        let inbound = matches!(c.op, WorkOp::Recv | WorkOp::RdmaRead);
        if inbound && c.result.is_ok() {
            let place = &mut buffer[at.min(c.buffer.len().max(at))..];
            let n = c.len.min(place.len()).min(c.buffer.len());
            place[..n].copy_from_slice(&c.buffer[..n]);
        }
        self.keep(c.buffer);
        Some(Completion {
            wr_id,
            op: c.op,
            buffer,
            len: c.len,
            result: c.result,
        })
    }

    fn is_error(&self, qp: QpId) -> bool {
        self.switch.lock().fabric.is_error(qp)
    }

    fn disconnect(&mut self, qp: QpId) {
        let mut inner = self.switch.lock();
        let peer = inner.fabric.peer_node(qp);
        inner.fabric.disconnect(qp);
        let me = self.node;
        inner.wake(me);
        if let Some(p) = peer {
            inner.wake(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    const T: NodeId = NodeId(0);
    const I: NodeId = NodeId(1);

    /// A buffer that cannot leave its thread, as an arena slot cannot.
    struct Local(Vec<u8>, #[allow(dead_code)] Rc<()>);

    impl std::ops::Deref for Local {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            &self.0
        }
    }

    impl std::ops::DerefMut for Local {
        fn deref_mut(&mut self) -> &mut [u8] {
            &mut self.0
        }
    }

    fn local(bytes: &[u8]) -> Local {
        Local(bytes.to_vec(), Rc::new(()))
    }

    #[test]
    fn a_login_a_send_and_rdma_between_threads() {
        let switch = Switch::new();
        let mut target: Endpoint<Local> = switch.endpoint(T);
        target.listen("srp").expect("free");
        assert_eq!(target.listen("srp"), Err(SwitchError::InUse("srp".into())));
        assert!(matches!(
            switch.connect(I, "other", b"x"),
            Err(SwitchError::NoListener(_))
        ));
        let memory = switch.with(|f| {
            let m = f.alloc(I, 64);
            f.memory_mut(m)[..5].copy_from_slice(b"hello");
            (m, f.register(m, 0, 64, Access::REMOTE))
        });
        let initiator = {
            let switch = Arc::clone(&switch);
            std::thread::spawn(move || {
                let mut me: Endpoint<Vec<u8>> = switch.endpoint(I);
                let id = switch.connect(I, "srp", b"login").expect("listened");
                let qp = loop {
                    match switch.reply(id) {
                        Some(Reply::Accepted { qp, private }) => {
                            assert_eq!(private, b"welcome");
                            break qp;
                        }
                        Some(Reply::Rejected(_)) => panic!("rejected"),
                        None => std::thread::yield_now(),
                    }
                };
                me.post_recv(qp, 9, vec![0; 16]);
                me.post_send(qp, 1, b"command".to_vec(), 7);
                let mut got = Vec::new();
                while got.len() < 2 {
                    match me.poll(qp) {
                        Some(c) => got.push((c.wr_id, c.op, c.len, c.buffer)),
                        None => std::thread::yield_now(),
                    }
                }
                got
            })
        };
        let request = loop {
            if let Some(r) = target.next_request("srp") {
                break r;
            }
            std::thread::yield_now();
        };
        assert_eq!(request.private, b"login");
        let qp = target.accept(request, [local(&[0; 32])], b"welcome");
        let received = loop {
            if let Some(c) = target.poll(qp) {
                break c;
            }
            std::thread::yield_now();
        };
        assert_eq!((received.op, received.len), (WorkOp::Recv, 7));
        assert_eq!(&received.buffer[..7], b"command");
        // RDMA READ from the initiator's memory lands in the target's own buffer.
        target.post_rdma_read(qp, 3, local(&[0; 5]), 0, 5, &[memory.1.remote(0, 5)]);
        let read = target.poll(qp).expect("completes at once");
        assert_eq!(
            (read.wr_id, read.op, &read.buffer[..]),
            (3, WorkOp::RdmaRead, &b"hello"[..])
        );
        target.post_rdma_write(qp, 4, local(b"HELLO"), 0, 5, &[memory.1.remote(8, 5)]);
        assert_eq!(target.poll(qp).map(|c| c.result), Some(Ok(())));
        assert_eq!(
            switch.with(|f| f.memory(memory.0)[8..13].to_vec()),
            b"HELLO"
        );
        // At an offset into the buffer, both ways: the rest of it is left alone.
        target.post_rdma_read(qp, 6, local(&[9; 12]), 4, 5, &[memory.1.remote(0, 5)]);
        let read = target.poll(qp).expect("completes at once");
        assert_eq!(
            (read.len, &read.buffer[..]),
            (5, &b"\x09\x09\x09\x09hello\x09\x09\x09"[..])
        );
        target.post_rdma_write(qp, 7, local(b"..WORLD.."), 2, 5, &[memory.1.remote(16, 5)]);
        assert_eq!(target.poll(qp).map(|c| c.result), Some(Ok(())));
        assert_eq!(
            switch.with(|f| f.memory(memory.0)[16..21].to_vec()),
            b"WORLD"
        );
        target.post_send(qp, 5, local(b"response"), 8);
        let got = initiator.join().expect("the initiator's thread");
        assert!(got.contains(&(1, WorkOp::Send, 7, b"command".to_vec())));
        assert!(got
            .iter()
            .any(|(id, op, len, b)| (*id, *op, *len) == (9, WorkOp::Recv, 8)
                && &b[..8] == b"response"));
    }

    #[test]
    fn rejections_and_disconnections_reach_the_other_side() {
        let switch = Switch::new();
        let mut target: Endpoint<Local> = switch.endpoint(T);
        target.listen("srp").expect("free");
        let id = switch.connect(I, "srp", b"bad").expect("listened");
        let r = target.next_request("srp").expect("queued");
        target.reject(r, b"no");
        assert_eq!(switch.reply(id), Some(Reply::Rejected(b"no".to_vec())));
        let id = switch.connect(I, "srp", b"good").expect("listened");
        let r = target.next_request("srp").expect("queued");
        let qp = target.accept(r, [local(&[0; 8])], b"ok");
        let Some(Reply::Accepted { qp: theirs, .. }) = switch.reply(id) else {
            panic!("accepted");
        };
        let mut initiator: Endpoint<Vec<u8>> = switch.endpoint(I);
        initiator.disconnect(theirs);
        assert!(target.is_error(qp));
        let flushed = target.poll(qp).expect("the receive comes back");
        assert_eq!(flushed.result, Err(VerbsError::Flushed));
        // A waiting request is rejected when the listener goes.
        let id = switch.connect(I, "srp", b"late").expect("listened");
        switch.unlisten("srp");
        assert_eq!(switch.reply(id), Some(Reply::Rejected(Vec::new())));
    }
}
