//! One logical unit (or NVMe namespace) through several target ports, as dm-multipath, MPIO
//! or Linux's native NVMe multipath use a target with implicit ALUA or ANA: a session (or
//! controller) per path; I/O goes to the path whose access state is optimized (else
//! non-optimized), as each path says of itself (REPORT TARGET PORT GROUPS, the ANA log page);
//! a command that fails because of its path (the connection lost, a timeout, NOT READY
//! because the port is not accessible or the unit is becoming ready, an ANA status) is sent
//! again on the path chosen next, until it succeeds or every path kept failing for
//! [`Multipath::give_up_after`]. An iSCSI path whose target asks its initiators to log out
//! (AsyncEvent 1, a gateway that is stopping) is left at once: new commands go to another
//! path while the ones in flight end on it, as dm-multipath does, rather than when the
//! gateway closes the connection seconds later.
//!
//! The paths must lead to one unit: [`Multipath::connect`] checks that every iSCSI path's
//! Device Identification (VPD 83h) names the same NAA identifier, and learns each path's
//! target port group from the same page; [`Multipath::connect_nvme`] that every path's
//! namespace has the same NGUID.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::login::LoginOptions;
use crate::nvme::{NvmeController, NvmeOptions, NvmeUrl};
use crate::scsi::{cdb, Command};
use crate::session::Session;
use crate::url::IscsiUrl;

/// Asymmetric access states as REPORT TARGET PORT GROUPS codes them.
const ACTIVE_OPTIMIZED: u8 = 0x0;
const ACTIVE_NON_OPTIMIZED: u8 = 0x1;

/// A path's access state, as it says of itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Active/optimized (ANA optimized).
    Optimized,
    /// Active/non-optimized (ANA non-optimized).
    NonOptimized,
    /// Standby, unavailable, inaccessible, transitioning, or unknown.
    Other,
}

/// What multipath needs of one path to a unit.
pub trait Path: Send + Sync + std::fmt::Debug + 'static {
    /// Where it leads, for the log.
    fn portal(&self) -> &str;
    /// Whether its target asked its initiators to leave it (a gateway stopping).
    fn leaving(&self) -> bool;
    /// Its access state, asked through it.
    fn access(&self) -> impl std::future::Future<Output = Result<Access>> + Send;
}

/// An iSCSI path: its session and the target port group of its port.
#[derive(Debug)]
pub struct IscsiPath {
    session: Arc<Session>,
    group: u16,
}

impl Path for IscsiPath {
    fn portal(&self) -> &str {
        &self.session.url().portal
    }

    fn leaving(&self) -> bool {
        self.session.logout_requested()
    }

    async fn access(&self) -> Result<Access> {
        let groups = port_groups(&self.session).await?;
        Ok(
            match groups
                .iter()
                .find(|(g, _, _)| *g == self.group)
                .map(|g| g.1)
            {
                Some(ACTIVE_OPTIMIZED) => Access::Optimized,
                Some(ACTIVE_NON_OPTIMIZED) => Access::NonOptimized,
                _ => Access::Other,
            },
        )
    }
}

impl Path for NvmeController {
    fn portal(&self) -> &str {
        &self.portal
    }

    fn leaving(&self) -> bool {
        false
    }

    async fn access(&self) -> Result<Access> {
        Ok(match self.ana_state().await? {
            Some(crate::nvme::ANA_OPTIMIZED) => Access::Optimized,
            Some(crate::nvme::ANA_NON_OPTIMIZED) => Access::NonOptimized,
            _ => Access::Other,
        })
    }
}

/// What a run reports of its multipath: the failovers.
pub trait Failovers: Send + Sync {
    /// Times I/O moved to another path after a failure.
    fn failovers(&self) -> u64;
    /// Of those, the moves because the path's target asked its initiators to log out.
    fn failovers_at_logout_request(&self) -> u64;
    /// The longest time from a path's first failure to the next success, if any path failed.
    fn longest_failover(&self) -> Option<Duration>;
}

impl<P: Path> Failovers for Multipath<P> {
    fn failovers(&self) -> u64 {
        Multipath::failovers(self)
    }

    fn failovers_at_logout_request(&self) -> u64 {
        Multipath::failovers_at_logout_request(self)
    }

