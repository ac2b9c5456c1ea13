//! Several gateways as one target (`[cluster]`, feature `rbd`): the reservations of every RBD
//! unit live in one RADOS object per image, so a reservation taken through one gateway binds
//! the initiators of every gateway.
//!
//! The device server of each gateway shares the unit's reservations
//! ([`scsi_core::Device::share_reservations`]): a PERSISTENT RESERVE OUT, RESERVE or RELEASE
//! waits while the [`Keeper`] decides it on this gateway's reservations thread:
//!
//! 1. read the object and its version;
//! 2. apply the request with [`Reservations::apply`] (the same code a lone device server
//!    runs), which may refuse it (RESERVATION CONFLICT, sense) without writing anything;
//! 3. write the new state only if the object is still at the version read (compare-and-swap;
//!    of two gateways racing, one wins, the other reads again and decides again);
//! 4. apply it on this gateway, then notify every gateway watching the object: each applies
//!    the new state, establishes the unit attentions and aborts the tasks of the nexuses it
//!    carries, and acknowledges; the notify returns when all have, or after
//!    `cluster.notify_timeout` (the silent gateways are logged by their RADOS client id);
//! 5. end the command.
//!
//! So the command that changed the reservations ends only after every live gateway enforces
//! the change. A state is applied only when its version is newer than the one a gateway
//! holds, so a change heard twice (its own notify) or late changes nothing.
//!
//! APTPL is natural: the object outlives every gateway. Without APTPL the state is cleared when
//! a gateway opens the unit and no gateway watches the object (all of them restarted), as a
//! power loss clears a lone target's.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use backend::rbd::rados::{CasError, Notification, Pool, Watch};
use backend::rbd::{Cluster, ClusterConfig, ImageSpec};
use scsi_core::pr::{PrError, ReservationEffects, Reservations};
use scsi_core::{BackendError, ReservationChange, Sense};

use crate::config;
use crate::target::Target;

/// The largest reservation state read back: registrations of thousands of initiators.
const MAX_STATE: usize = 1 << 20;

/// How often a change is decided again after losing a compare-and-swap race before the
/// command ends with NOT READY (the initiator retries it).
const MAX_RACES: usize = 64;

/// A change to decide, from a target's device server.
struct Job {
    target: Weak<Target>,
    change: ReservationChange,
}

/// This gateway's membership in a cluster of gateways: the pool of shared objects and the
/// thread that decides changes to reservations.
pub struct Keeper {
    config: config::Cluster,
    pool: Arc<Pool>,
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("cluster", &self.config.name)
            .field("gateway", &self.config.gateway)
            .finish()
    }
}

/// A unit whose shared reservations this gateway follows; dropping it stops following.
#[derive(Debug)]
pub struct SharedUnit {
    /// The object the reservations are in.
    pub oid: String,
    _watch: Watch,
}

