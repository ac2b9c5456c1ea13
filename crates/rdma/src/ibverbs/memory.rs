//! Registered memory: arenas registered once, the local key of a buffer by where its bytes
//! lie, IU buffers from the slot pool, and memory the peer reaches.

use super::*;

impl<B: Registered> RdmaVerbs<B> {
    /// Registers `arena` for local access, once: its buffers may then be posted (a target's
    /// data moves from and into them with no registration per I/O). The verbs keep the arena
    /// mapped while the region exists.
    pub fn register_arena<M: RegisteredMemory>(&mut self, arena: &M) -> Result<(), RdmaError> {
        let registered =
            |a: &dyn std::any::Any| a.downcast_ref::<M>().is_some_and(|a| a.same(arena));
        if self.arenas.iter().any(|(a, _)| registered(a.as_ref())) {
            return Ok(());
        }
        // Safety: the range is the memory's whole mapping, which the clone kept below keeps
        // mapped (RegisteredMemory's contract) until the region is deregistered (in `drop`,
        // before the domain goes).
        let mr = unsafe {
            ibv_reg_mr(
                self.pd,
                arena.base().cast(),
                arena.size(),
                access_flags(Access::default()),
            )
        };
        if mr.is_null() {
            return Err(os("ibv_reg_mr"));
        }
        // Safety: a registered region's key.
        let lkey = unsafe { (*mr).lkey };
        let start = arena.base() as u64;
        self.local.push((start, start + arena.size() as u64, lkey));
        self.arenas.push((Box::new(arena.clone()), mr));
        Ok(())
    }

    /// The local key of `len` bytes at `addr`, if they lie in memory registered here.
    pub(super) fn local_key(&self, addr: u64, len: usize) -> Option<u32> {
        let end = addr.checked_add(len as u64)?;
        self.local
            .iter()
            .find(|&&(start, stop, _)| start <= addr && end <= stop)
            .map(|&(_, _, lkey)| lkey)
    }
}

impl<B: Registered> MessageBuffers for RdmaVerbs<B> {
    type Message = Slot;

    fn message_buffer(&mut self) -> Option<Slot> {
        self.slot()
    }
}

impl<B: Registered> PeerMemory for RdmaVerbs<B> {
    type Memory = usize;

    fn alloc(&mut self, len: usize) -> Result<usize, VerbsError> {
        self.memory.push(Allocation::new(len)?);
        Ok(self.memory.len() - 1)
    }

    fn read(&self, m: &usize, offset: usize, out: &mut [u8]) {
        let a = &self.memory[*m];
        // Safety: the allocation lives as long as `self`; see the module's documentation
        // for bytes the peer may write.
        let bytes = unsafe { std::slice::from_raw_parts(a.ptr, a.len()) };
        out.copy_from_slice(&bytes[offset..offset + out.len()]);
    }

    fn write(&mut self, m: &usize, offset: usize, data: &[u8]) {
        let a = &self.memory[*m];
        // Safety: as for `read`; `&mut self` makes this the only reference from here.
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.ptr, a.len()) };
        bytes[offset..offset + data.len()].copy_from_slice(data);
    }

    fn register(
        &mut self,
        m: &usize,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        let a = self.memory.get(*m).ok_or(VerbsError::Registration)?;
        if offset.checked_add(len).is_none_or(|end| end > a.len()) {
            return Err(VerbsError::Registration);
        }
        // Safety: the range lies inside an allocation that outlives the region (both are
        // released in `drop`, the region first).
        let mr =
            unsafe { ibv_reg_mr(self.pd, a.ptr.add(offset).cast(), len, access_flags(access)) };
        if mr.is_null() {
            return Err(VerbsError::Registration);
        }
        // Safety: a registered region's keys.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.regions.push((rkey, mr));
        Ok(MemoryRegion {
            lkey,
            rkey,
            addr: a.ptr as u64 + offset as u64,
            len: len as u32,
        })
    }

    fn deregister(&mut self, region: MemoryRegion) {
        if let Some(i) = self.regions.iter().position(|(k, _)| *k == region.rkey) {
            let (_, mr) = self.regions.swap_remove(i);
            // Safety: registered here and deregistered once.
            unsafe { ibv_dereg_mr(mr) };
        }
    }
}
