//! Queue pairs: creation with their completion queues, posting work requests (chains only
//! when the send queue has room for all of them), completions, and destruction.

use super::*;

impl<B: Registered> RdmaVerbs<B> {
    /// Makes the queue pair of connection id `id`.
    pub(super) fn create_qp(
        &mut self,
        id: *mut rdma_cm_id,
        depth: QueueDepth,
    ) -> Result<QpHandle, RdmaError> {
        let depth = QueueDepth {
            send: depth.send.clamp(1, self.max_qp_wr),
            recv: depth.recv.clamp(1, self.max_qp_wr),
        };
        let handle = QpHandle(self.qps.len());
        // Safety: the context and completion channel are valid; the queue is destroyed in
        // `drop` (or below on failure), after its queue pair. Its context is a number, never
        // dereferenced.
        let cq = unsafe {
            ibv_create_cq(
                self.context,
                (depth.send + depth.recv) as i32,
                (handle.0 + 1) as *mut libc::c_void,
                self.comp,
                0,
            )
        };
        if cq.is_null() {
            return Err(os("ibv_create_cq"));
        }
        // Safety: a zeroed init attribute, filled in below.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.cap = ibv_qp_cap {
            max_send_wr: depth.send,
            max_recv_wr: depth.recv,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // Safety: `id` is a connection id of this device (checked by the callers), the domain
        // and queue are valid; the queue pair is destroyed in `drop` before the queue.
        let r = unsafe {
            ibv_req_notify_cq(cq, 0);
            rdma_create_qp(id, self.pd, &mut init)
        };
        if r != 0 {
            let e = os("rdma_create_qp");
            // Safety: the queue is unused and destroyed once.
            unsafe { ibv_destroy_cq(cq) };
            return Err(e);
        }
        // Safety: the id is valid; its context names the queue pair for the event loop.
        unsafe { (*id).context = (handle.0 + 1) as *mut libc::c_void };
        self.qps.push(Some(Qp {
            id,
            cq,
            depth,
            send_used: 0,
            recv_used: 0,
            in_flight: Vec::new(),
            free_ids: Vec::new(),
            immediate: VecDeque::new(),
            error: false,
        }));
        Ok(handle)
    }

    /// Tears a queue pair down (its in-flight buffers come back to the pool).
    pub fn destroy(&mut self, qp: QpHandle) {
        if let Some(q) = self.qps.get_mut(qp.0).and_then(Option::take) {
            destroy_qp(q);
        }
    }

    pub(super) fn qp(&mut self, qp: QpHandle) -> Option<&mut Qp<B>> {
        self.qps.get_mut(qp.0).and_then(Option::as_mut)
    }