impl Keeper {
    /// Connects to the cluster `c` names and starts the reservations thread. Errors name the
    /// `[cluster]` key they are about.
    pub fn start(c: &config::Cluster) -> Result<Arc<Keeper>, (String, String)> {
        let named = |e: backend::rbd::RbdError| (format!("cluster.{}", e.key()), e.to_string());
        let cluster = Cluster::shared(&ClusterConfig {
            ceph_conf: c.ceph_conf.clone(),
            client: c.client.clone().unwrap_or_else(|| "admin".into()),
            keyring: c.keyring.clone(),
            timeout: Duration::from_secs(c.ceph_timeout.unwrap_or(config::DEFAULT_CEPH_TIMEOUT)),
            cache: false,
        })
        .map_err(named)?;
        let pool = Pool::open(cluster, &c.pool, c.namespace.as_deref().unwrap_or_default())
            .map_err(named)?;
        let (tx, rx) = mpsc::channel::<Job>();
        let keeper = Arc::new(Keeper {
            config: c.clone(),
            pool,
            jobs: Mutex::new(tx),
        });
        let weak = Arc::downgrade(&keeper);
        std::thread::Builder::new()
            .name("reservations".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let Some(keeper) = weak.upgrade() else { return };
                    keeper.decide(job);
                }
            })
            .map_err(|e| ("cluster".to_string(), format!("a thread: {e}")))?;
        tracing::info!(
            cluster = %c.name,
            gateway = %c.gateway,
            port_group = c.port_group,
            pool = %c.pool,
            "joined the cluster of gateways"
        );
        Ok(keeper)
    }

    /// This gateway's `[cluster]`.
    pub fn config(&self) -> &config::Cluster {
        &self.config
    }

    /// The object holding the reservations of units on `image`.
    pub fn object(&self, image: &ImageSpec) -> String {
        format!("{}.reservations.{image}", self.config.name)
    }

    /// The shared state of `oid` and its version, created empty when absent. When no gateway
    /// watches it (all restarted) and APTPL is off, it is cleared first.
    pub fn load(&self, oid: &str) -> Result<(Reservations, u64), String> {
        for _ in 0..MAX_RACES {
            let read = self.pool.read(oid, MAX_STATE).map_err(rados_text)?;
            let Some(v) = read else {
                match self
                    .pool
                    .replace(oid, None, &Reservations::default().encode())
                {
                    Ok(_) | Err(CasError::Conflict) => continue,
                    Err(CasError::Rados(e)) => return Err(rados_text(e)),
                }
            };
            let state = Reservations::decode(&v.data)
                .ok_or_else(|| format!("the reservations in object {oid} are damaged"))?;
            if state != Reservations::default()
                && !state.persistent.aptpl
                && self.nobody_watches(oid)?
            {
                match self
                    .pool
                    .replace(oid, Some(v.version), &Reservations::default().encode())
                {
                    Ok(version) => {
                        tracing::info!(
                            object = oid,
                            "reservations without APTPL cleared: no gateway served them"
                        );
                        return Ok((Reservations::default(), version));
                    }
                    Err(CasError::Conflict) => continue,
                    Err(CasError::Rados(e)) => return Err(rados_text(e)),
                }
            }
            return Ok((state, v.version));
        }
        Err(format!("object {oid} kept changing while it was read"))
    }

    /// Whether no gateway watches `oid`: a notify nobody receives.
    fn nobody_watches(&self, oid: &str) -> Result<bool, String> {
        let o = self
            .pool
            .notify(oid, &[], Duration::from_secs(1))
            .map_err(rados_text)?;
        Ok(o.acked.is_empty() && o.timed_out.is_empty())
    }

    /// Follows `oid` for unit `lun` of `target`: every change another gateway makes is applied
    /// to this gateway's device server before it is acknowledged.
    pub fn follow(&self, target: Weak<Target>, lun: u16, oid: &str) -> Result<SharedUnit, String> {
        let pool = self.pool.clone();
        let name = oid.to_string();
        let on_notify = move |n: Notification| {
            if let Some((version, state, effects)) = decode_change(&n.payload) {
                if let Some(t) = target.upgrade() {
                    t.apply_shared_reservations(lun, version, state, &effects);
                }
            }
            if let Err(e) = pool.ack(&name, &n, &[]) {
                tracing::warn!(object = %name, "acknowledging a change: {}", rados_text(e));
            }
        };
        let name = oid.to_string();
        let on_error = move |e: i32| {
            tracing::error!(
                object = %name,
                "lost the watch on the shared reservations: {}; changes other gateways make \
                 are no longer seen here",
                rados_text(e)
            );
        };
        let timeout = Duration::from_secs(
            self.config
                .ceph_timeout
                .unwrap_or(config::DEFAULT_CEPH_TIMEOUT),
        );
        let watch = self
            .pool
            .watch(oid, timeout, on_notify, on_error)
            .map_err(rados_text)?;
        Ok(SharedUnit {
            oid: oid.to_string(),
            _watch: watch,
        })
    }

    /// Queues a change for the reservations thread.
    pub fn submit(&self, target: Weak<Target>, change: ReservationChange) {
        let job = Job { target, change };
        if let Err(mpsc::SendError(job)) = self
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(job)
        {
            // The thread has ended (the daemon stops): what waits ends unanswered by it.
            if let Some(t) = job.target.upgrade() {
                if let Some(task) = job.change.task {
                    t.reservation_done(task, Err(unavailable()));
                }
                if let Some(reference) = job.change.tmf {
                    t.task_management_change_done(reference);
                }
            }
        }
    }

    /// Decides one change and ends its command.
    fn decide(&self, job: Job) {
        let Some(target) = job.target.upgrade() else {
            return;
        };
        let c = &job.change;
        let oid = target
            .lun(c.lun)
            .and_then(|l| l.shared.as_ref().map(|s| s.oid.clone()));
        let result = match oid {
            Some(oid) => self.change(&target, &oid, c),
            None => Err(unavailable()),
        };
        if let Some(task) = c.task {
            target.reservation_done(task, result);
        }
        if let Some(reference) = c.tmf {
            target.task_management_change_done(reference);
        }
    }

    fn change(&self, target: &Target, oid: &str, c: &ReservationChange) -> Result<(), PrError> {
        for _ in 0..MAX_RACES {
            let read = self.pool.read(oid, MAX_STATE).map_err(|e| {
                tracing::warn!(object = oid, "reading the reservations: {}", rados_text(e));
                unavailable()
            })?;
            let (state, version) = match read {
                Some(v) => match Reservations::decode(&v.data) {
                    Some(s) => (s, Some(v.version)),
                    None => {
                        tracing::error!(object = oid, "the shared reservations are damaged");
                        return Err(unavailable());
                    }
                },
                None => (Reservations::default(), None),
            };
            let mut next = state.clone();
            let effects = next.apply(&c.nexus, &c.request)?;
            // A reset changes nothing shared when no SPC-2 reservation is held, but the other
            // gateways must reset too: it is written (a new version) all the same.
            if next == state && !effects.reset {
                return Ok(());
            }
            let version = match self.pool.replace(oid, version, &next.encode()) {
                Ok(v) => v,
                Err(CasError::Conflict) => continue,
                Err(CasError::Rados(e)) => {
                    tracing::warn!(object = oid, "writing the reservations: {}", rados_text(e));
                    return Err(unavailable());
                }
            };
            let payload = encode_change(version, &next, &effects);
            // This gateway made the change: a reset has been carried out here already.
            let here = ReservationEffects {
                reset: false,
                ..effects
            };
            target.apply_shared_reservations(c.lun, version, next, &here);
            let timeout = Duration::from_secs(self.config.notify_timeout);
            match self.pool.notify(oid, &payload, timeout) {
                Ok(o) if o.timed_out.is_empty() => {}
                Ok(o) => tracing::warn!(
                    object = oid,
                    silent = ?o.timed_out.iter().map(|(gid, _)| format!("client.{gid}")).collect::<Vec<_>>(),
                    "gateways did not apply a change to the reservations in time"
                ),
                Err(e) => tracing::warn!(
                    object = oid,
                    "telling the other gateways of a change: {}",
                    rados_text(e)
                ),
            }
            return Ok(());
        }
        tracing::warn!(
            object = oid,
            "lost {MAX_RACES} races to change the reservations"
        );
        Err(unavailable())
    }
}