    fn longest_failover(&self) -> Option<Duration> {
        Multipath::longest_failover(self)
    }
}

/// A unit through several paths.
#[derive(Debug)]
pub struct Multipath<P: Path = IscsiPath> {
    paths: Vec<Arc<P>>,
    current: AtomicUsize,
    /// A command is choosing the next path.
    choosing: std::sync::atomic::AtomicBool,
    /// Times I/O moved to another path after a failure.
    failovers: AtomicU64,
    /// Of those, the moves because the path's target asked to log out (a planned stop).
    planned: AtomicU64,
    /// When the path in use started failing, until a command succeeds again.
    failing_since: Mutex<Option<Instant>>,
    /// The longest time from a path's first failure to the next success on any path.
    longest: Mutex<Duration>,
    /// How long every path may keep failing before a command gives up.
    pub give_up_after: Duration,
}

impl Multipath<IscsiPath> {
    /// Logs in through every URL (each a path to one LU) and picks the optimized path.
    pub async fn connect(urls: &[IscsiUrl], opts: &LoginOptions) -> Result<Multipath> {
        if urls.is_empty() {
            return Err(Error::Command("multipath needs at least one URL".into()));
        }
        let mut paths = Vec::new();
        let mut naa: Option<Vec<u8>> = None;
        for url in urls {
            let session = Arc::new(Session::connect(url, opts.clone()).await?);
            let (id, group) = identify(&session).await?;
            match &naa {
                None => naa = Some(id),
                Some(first) if *first != id => {
                    return Err(Error::Command(format!(
                        "{} leads to another logical unit than {}",
                        url.portal, urls[0].portal
                    )))
                }
                Some(_) => {}
            }
            paths.push(IscsiPath { session, group });
        }
        Ok(Multipath::over(paths).await)
    }

    /// The session of the path in use.
    pub fn session(&self) -> &Arc<Session> {
        &self.paths[self.current.load(Ordering::Relaxed)].session
    }

    /// Every path's session.
    pub fn sessions(&self) -> impl Iterator<Item = &Arc<Session>> {
        self.paths.iter().map(|p| &p.session)
    }

    /// READ of `blocks` blocks at `lba`, split as [`Session::read_split`] does.
    pub async fn read_split(
        &self,
        lba: u64,
        blocks: u32,
        block_size: u32,
        max_blocks: u32,
    ) -> Result<Bytes> {
        self.on_a_path(|p| async move {
            p.session
                .read_split(lba, blocks, block_size, max_blocks)
                .await
        })
        .await
    }

    /// WRITE of `data` at `lba`, split as [`Session::write_split`] does.
    pub async fn write_split(
        &self,
        lba: u64,
        data: Bytes,
        block_size: u32,
        max_blocks: u32,
    ) -> Result<()> {
        self.on_a_path(|p| {
            let data = data.clone();
            async move {
                p.session
                    .write_split(lba, data, block_size, max_blocks)
                    .await
            }
        })
        .await
    }

    /// READ of `blocks` blocks at `lba`.
    pub async fn read(&self, lba: u64, blocks: u32, block_size: u32) -> Result<Bytes> {
        self.on_a_path(|p| async move { p.session.read(lba, blocks, block_size).await })
            .await
    }
}

impl Multipath<NvmeController> {
    /// Connects a controller through every URL (each a path to one namespace: the same
    /// NGUID) and picks the optimized path.
    pub async fn connect_nvme(
        urls: &[NvmeUrl],
        opts: &NvmeOptions,
    ) -> Result<Multipath<NvmeController>> {
        if urls.is_empty() {
            return Err(Error::Command("multipath needs at least one URL".into()));
        }
        let mut paths: Vec<NvmeController> = Vec::new();
        for url in urls {
            let c = NvmeController::connect(url, opts).await?;
            if let Some(first) = paths.first() {
                if first.namespace.nguid != c.namespace.nguid {
                    return Err(Error::Command(format!(
                        "{} leads to another namespace than {}",
                        url.portal, urls[0].portal
                    )));
                }
            }
            paths.push(c);
        }
        Ok(Multipath::over(paths).await)
    }

    /// The controller of the path in use.
    pub fn controller(&self) -> &Arc<NvmeController> {
        &self.paths[self.current.load(Ordering::Relaxed)]
    }

