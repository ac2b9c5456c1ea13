//! The initiator's data memory: where an SRP initiator's commands keep their data buffers, and
//! how that memory is registered so the target may reach it (paper 004's three ways).
//!
//! An SRP_CMD names its data buffer by memory descriptors (address, R_Key, length); the target
//! moves the data itself by RDMA. So every byte a command exposes must lie in a memory region
//! registered for remote access while the command runs. Registering is expensive (the paper
//! measured 32 registrations of 4 KiB pages at 260 us, one of a whole 128 KiB scatter list at
//! 22 us), so *when* it happens decides throughput for commands of many discrete regions:
//!
//! - [`Registration::PerCommand`]: each region registered when the command is sent and
//!   deregistered when its response arrives (the slow path: 32 registrations for a 128 KiB
//!   command of 4 KiB pages);
//! - [`Registration::Cache`]: a registration per buffer range, kept and reused when a later
//!   command uses the same range (a pin-down cache);
//! - [`Registration::Pool`]: the whole memory registered once; commands name slices of it.
//!
//! [`DataMemory`] holds one allocation cut into places, one per command in flight; a command's
//! regions lie apart inside its place (every other chunk, as scattered pages are), followed by
//! its descriptor table when it has more than one region. It works over any [`PeerMemory`]: the
//! software fabric or a real device.

use std::collections::HashMap;

pub mod channel;

use crate::iu::{DataBufferDescriptor, Descriptors, MemoryDescriptor, DESCRIPTOR_LEN};
use rdma::verbs::{Access, MemoryRegion, PeerMemory, VerbsError};

/// How an initiator registers the memory its commands' descriptors name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Registration {
    /// Each region of each command registered when the command is sent, deregistered when it
    /// ends.
    #[default]
    PerCommand,
    /// A registration per buffer range, kept and reused (a pin-down cache).
    Cache,
    /// One registration of the whole memory, made once.
    Pool,
}

impl Registration {
    /// All three, slowest first.
    pub const ALL: [Registration; 3] = [
        Registration::PerCommand,
        Registration::Cache,
        Registration::Pool,
    ];

    /// Its name on a command line and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Registration::PerCommand => "per-command",
            Registration::Cache => "cache",
            Registration::Pool => "pool",
        }
    }
}

impl std::str::FromStr for Registration {
    type Err = String;

    fn from_str(s: &str) -> Result<Registration, String> {
        Registration::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("{s:?} is none of per-command, cache, pool"))
    }
}

/// Why a command's buffer could not be exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ExposeError {
    /// Every place is taken by a command in flight.
    #[error("every buffer place is taken by a command in flight")]
    NoPlace,
    /// The tag already has a place.
    #[error("tag {0} already has a buffer")]
    TagInUse(u64),
    /// The buffer (with its regions apart and its table) does not fit a place.
    #[error("{len} bytes in {regions} regions do not fit a place of {place} bytes")]
    TooLarge {
        /// Bytes of data.
        len: usize,
        /// Regions.
        regions: usize,
        /// Bytes of a place.
        place: usize,
    },
    /// The verbs refused a registration.
    #[error("registration: {0}")]
    Verbs(#[from] VerbsError),
}

/// A command's buffer as [`DataMemory::expose`] laid it out.
#[derive(Debug, Clone)]
pub enum Exposed {
    /// No data.
    None,
    /// One region.
    Direct(MemoryDescriptor),
    /// Several regions (or one, with the table to be fetched): the table in the initiator's
    /// memory, and the descriptors the IU carries.
    Indirect {
        /// Where the whole table lies.
        table: MemoryDescriptor,
        /// Bytes of all regions.
        total_len: u32,
        /// The descriptors the IU carries (all of them, or only the first).
        in_iu: Vec<u8>,
    },
}