    /// Posts one chain: a receive (`op` Recv), a send, or one RDMA READ/WRITE per remote
    /// descriptor over `buffer[start..start + len]`. Only the last is signalled.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &mut self,
        qp: QpHandle,
        wr_id: u64,
        op: WorkOp,
        buffer: B,
        start: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        let base = buffer.as_ptr() as u64;
        let lkey = self.local_key(base, buffer.len());
        let addr = base + start.min(buffer.len()) as u64;
        let failed = |e: VerbsError, buffer: B| Completion {
            wr_id,
            op,
            buffer,
            len: 0,
            result: Err(e),
        };
        let Some(q) = self.qps.get_mut(qp.0).and_then(Option::as_mut) else {
            return; // Destroyed: the buffer goes back to the pool.
        };
        if q.error {
            q.immediate.push_back(failed(VerbsError::Flushed, buffer));
            return;
        }
        let Some(lkey) = lkey else {
            q.immediate
                .push_back(failed(VerbsError::Registration, buffer));
            return;
        };
        if start.saturating_add(len) > buffer.len() {
            let e = VerbsError::LengthError {
                len: start.saturating_add(len),
                posted: buffer.len(),
            };
            q.immediate.push_back(failed(e, buffer));
            return;
        }
        self.sges.clear();
        self.wrs.clear();
        let opcode = match op {
            WorkOp::RdmaWrite => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            WorkOp::RdmaRead => ibv_wr_opcode::IBV_WR_RDMA_READ,
            _ => ibv_wr_opcode::IBV_WR_SEND,
        };
        let mut at = 0usize;
        if matches!(op, WorkOp::RdmaWrite | WorkOp::RdmaRead) {
            for d in remote {
                if at >= len {
                    break;
                }
                let n = (len - at).min(d.len as usize);
                self.sges.push(ibv_sge {
                    addr: addr + at as u64,
                    length: n as u32,
                    lkey,
                });
                // Safety: a zeroed work request, filled in below.
                let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.opcode = opcode;
                wr.wr = wr_t {
                    rdma: rdma_t {
                        remote_addr: d.addr,
                        rkey: d.rkey,
                    },
                };
                self.wrs.push(wr);
                at += n;
            }
        } else {
            self.sges.push(ibv_sge {
                addr,
                length: len as u32,
                lkey,
            });
            // Safety: a zeroed work request, filled in below.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.opcode = opcode;
            self.wrs.push(wr);
            at = len;
        }
        let entries = self.wrs.len() as u32;
        let recv = op == WorkOp::Recv;
        let room = if recv {
            q.recv_used < q.depth.recv
        } else {
            q.send_used + entries <= q.depth.send
        };
        if entries == 0 {
            // Nothing to move (no bytes), or no descriptor to move them to.
            let result = if len == 0 {
                Ok(())
            } else {
                Err(VerbsError::LengthError { len, posted: 0 })
            };
            q.immediate.push_back(Completion {
                wr_id,
                op,
                buffer,
                len: 0,
                result,
            });
            return;
        }
        if !room {
            q.immediate.push_back(failed(VerbsError::QueueFull, buffer));
            return;
        }
        let slot = match q.free_ids.pop() {
            Some(i) => i,
            None => {
                q.in_flight.push(None);
                q.in_flight.len() - 1
            }
        };
        // The result, and whether the request that failed (if one did) was the first, so that
        // nothing of the chain reached the device.
        let (r, nothing_posted) = if recv {
            let mut wr = ibv_recv_wr {
                wr_id: slot as u64,
                next: ptr::null_mut(),
                sg_list: self.sges.as_mut_ptr(),
                num_sge: 1,
            };
            let mut bad = ptr::null_mut();
            // Safety: the queue pair is valid; the request names one scatter entry inside
            // the slot, which stays in the in-flight table until the completion.
            let r = unsafe { ibv_post_recv((*q.id).qp, &mut wr, &mut bad) };
            (r, true)
        } else {
            let last = self.wrs.len() - 1;
            let sges = self.sges.as_mut_ptr();
            let wrs = self.wrs.as_mut_ptr();
            for (i, wr) in self.wrs.iter_mut().enumerate() {
                // Safety: `i` indexes both vectors, which are not resized while the chain
                // is linked and posted.
                wr.sg_list = unsafe { sges.add(i) };
                wr.num_sge = 1;
                if i < last {
                    wr.wr_id = UNSIGNALLED;
                    // Safety: as above.
                    wr.next = unsafe { wrs.add(i + 1) };
                } else {
                    wr.wr_id = slot as u64;
                    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                    wr.next = ptr::null_mut();
                }
            }
            let mut bad = ptr::null_mut();
            // Safety: the queue pair is valid and has room for the whole chain (checked
            // above), whose scatter entries lie inside the slot held in flight until the
            // last request's completion.
            let r = unsafe { ibv_post_send((*q.id).qp, wrs, &mut bad) };
            (r, bad == wrs)
        };
        if r != 0 {
            q.free_ids.push(slot);
            if nothing_posted {
                let e = if r == libc::ENOMEM {
                    VerbsError::QueueFull
                } else {
                    VerbsError::Device(r as u32)
                };
                q.immediate.push_back(failed(e, buffer));
            } else {
                // Part of the chain may be on the device: the buffer must outlive it, so
                // it is not returned, and the queue pair is broken.
                std::mem::forget(buffer);
                q.error = true;
                // Safety: the id is valid.
                unsafe { rdma_disconnect(q.id) };
            }
            return;
        }
        if recv {
            q.recv_used += 1;
        } else {
            q.send_used += entries;
        }
        q.in_flight[slot] = Some(InFlight {
            wr_id,
            op,
            buffer,
            len: at,
            entries: if recv { 0 } else { entries },
        });
    }
}

