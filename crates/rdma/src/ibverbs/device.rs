//! Opening a device and its teardown: the protection domain, the slot pool, the completion
//! channel, connection events, and everything released in order.

use super::*;

impl<B: Registered> RdmaVerbs<B> {
    /// Opens `device` (the first rdma_cm knows when `None`) with a pool of `slots` buffers of
    /// `slot_len` bytes, registered once.
    pub fn open(
        device: Option<&str>,
        slots: u32,
        slot_len: usize,
    ) -> Result<RdmaVerbs<B>, RdmaError> {
        let mut n = 0;
        // Safety: rdma_get_devices returns rdma_cm's array of `n` open device contexts (or
        // NULL); it is kept until `drop` frees it with rdma_free_devices.
        let devices = unsafe { rdma_get_devices(&mut n) };
        if devices.is_null() || n <= 0 {
            if !devices.is_null() {
                // Safety: freed once, not used after.
                unsafe { rdma_free_devices(devices) };
            }
            return Err(RdmaError::NoDevice(String::new()));
        }
        let mut context = ptr::null_mut();
        for i in 0..n as usize {
            // Safety: `i` is below the count; each context and its device are valid while
            // the array is held, and the name is a NUL-terminated string of the device.
            let (c, name) = unsafe {
                let c = *devices.add(i);
                (c, CStr::from_ptr(ibv_get_device_name((*c).device)))
            };
            if device.is_none_or(|d| name.to_bytes() == d.as_bytes()) {
                context = c;
                break;
            }
        }
        let fail = |e: RdmaError| {
            // Safety: the array came from rdma_get_devices and is freed once.
            unsafe { rdma_free_devices(devices) };
            e
        };
        if context.is_null() {
            return Err(fail(RdmaError::NoDevice(format!(
                " named {}",
                device.unwrap_or_default()
            ))));
        }
        // Safety: a zeroed attribute struct for ibv_query_device to fill; the context is
        // valid (see above).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // Safety: as above.
        if unsafe { ibv_query_device(context, &mut attr) } != 0 {
            return Err(fail(os("ibv_query_device")));
        }
        // Safety: the context is valid; the domain is deallocated in `drop`.
        let pd = unsafe { ibv_alloc_pd(context) };
        if pd.is_null() {
            return Err(fail(os("ibv_alloc_pd")));
        }
        // Safety: the context is valid; the channel is destroyed in `drop`.
        let comp = unsafe { ibv_create_comp_channel(context) };
        if comp.is_null() {
            let e = os("ibv_create_comp_channel");
            // Safety: the domain is unused and deallocated once.
            unsafe { ibv_dealloc_pd(pd) };
            return Err(fail(e));
        }
        let len = slots as usize * slot_len;
        let built = Allocation::new(len)
            .map_err(|_| RdmaError::Os {
                call: "alloc",
                source: io::Error::from(io::ErrorKind::OutOfMemory),
            })
            .and_then(|memory| {
                // Safety: the region covers exactly the allocation, which the pool owns and
                // frees only after deregistering it (Pool's drop).
                let mr = unsafe {
                    ibv_reg_mr(
                        pd,
                        memory.ptr.cast(),
                        memory.len(),
                        access_flags(Access::default()),
                    )
                };
                if mr.is_null() {
                    return Err(os("ibv_reg_mr"));
                }
                Ok(Pool {
                    memory,
                    mr,
                    slot_len,
                    free: RefCell::new((0..slots).rev().collect()),
                })
            });
        let pool = match built {
            Ok(p) => p,
            Err(e) => {
                // Safety: both are unused and released once.
                unsafe {
                    ibv_destroy_comp_channel(comp);
                    ibv_dealloc_pd(pd);
                }
                return Err(fail(e));
            }
        };
        // Safety: creates rdma_cm's channel for this device's connections, destroyed in
        // `drop` after their ids.
        let cm = unsafe { rdma_create_event_channel() };
        // Safety: the pool's region is valid while the pool is.
        let pool_lkey = unsafe { (*pool.mr).lkey };
        let pool_start = pool.memory.ptr as u64;
        let pool_end = pool_start + pool.memory.len() as u64;
        let verbs = RdmaVerbs {
            devices,
            context,
            pd,
            comp,
            cm,
            pool: Some(Rc::new(pool)),
            memory: Vec::new(),
            regions: Vec::new(),
            arenas: Vec::new(),
            local: vec![(pool_start, pool_end, pool_lkey)],
            qps: Vec::new(),
            max_qp_wr: attr.max_qp_wr.max(1) as u32,
            max_rd_atom: attr.max_qp_rd_atom.clamp(1, 255) as u8,
            sges: Vec::new(),
            wrs: Vec::new(),
        };
        if cm.is_null() {
            return Err(os("rdma_create_event_channel"));
        }
        // Safety: both channels are valid; their descriptors are theirs.
        unsafe {
            set_nonblocking((*comp).fd)?;
            set_nonblocking((*cm).fd)?;
        }
        Ok(verbs)
    }