impl Exposed {
    /// The descriptor for the SRP_CMD's data-out or data-in field.
    pub fn descriptor(&self) -> DataBufferDescriptor<'_> {
        match self {
            Exposed::None => DataBufferDescriptor::None,
            Exposed::Direct(d) => DataBufferDescriptor::Direct(*d),
            Exposed::Indirect {
                table,
                total_len,
                in_iu,
            } => DataBufferDescriptor::Indirect {
                table: *table,
                total_len: *total_len,
                partial: Descriptors::new(in_iu).expect("whole descriptors, built by expose"),
            },
        }
    }
}

/// Where one command's buffer lies.
#[derive(Debug)]
struct InFlight {
    place: usize,
    /// (offset in the memory, length) of each region, in order.
    regions: Vec<(usize, usize)>,
    /// Regions registered for this command alone, deregistered when it ends.
    own: Vec<MemoryRegion>,
}

/// An initiator's data memory: `places` places of `place_len` bytes in one allocation of the
/// verbs, registered as `registration` says. See the module's documentation.
#[derive(Debug)]
pub struct DataMemory<M> {
    memory: M,
    place_len: usize,
    registration: Registration,
    pool: Option<MemoryRegion>,
    cache: HashMap<(usize, usize), MemoryRegion>,
    free: Vec<usize>,
    in_flight: HashMap<u64, InFlight>,
}

impl<M> DataMemory<M> {
    /// Allocates `places` places of `place_len` bytes with `verbs`; with
    /// [`Registration::Pool`], registers them all now.
    pub fn new<V: PeerMemory<Memory = M>>(
        verbs: &mut V,
        registration: Registration,
        places: usize,
        place_len: usize,
    ) -> Result<DataMemory<M>, VerbsError> {
        let len = places
            .checked_mul(place_len)
            .ok_or(VerbsError::Registration)?;
        let memory = verbs.alloc(len)?;
        let pool = match registration {
            Registration::Pool => Some(verbs.register(&memory, 0, len, Access::REMOTE)?),
            _ => None,
        };
        Ok(DataMemory {
            memory,
            place_len,
            registration,
            pool,
            cache: HashMap::new(),
            free: (0..places).rev().collect(),
            in_flight: HashMap::new(),
        })
    }

    /// How it registers.
    pub fn registration(&self) -> Registration {
        self.registration
    }

    /// Commands holding a place.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The largest buffer of `regions` regions a place holds.
    pub fn max_len(&self, regions: usize) -> usize {
        let regions = regions.max(1);
        let table = if regions > 1 {
            regions * DESCRIPTOR_LEN
        } else {
            0
        };
        self.place_len.saturating_sub(table) / 2
    }

    /// Lays out a buffer of `len` bytes for command `tag` as `regions` discrete regions (the
    /// last may be shorter), copies `data_out` into it, registers what the strategy wants
    /// registered now and returns its descriptor: direct for one region, indirect (with the
    /// table in memory) for more, or with `partial` an indirect one that carries only the
    /// first descriptor in the IU so the target must fetch the table. The place is the
    /// command's until [`DataMemory::release`].
    #[allow(clippy::too_many_arguments)]
    pub fn expose<V: PeerMemory<Memory = M>>(
        &mut self,
        verbs: &mut V,
        tag: u64,
        len: usize,
        regions: usize,
        partial: bool,
        data_out: Option<&[u8]>,
    ) -> Result<Exposed, ExposeError> {
        if self.in_flight.contains_key(&tag) {
            return Err(ExposeError::TagInUse(tag));
        }
        let n = regions.max(1);
        if len > self.max_len(n) {
            return Err(ExposeError::TooLarge {
                len,
                regions: n,
                place: self.place_len,
            });
        }
        let Some(place) = self.free.pop() else {
            return Err(ExposeError::NoPlace);
        };
        let mut c = InFlight {
            place,
            regions: Vec::with_capacity(n),
            own: Vec::new(),
        };
        let base = place * self.place_len;
        let chunk = len.div_ceil(n).max(1);
        let mut at = 0;
        while at < len {
            let this = chunk.min(len - at);
            c.regions.push((base + 2 * at, this));
            at += this;
        }
        if let Some(d) = data_out {
            for (&(offset, _), src) in c.regions.iter().zip(d[..len].chunks(chunk)) {
                verbs.write(&self.memory, offset, src);
            }
        }
        let r = self.describe(verbs, &mut c, base, len, partial);
        if r.is_err() {
            self.end(verbs, c);
        } else {
            self.in_flight.insert(tag, c);
        }
        r
    }