/// NOT READY, LOGICAL UNIT IS IN PROCESS OF BECOMING READY: the cluster did not answer, the
/// initiator retries.
fn unavailable() -> PrError {
    PrError::Sense(Sense::from(BackendError::Unavailable))
}

fn rados_text(e: i32) -> String {
    std::io::Error::from_raw_os_error(-e).to_string()
}

/// A change as gateways tell each other: le64 version, le32 length and the state, then the
/// effects.
fn encode_change(version: u64, state: &Reservations, effects: &ReservationEffects) -> Vec<u8> {
    let s = state.encode();
    let mut b = Vec::with_capacity(12 + s.len());
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(&s);
    b.extend_from_slice(&effects.encode());
    b
}

fn decode_change(b: &[u8]) -> Option<(u64, Reservations, ReservationEffects)> {
    let version = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let len = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?) as usize;
    let state = Reservations::decode(b.get(12..12usize.checked_add(len)?)?)?;
    let effects = ReservationEffects::decode(&b[12 + len..])?;
    Some((version, state, effects))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_survives_its_encoding_and_damage_is_refused() {
        let state = Reservations::default();
        let effects = ReservationEffects::default();
        let b = encode_change(7, &state, &effects);
        assert_eq!(decode_change(&b), Some((7, state, effects)));
        assert_eq!(decode_change(&b[..10]), None);
        let mut long = b.clone();
        long[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_change(&long), None);
        assert_eq!(decode_change(&[]), None);
    }
}