    /// rdma_cm's descriptor for this device's connections: readable when
    /// [`RdmaVerbs::poll_connection`] has something.
    pub fn connection_fd(&self) -> BorrowedFd<'_> {
        // Safety: the channel is valid, and its descriptor open, while `self` is, which the
        // borrow does not outlive.
        unsafe { BorrowedFd::borrow_raw((*self.cm).fd) }
    }

    /// The next change of a connection's state. A disconnected queue pair is in the error
    /// state: its requests complete, flushed; then [`RdmaVerbs::destroy`] it.
    pub fn poll_connection(&mut self) -> Option<(QpHandle, Connection)> {
        loop {
            let event = next_event(self.cm)?;
            // Safety: an id's context is its queue pair's number plus one (set when it was
            // made); ids of this channel live until their queue pair is destroyed.
            let context = unsafe { (*event.id).context } as usize;
            let kind = event.kind;
            let Some(qp) = context.checked_sub(1).map(QpHandle) else {
                continue;
            };
            let state = match kind {
                rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => Connection::Established,
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    if let Some(q) = self.qp(qp) {
                        q.error = true;
                    }
                    Connection::Disconnected
                }
                _ => continue,
            };
            return Some((qp, state));
        }
    }

    /// The device's name.
    pub fn name(&self) -> String {
        // Safety: the context is valid while `self` is; the name is NUL-terminated.
        unsafe { CStr::from_ptr(ibv_get_device_name((*self.context).device)) }
            .to_string_lossy()
            .into_owned()
    }

    /// A free buffer of the pool (its full length), if one is left.
    pub fn slot(&self) -> Option<Slot> {
        let pool = self.pool.as_ref()?;
        let index = pool.free.borrow_mut().pop()?;
        Some(Slot {
            pool: Rc::clone(pool),
            index,
            len: pool.slot_len,
        })
    }

    /// The completion channel's descriptor: readable when a queue pair has completions
    /// (then [`RdmaVerbs::ack_events`] and poll each queue pair).
    pub fn completion_fd(&self) -> BorrowedFd<'_> {
        // Safety: the channel is valid, and its descriptor open, while `self` is, which the
        // borrow does not outlive.
        unsafe { BorrowedFd::borrow_raw((*self.comp).fd) }
    }

    /// Takes the completion channel's events, acknowledges them and asks for the next: the
    /// queue pairs that have completions to poll are added to `ready` (the caller's, reused).
    pub fn ack_events(&mut self, ready: &mut Vec<QpHandle>) {
        loop {
            let mut cq = ptr::null_mut();
            let mut context = ptr::null_mut();
            // Safety: the channel is valid and non-blocking; on success `cq` is one of ours.
            if unsafe { ibv_get_cq_event(self.comp, &mut cq, &mut context) } != 0 {
                break;
            }
            // Safety: the event came from `cq`, acknowledged once, then the queue is armed
            // again for the next completion.
            unsafe {
                ibv_ack_cq_events(cq, 1);
                ibv_req_notify_cq(cq, 0);
            }
            // The queue's context is its queue pair's number plus one (set when it was made).
            let qp = (context as usize).checked_sub(1).map(QpHandle);
            if let Some(qp) = qp.filter(|&qp| self.qps.get(qp.0).is_some_and(Option::is_some)) {
                ready.push(qp);
            }
        }
    }
}

impl<B> Drop for RdmaVerbs<B> {
    fn drop(&mut self) {
        for i in 0..self.qps.len() {
            if let Some(q) = self.qps[i].take() {
                destroy_qp(q);
            }
        }
        for (_, mr) in self.arenas.drain(..) {
            // Safety: registered here over an arena this clone keeps mapped, deregistered
            // once, after every queue pair that could use it.
            unsafe { ibv_dereg_mr(mr) };
        }
        for (_, mr) in self.regions.drain(..) {
            // Safety: each region was registered here and is deregistered once, before
            // its memory (dropped after this body) is freed.
            unsafe { ibv_dereg_mr(mr) };
        }
        // Safety: no queue or id uses the channels any more, each destroyed once.
        unsafe {
            ibv_destroy_comp_channel(self.comp);
            if !self.cm.is_null() {
                rdma_destroy_event_channel(self.cm);
            }
        }
        // The pool's region goes when its last slot does: a slot kept past the verbs keeps
        // the domain busy (ibv_dealloc_pd then fails, and leaks it, harmlessly).
        self.pool = None;
        // Safety: the domain is deallocated after every region of it, then rdma_cm's device
        // array, each once.
        unsafe {
            ibv_dealloc_pd(self.pd);
            rdma_free_devices(self.devices);
        }
    }
}