    fn describe<V: PeerMemory<Memory = M>>(
        &mut self,
        verbs: &mut V,
        c: &mut InFlight,
        base: usize,
        len: usize,
        partial: bool,
    ) -> Result<Exposed, ExposeError> {
        let mut remote = Vec::with_capacity(c.regions.len());
        for &(offset, this) in &c.regions {
            remote.push(self.remote(verbs, &mut c.own, offset, this)?);
        }
        Ok(if len == 0 {
            Exposed::None
        } else if remote.len() == 1 && !partial {
            Exposed::Direct(remote[0])
        } else {
            let mut list = Vec::with_capacity(remote.len() * DESCRIPTOR_LEN);
            remote.iter().for_each(|d| d.encode(&mut list));
            let at = base + 2 * len;
            verbs.write(&self.memory, at, &list);
            let table = self.remote(verbs, &mut c.own, at, list.len())?;
            if partial {
                list.truncate(DESCRIPTOR_LEN);
            }
            Exposed::Indirect {
                table,
                total_len: len as u32,
                in_iu: list,
            }
        })
    }

    /// A descriptor of `len` bytes at `offset` the target may reach, registered as the
    /// strategy says: now (per command, kept in `own`), once per range (cache), or with the
    /// whole memory (pool).
    fn remote<V: PeerMemory<Memory = M>>(
        &mut self,
        verbs: &mut V,
        own: &mut Vec<MemoryRegion>,
        offset: usize,
        len: usize,
    ) -> Result<MemoryDescriptor, VerbsError> {
        let region =
            |verbs: &mut V, memory: &M| verbs.register(memory, offset, len, Access::REMOTE);
        Ok(match (self.registration, self.pool) {
            (Registration::Pool, Some(pool)) => pool.remote(offset as u32, len as u32).into(),
            (Registration::Cache, _) => match self.cache.get(&(offset, len)) {
                Some(r) => r.remote(0, len as u32).into(),
                None => {
                    let r = region(verbs, &self.memory)?;
                    self.cache.insert((offset, len), r);
                    r.remote(0, len as u32).into()
                }
            },
            _ => {
                let r = region(verbs, &self.memory)?;
                own.push(r);
                r.remote(0, len as u32).into()
            }
        })
    }

    /// Appends the bytes of command `tag`'s regions, in order, to `out` (its data-in once it
    /// has ended).
    pub fn read_data<V: PeerMemory<Memory = M>>(&self, verbs: &V, tag: u64, out: &mut Vec<u8>) {
        for &(offset, len) in self
            .in_flight
            .get(&tag)
            .into_iter()
            .flat_map(|c| &c.regions)
        {
            let at = out.len();
            out.resize(at + len, 0);
            verbs.read(&self.memory, offset, &mut out[at..]);
        }
    }

    /// Command `tag` has ended (its response arrived, it was aborted, or its channel is gone):
    /// its per-command registrations are undone and its place is free again. False if it held
    /// none.
    pub fn release<V: PeerMemory<Memory = M>>(&mut self, verbs: &mut V, tag: u64) -> bool {
        match self.in_flight.remove(&tag) {
            Some(c) => {
                self.end(verbs, c);
                true
            }
            None => false,
        }
    }

    /// Releases every command's place.
    pub fn release_all<V: PeerMemory<Memory = M>>(&mut self, verbs: &mut V) {
        for (_, c) in std::mem::take(&mut self.in_flight) {
            self.end(verbs, c);
        }
    }