/// Tears a queue pair down: after rdma_destroy_qp the device touches none of its buffers,
/// which are then dropped with it.
pub(super) fn destroy_qp<B>(q: Qp<B>) {
    // Safety: the queue pair is destroyed before its completion queue and id, each once.
    unsafe {
        rdma_disconnect(q.id);
        rdma_destroy_qp(q.id);
        ibv_destroy_cq(q.cq);
        rdma_destroy_id(q.id);
    }
}

impl<B: Registered> Verbs for RdmaVerbs<B> {
    type Qp = QpHandle;
    type Buffer = B;

    fn post_recv(&mut self, qp: QpHandle, wr_id: u64, buffer: B) {
        let len = buffer.len();
        self.post(qp, wr_id, WorkOp::Recv, buffer, 0, len, &[]);
    }

    fn post_send(&mut self, qp: QpHandle, wr_id: u64, buffer: B, len: usize) {
        self.post(qp, wr_id, WorkOp::Send, buffer, 0, len, &[]);
    }

    fn post_rdma_write(
        &mut self,
        qp: QpHandle,
        wr_id: u64,
        buffer: B,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        self.post(qp, wr_id, WorkOp::RdmaWrite, buffer, at, len, remote);
    }

    fn post_rdma_read(
        &mut self,
        qp: QpHandle,
        wr_id: u64,
        buffer: B,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        self.post(qp, wr_id, WorkOp::RdmaRead, buffer, at, len, remote);
    }

    fn poll(&mut self, qp: QpHandle) -> Option<Completion<B>> {
        let q = self.qp(qp)?;
        if let Some(c) = q.immediate.pop_front() {
            return Some(c);
        }
        loop {
            // Safety: a zeroed completion for ibv_poll_cq to fill.
            let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
            // Safety: the queue is valid; at most one entry is written into `wc`.
            if unsafe { ibv_poll_cq(q.cq, 1, &mut wc) } <= 0 {
                return None;
            }
            let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
            if !ok {
                q.error = true;
            }
            if wc.wr_id == UNSIGNALLED {
                continue; // A failed member of a chain; its last request reports the chain.
            }
            let Some(f) = q
                .in_flight
                .get_mut(wc.wr_id as usize)
                .and_then(Option::take)
            else {
                continue;
            };
            q.free_ids.push(wc.wr_id as usize);
            if f.op == WorkOp::Recv {
                q.recv_used -= 1;
            } else {
                q.send_used -= f.entries;
            }
            return Some(Completion {
                wr_id: f.wr_id,
                op: f.op,
                len: if f.op == WorkOp::Recv {
                    wc.byte_len as usize
                } else {
                    f.len
                },
                buffer: f.buffer,
                result: if ok { Ok(()) } else { Err(wc_error(wc.status)) },
            });
        }
    }

    fn is_error(&self, qp: QpHandle) -> bool {
        self.qps
            .get(qp.0)
            .and_then(Option::as_ref)
            .is_none_or(|q| q.error)
    }

    fn disconnect(&mut self, qp: QpHandle) {
        if let Some(q) = self.qp(qp) {
            q.error = true;
            // Safety: the id is valid; rdma_disconnect moves the queue pair to the error
            // state, so its requests complete (flushed) and give their buffers back.
            unsafe { rdma_disconnect(q.id) };
        }
    }
}