    /// Read of `blocks` blocks at `lba`, in commands of at most `max_blocks`.
    pub async fn read_split(&self, lba: u64, blocks: u32, max_blocks: u32) -> Result<Bytes> {
        self.on_a_path(|c| async move { Ok(c.read_split(lba, blocks, max_blocks).await?) })
            .await
    }

    /// Write of `data` at `lba`, in commands of at most `max_blocks`.
    pub async fn write_split(&self, lba: u64, data: Bytes, max_blocks: u32) -> Result<()> {
        self.on_a_path(|c| {
            let data = data.clone();
            async move { Ok(c.write_split(lba, data, max_blocks).await?) }
        })
        .await
    }
}

impl<P: Path> Multipath<P> {
    /// Multipath over `paths`, the optimized one chosen.
    async fn over(paths: Vec<P>) -> Multipath<P> {
        let m = Multipath {
            paths: paths.into_iter().map(Arc::new).collect(),
            current: AtomicUsize::new(0),
            choosing: std::sync::atomic::AtomicBool::new(false),
            failovers: AtomicU64::new(0),
            planned: AtomicU64::new(0),
            failing_since: Mutex::new(None),
            longest: Mutex::new(Duration::ZERO),
            give_up_after: Duration::from_secs(60),
        };
        m.choose(None).await;
        m
    }

    /// Every path.
    pub fn paths(&self) -> impl Iterator<Item = &Arc<P>> {
        self.paths.iter()
    }

    /// Times I/O moved to another path after a failure.
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// Of [`failovers`](Self::failovers), those because the path's target asked its
    /// initiators to log out (AsyncEvent 1: a gateway stopping), before it closed anything.
    pub fn failovers_at_logout_request(&self) -> u64 {
        self.planned.load(Ordering::Relaxed)
    }

    /// The longest time from a path's first failure to the next success, if any path failed.
    pub fn longest_failover(&self) -> Option<Duration> {
        let d = *self.longest.lock().unwrap_or_else(PoisonError::into_inner);
        (!d.is_zero()).then_some(d)
    }

    /// Chooses the path to use: asks every path but `failed` (the others first) its access
    /// state and takes a path that answered optimized, else non-optimized, else any that
    /// answered, else the one after `failed`. Returns its index.
    async fn choose(&self, failed: Option<usize>) -> usize {
        let n = self.paths.len();
        let start = failed.map_or(0, |f| f + 1);
        let order: Vec<usize> = (0..n)
            .map(|i| (start + i) % n)
            .filter(|&i| Some(i) != failed)
            .collect();
        let mut answered = Vec::new();
        for &i in &order {
            // A path whose target asked to log out is going away: not a candidate.
            if self.paths[i].leaving() {
                continue;
            }
            if let Ok(a) = self.paths[i].access().await {
                answered.push((i, a));
            }
        }
        let chosen = [Access::Optimized, Access::NonOptimized]
            .iter()
            .find_map(|want| answered.iter().find(|(_, a)| a == want).map(|(i, _)| *i))
            .or_else(|| answered.first().map(|(i, _)| *i))
            .or_else(|| order.first().copied())
            .unwrap_or(0);
        self.current.store(chosen, Ordering::Relaxed);
        chosen
    }