    fn end<V: PeerMemory<Memory = M>>(&mut self, verbs: &mut V, c: InFlight) {
        for r in c.own {
            verbs.deregister(r);
        }
        self.free.push(c.place);
    }
}

/// Encodes into `out` the SRP_CMD of a write whose `data` goes in the IU as immediate data at
/// `offset` (the login's IMMEDIATE DATA OFFSET), if it can: the descriptors end before
/// `offset` and the IU is at most `max_it_iu_len` bytes. Returns whether it did (else the
/// data goes by RDMA READ from the initiator's memory).
pub fn encode_immediate_write(
    cmd: &crate::iu::SrpCmd<'_>,
    data: &[u8],
    offset: usize,
    max_it_iu_len: usize,
    out: &mut Vec<u8>,
) -> bool {
    let iu = crate::iu::SrpCmd {
        data_out: DataBufferDescriptor::Immediate {
            len: data.len() as u32,
        },
        data_in: DataBufferDescriptor::None,
        ..*cmd
    };
    if iu.encoded_len() > offset || offset.saturating_add(data.len()) > max_it_iu_len {
        return false;
    }
    iu.encode_with_immediate(offset, data, out);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma::fabric::{Fabric, NodeId};

    const I: NodeId = NodeId(1);

    #[test]
    fn each_strategy_registers_when_it_says() {
        for (registration, at_start, per_command, second) in [
            (Registration::Pool, 1, 0, 0),
            (Registration::Cache, 0, 33, 0),
            (Registration::PerCommand, 0, 33, 33),
        ] {
            let mut fabric = Fabric::new();
            let mut port = fabric.port(I);
            let mut m = DataMemory::new(&mut port, registration, 4, 512 * 1024).unwrap();
            let start = fabric.counters.registrations[1];
            assert_eq!(start, at_start, "{registration:?} at start");
            let data = vec![7u8; 128 * 1024];
            let mut port = fabric.port(I);
            let e = m
                .expose(&mut port, 1, data.len(), 32, false, Some(&data))
                .unwrap();
            assert!(matches!(
                e.descriptor(),
                DataBufferDescriptor::Indirect { total_len, .. } if total_len == 128 * 1024
            ));
            let mut gathered = Vec::new();
            m.read_data(&port, 1, &mut gathered);
            assert_eq!(gathered, data, "data-out lies in the regions in order");
            assert!(m.release(&mut port, 1));
            assert!(!m.release(&mut port, 1), "released once");
            let first = fabric.counters.registrations[1] - start;
            assert_eq!(first, per_command, "{registration:?} first command");
            let mut port = fabric.port(I);
            m.expose(&mut port, 2, data.len(), 32, false, None).unwrap();
            m.release(&mut port, 2);
            let again = fabric.counters.registrations[1] - start - first;
            assert_eq!(again, second, "{registration:?} the same place again");
        }
    }

    #[test]
    fn places_are_bounded_and_reused() {
        let mut fabric = Fabric::new();
        let mut port = fabric.port(I);
        let mut m = DataMemory::new(&mut port, Registration::Pool, 2, 8192).unwrap();
        assert!(m.expose(&mut port, 1, 4096, 1, false, None).is_ok());
        assert_eq!(
            m.expose(&mut port, 1, 4096, 1, false, None).unwrap_err(),
            ExposeError::TagInUse(1)
        );
        assert!(m.expose(&mut port, 2, 4096, 1, false, None).is_ok());
        assert_eq!(
            m.expose(&mut port, 3, 4096, 1, false, None).unwrap_err(),
            ExposeError::NoPlace
        );
        assert!(matches!(
            m.expose(&mut port, 3, 8192, 1, false, None),
            Err(ExposeError::TooLarge { .. })
        ));
        m.release(&mut port, 1);
        assert!(m.expose(&mut port, 3, 4096, 1, false, None).is_ok());
        assert_eq!(m.in_flight(), 2);
        m.release_all(&mut port);
        assert_eq!(m.in_flight(), 0);
    }
}