    /// Runs `op` on the path in use, moving to another path while the failures are the
    /// path's.
    async fn on_a_path<T, F, Fut>(&self, op: F) -> Result<T>
    where
        F: Fn(Arc<P>) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let started = Instant::now();
        loop {
            let i = self.current.load(Ordering::Relaxed);
            // The target of the path in use asked to log out: move now, as a multipath
            // initiator does, rather than when its connection closes.
            let result = if self.paths[i].leaving() {
                Err(Error::LogoutRequested)
            } else {
                op(self.paths[i].clone()).await
            };
            match result {
                Ok(v) => {
                    let since = self
                        .failing_since
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take();
                    if let Some(since) = since {
                        let mut longest =
                            self.longest.lock().unwrap_or_else(PoisonError::into_inner);
                        *longest = (*longest).max(since.elapsed());
                    }
                    return Ok(v);
                }
                Err(e) if is_path_failure(&e) => {
                    self.failing_since
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .get_or_insert_with(Instant::now);
                    if started.elapsed() > self.give_up_after {
                        return Err(e);
                    }
                    let portal = self.paths[i].portal();
                    if matches!(e, Error::LogoutRequested) {
                        tracing::info!(path = %portal, "leaving the path: {e}");
                    } else {
                        tracing::warn!(path = %portal, "path failed: {e}");
                    }
                    // Commands in flight on the path fail together: one of them chooses the
                    // next path, the others retry on it.
                    let planned = matches!(e, Error::LogoutRequested);
                    let chose = self.current.load(Ordering::Relaxed) == i
                        && !self.choosing.swap(true, Ordering::AcqRel);
                    if chose {
                        let next = self.choose(Some(i)).await;
                        self.choosing.store(false, Ordering::Release);
                        if next != i {
                            self.failovers.fetch_add(1, Ordering::Relaxed);
                            if planned {
                                self.planned.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    // The one that chose a path after a planned move goes on at once (the
                    // path it left still works); every other retry waits a little, also so
                    // that commands waiting for the choice do not spin (a planned failure
                    // comes without an await) and starve the command that makes it.
                    if !(chose && planned) {
                        let pause = if planned { 5 } else { 50 };
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Whether `e` is the path's fault (another path may succeed), not the command's.
fn is_path_failure(e: &Error) -> bool {
    const NOT_READY: u8 = 0x02;
    match e {
        Error::ConnectionLost(_)
        | Error::Timeout
        | Error::Connect { .. }
        | Error::Io(_)
        | Error::LogoutRequested => true,
        // LOGICAL UNIT NOT ACCESSIBLE (04/0A, 0B, 0C) or BECOMING READY (04/01).
        Error::Scsi { sense: Some(s), .. } => {
            s.key == NOT_READY && s.asc == 0x04 && matches!(s.ascq, 0x01 | 0x0a | 0x0b | 0x0c)
        }
        // The connection broke, an ANA status (inaccessible, persistent loss, change), or
        // the namespace not ready (the storage or the cluster did not answer).
        Error::Nvme(crate::nvme::NvmeError::Connection(_)) => true,
        Error::Nvme(crate::nvme::NvmeError::Status { status, .. }) => {
            status.sct == nvme::status::StatusCodeType::Path
                || *status == nvme::Status::NAMESPACE_NOT_READY
        }
        _ => false,
    }
}

/// The LU's NAA identifier and the port group of the path's target port, from VPD 83h.
async fn identify(s: &Session) -> Result<(Vec<u8>, u16)> {
    let r = s
        .execute_good(Command::read(s.lun(), cdb::inquiry_vpd(0x83, 512), 512))
        .await?;
    let d = &r.data;
    let (mut naa, mut group) = (None, None);
    let mut at = 4;
    while at + 4 <= d.len() {
        let len = d[at + 3] as usize;
        let Some(body) = d.get(at + 4..at + 4 + len) else {
            break;
        };
        let association = (d[at + 1] >> 4) & 0x3;
        match (d[at + 1] & 0x0f, association) {
            (0x03, 0) => naa = Some(body.to_vec()),
            (0x05, 1) if body.len() >= 4 => group = Some(u16::from_be_bytes([body[2], body[3]])),
            _ => {}
        }
        at += 4 + len;
    }
    match (naa, group) {
        (Some(n), Some(g)) => Ok((n, g)),
        (None, _) => Err(Error::Command("no NAA designator in VPD 83h".into())),
        // A target without port groups: one group.
        (Some(n), None) => Ok((n, 0)),
    }
}

/// REPORT TARGET PORT GROUPS through `s`: (group, asymmetric access state, PREF) of each
/// descriptor.
pub async fn port_groups(s: &Session) -> Result<Vec<(u16, u8, bool)>> {
    let mut c = [0u8; 16];
    c[0] = 0xa3;
    c[1] = 0x0a;
    c[6..10].copy_from_slice(&4096u32.to_be_bytes());
    let d = s.execute_good(Command::read(s.lun(), c, 4096)).await?.data;
    let mut out = Vec::new();
    let mut at = 4;
    while at + 8 <= d.len() {
        let count = d[at + 7] as usize;
        out.push((
            u16::from_be_bytes([d[at + 2], d[at + 3]]),
            d[at] & 0x0f,
            d[at] & 0x80 != 0,
        ));
        at += 8 + 4 * count;
    }
    Ok(out)
}
