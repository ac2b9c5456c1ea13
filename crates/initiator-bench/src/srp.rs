//! Workloads over SRP: `initiator-bench run --transport srp fabric|URL`.
//!
//! The initiator is the crate's [`InitiatorChannel`]: its commands' buffers lie in an
//! [`srp::initiator::DataMemory`], registered per command, through a cache or as one pool
//! (paper 004's three ways), cut into `regions` discrete regions each. Over an RDMA device
//! (`run_rdma`, feature `rdma`) the target is whatever the URL names. On the software fabric
//! ([`run_fabric`]) it is a [`LoopbackTarget`] (the real SRP channel on scsi-core, with a
//! memory logical unit) in the same process and thread: the fabric charges its costs to a
//! virtual clock (with `--link paper004`, the paper's measured costs of registration and of
//! the wire), so throughput and latency are reported on that clock, deterministic whatever
//! this machine is doing; the wall-clock and CPU time this process spent are reported beside
//! them, as the software's own cost.
//!
//! The fabric serialises everything it charges (one link, no overlap), so on its clock queue
//! depth adds no parallelism: it shows what a command costs, as the paper's figures do.

use std::time::{Duration, Instant};

use serde::Serialize;

use rdma::fabric::{Counters, NodeId, PAPER_004_COSTS};
use rdma::switch::{Endpoint, Switch};
use rdma::verbs::{MessageBuffers, PeerMemory, Verbs};
use srp::initiator::channel::{Command, InitiatorChannel};
use srp::iu::{BufferFormats, MultiChannelAction, SrpLoginReq, TaskAttribute};
use srp::loopback::{LoopbackTarget, MemoryUnit};
use srp::target_port::PortSettings;

pub use crate::rdma::{
    place_len, print, run_channels, RdmaOptions, RdmaReport, BLOCK_SIZE, DEFAULT_SIZE,
};
use crate::rdma::{run, Answered, BlockChannel, Clock, Pace, Registrations, Request, STALL};
use crate::workload::Workload;

/// What the fabric charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LinkModel {
    /// Paper 004's measured costs ([`PAPER_004_COSTS`]: a 600 MB/s InfiniBand link,
    /// registrations at 7.68 us plus 0.109 ns per byte).
    Paper004,
    /// Nothing: only this machine's own time is reported.
    Free,
}

/// The target's node on the software fabric.
const FABRIC_TARGET: NodeId = NodeId(0);
/// The initiator's.
const FABRIC_INITIATOR: NodeId = NodeId(1);
/// The in-process target's port identifier.
const FABRIC_TARGET_PORT: [u8; 16] = *b"srp-target-port0";

/// Runs `w` over SRP on the software fabric against an in-process [`LoopbackTarget`] with one
/// memory logical unit of `w.offset + w.size` bytes (64 MiB of range by default), stepped in
/// this thread between the initiator's turns. Rates and latencies are on the fabric's clock
/// (none on a free link); the registrations of both sides are the fabric's counts.
pub fn run_fabric(w: &Workload, o: &RdmaOptions) -> Result<RdmaReport, String> {
    let blocks = crate::rdma::blocks(w)?;
    let switch = Switch::new();
    let settings = PortSettings {
        target_port_id: FABRIC_TARGET_PORT,
        ..PortSettings::default()
    };
    let unit = MemoryUnit {
        lun: 0,
        block_size: BLOCK_SIZE,
        blocks,
    };
    let mut target = LoopbackTarget::new(&switch, FABRIC_TARGET, "srp", settings, &[unit])
        .map_err(|e| e.to_string())?;
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(FABRIC_INITIATOR);
    let place = place_len(w, o);
    let mut channels = Vec::new();
    for s in 0..w.sessions.max(1) {
        let req = login_request_for(s, FABRIC_TARGET_PORT, o);
        let places = w.qd.max(1);
        let (ch, _) = target
            .login(&mut verbs, &req, o.registration, places, place)
            .map_err(|e| e.to_string())?;
        channels.push(ch);
    }
    if o.link == LinkModel::Paper004 {
        switch.with(|f| f.costs = PAPER_004_COSTS);
    }
    let mut pace = InProcess {
        target: &mut target,
        switch: &switch,
        at_start: (Duration::ZERO, Counters::default()),
    };
    run(&mut verbs, &mut channels, 0, w, o, &mut pace)
}

/// The initiator port identifier of session `s`.
fn initiator_port(s: usize) -> [u8; 16] {
    let mut port = *b"initiator-bench\0";
    port[15] = s as u8;
    port
}

/// An SRP target on an RDMA device as a URL names it: `srp://ADDR:PORT/TARGET/LUN`, where
/// TARGET is its target port identifier in 32 hex digits, or a targetd target's name (whose
/// identifier is derived from it, [`srp::target_port::port_id_for`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SrpUrl {
    /// The target's rdma_cm address.
    pub addr: std::net::SocketAddr,
    /// Its target port identifier.
    pub target_port_id: [u8; 16],
    /// The LUN.
    pub lun: u16,
}

impl SrpUrl {
    /// Parses `srp://ADDR:PORT/TARGET/LUN`.
    pub fn parse(url: &str) -> Result<SrpUrl, String> {
        let rest = url
            .strip_prefix("srp://")
            .ok_or_else(|| format!("{url:?} is not srp://ADDR:PORT/TARGET/LUN"))?;
        let mut parts = rest.splitn(3, '/');
        let (Some(addr), Some(target), Some(lun)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!("{url:?} is not srp://ADDR:PORT/TARGET/LUN"));
        };
        let addr = addr
            .parse()
            .map_err(|_| format!("{addr:?} in {url:?} is not an address:port"))?;
        let lun = lun
            .parse()
            .map_err(|_| format!("{lun:?} in {url:?} is not a LUN"))?;
        let hex = target.len() == 32 && target.bytes().all(|b| b.is_ascii_hexdigit());
        let target_port_id = if hex {
            let mut id = [0u8; 16];
            for (i, b) in id.iter_mut().enumerate() {
                *b = u8::from_str_radix(&target[2 * i..2 * i + 2], 16).expect("hex digits");
            }
            id
        } else {
            srp::target_port::port_id_for(target)
        };
        Ok(SrpUrl {
            addr,
            target_port_id,
            lun,
        })
    }
}

/// Where this initiator puts immediate data in an SRP_CMD, as Linux's ib_srp does: after the
/// 48-byte SRP_CMD, 16 bytes of additional CDB and the 4-byte immediate descriptor.
pub const IMM_DATA_OFFSET: u16 = 68;

/// The IUs this initiator asks to send without immediate data: an SRP_CMD with 16 bytes of
/// additional CDB and an indirect table of 32 descriptors.
pub const IT_IU_LEN: u32 = 48 + 20 + 32 * 16;

/// The login request of session `s` to `target_port_id` for options `o`: IUs as large as
/// Linux's ib_srp asks by default (8 KiB of immediate data after [`IMM_DATA_OFFSET`], 8260
/// bytes, which every target port taking Linux's default login takes: targetd's default
/// limit is 8276), or [`IT_IU_LEN`] and no immediate data with `--no-immediate-data`.
pub fn login_request_for(s: usize, target_port_id: [u8; 16], o: &RdmaOptions) -> SrpLoginReq {
    let mut req = login_request(s, target_port_id, IT_IU_LEN);
    if o.immediate_data {
        req.req_it_iu_len = u32::from(IMM_DATA_OFFSET) + 8192;
    } else {
        req.immediate_data = false;
    }
    req
}

/// The login request of session `s` to `target_port_id`, asking for IUs of `it_iu_len` bytes
/// and for immediate data at [`IMM_DATA_OFFSET`], as Linux's ib_srp does.
pub fn login_request(s: usize, target_port_id: [u8; 16], it_iu_len: u32) -> SrpLoginReq {
    SrpLoginReq {
        tag: s as u64,
        req_it_iu_len: it_iu_len,
        immediate_data: true,
        imm_data_offset: IMM_DATA_OFFSET,
        req_buf_fmt: BufferFormats::BOTH,
        multi_channel: MultiChannelAction::SingleChannel,
        initiator_port_id: initiator_port(s),
        target_port_id,
    }
}

/// A [`LoopbackTarget`] in this thread: each turn steps it; the fabric's clock and counters.
struct InProcess<'a> {
    target: &'a mut LoopbackTarget,
    switch: &'a std::sync::Arc<Switch>,
    /// The fabric's clock and counters when the measured part started.
    at_start: (Duration, Counters),
}

impl Pace for InProcess<'_> {
    fn now(&mut self) -> Duration {
        self.switch.with(|f| f.elapsed)
    }

    fn turn(&mut self, moved: bool) -> Result<(), String> {
        if self.target.step(Instant::now()) || moved {
            Ok(())
        } else {
            Err("the in-process target has nothing left to do, yet commands wait".into())
        }
    }

    fn start(&mut self) {
        self.at_start = self.switch.with(|f| (f.elapsed, f.counters));
    }

    fn end(&mut self, _elapsed: f64, _ios: u64, _o: &RdmaOptions) -> (Clock, Registrations) {
        let (clock, before) = self.at_start;
        let (now, after) = self.switch.with(|f| (f.elapsed, f.counters));
        let fabric = (now - clock).as_secs_f64();
        let registrations = Registrations {
            initiator: (after.registrations[1] - before.registrations[1]) as f64,
            target: after.registrations[0] - before.registrations[0],
        };
        let clock = if fabric > 0.0 {
            Clock::Fabric(fabric)
        } else {
            Clock::Free
        };
        (clock, registrations)
    }
}

/// SRP's channel in the runner: the runner's tags, the credit the target grants, immediate data
/// when the login granted it, the channel's own command timeout.
impl<V> BlockChannel<V> for InitiatorChannel<V>
where
    V: Verbs + PeerMemory + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    const TRANSPORT: &'static str = "SRP";

    fn prepare(&mut self, o: &RdmaOptions) -> Result<(), String> {
        if o.immediate_data {
            self.use_immediate_data(IMM_DATA_OFFSET);
        }
        // A command unanswered this long ends its channel (the channel's own timer).
        self.set_timeout(Some(STALL));
        Ok(())
    }

    fn room(&self) -> bool {
        self.credit() > 0
    }

    fn send(&mut self, now: Instant, verbs: &mut V, r: &Request<'_>) -> Result<u64, String> {
        let cmd = Command {
            tag: r.tag,
            lun: u64::from(r.lun) << 48,
            cdb: r.cdb,
            data_out: r.data_out,
            data_in: r.data_in,
            regions: r.regions,
            partial: false,
            attribute: TaskAttribute::Simple,
        };
        InitiatorChannel::send(self, now, verbs, &cmd).map_err(|e| e.to_string())?;
        Ok(r.tag)
    }

    fn poll(&mut self, verbs: &mut V) -> Option<Answered> {
        let a = InitiatorChannel::poll(self, verbs)?;
        Some(Answered {
            tag: a.tag,
            status: a.status,
            data: a.data,
        })
    }

    fn check(&mut self, now: Instant, verbs: &mut V) -> Result<(), String> {
        let lost = self.handle_timeout(now, verbs);
        if !lost.is_empty() {
            return Err(format!("no answer from the target for {STALL:?}"));
        }
        if self.is_gone(verbs) {
            return Err(format!("the channel ended ({:?})", self.logged_out()));
        }
        Ok(())
    }
}

/// Runs `w` against the SRP target `url` on this machine's RDMA device (feature `rdma`).
#[cfg(feature = "rdma")]
pub fn run_rdma(url: &SrpUrl, w: &Workload, o: &RdmaOptions) -> Result<RdmaReport, String> {
    use rdma::ibverbs::{QueueDepth, RdmaVerbs};
    let sessions = w.sessions.max(1);
    let slots = (sessions * (w.qd.max(1) + 2 * 140)) as u32;
    let mut verbs: RdmaVerbs =
        RdmaVerbs::open(None, slots, rdma::verbs::MESSAGE_BUFFER_LEN).map_err(|e| e.to_string())?;
    let place = place_len(w, o);
    let mut channels = Vec::new();
    for s in 0..sessions {
        let mut private = Vec::new();
        // Not the largest IU the buffers could hold: a port refuses a login asking more than
        // it takes (targetd's default port took 8276 bytes, and refused 9288).
        login_request_for(s, url.target_port_id, o).encode_rdma_cm(&mut private);
        let depth = QueueDepth {
            send: 4096,
            recv: 256,
        };
        let (qp, reply) = verbs
            .connect(url.addr, depth, &private)
            .map_err(|e| format!("login to {}: {e}", url.addr))?;
        let rsp = match srp::Iu::decode(&reply) {
            Ok(srp::Iu::LoginRsp(r)) => r,
            other => return Err(format!("login answered with {other:?}")),
        };
        let places = w.qd.max(1).min(rsp.req_lim_delta as usize);
        let ch = InitiatorChannel::new(&mut verbs, qp, &rsp, o.registration, places, place)
            .map_err(|e| e.to_string())?;
        channels.push(ch);
    }
    run_channels(&mut verbs, &mut channels, url.lun, w, o)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The login asks for no larger IUs than a target port at its defaults takes: Linux's
    /// ib_srp's default login, within targetd's default limit.
    #[test]
    fn the_login_asks_what_a_default_port_takes() {
        let o = RdmaOptions {
            registration: srp::initiator::Registration::Pool,
            regions: 1,
            link: LinkModel::Free,
            immediate_data: true,
        };
        let req = login_request_for(0, [0; 16], &o);
        assert!(req.immediate_data);
        assert_eq!(req.req_it_iu_len, 8260);
        assert!(req.req_it_iu_len <= srp::target_port::DEFAULT_MAX_IT_IU_LEN);
        let without = RdmaOptions {
            immediate_data: false,
            ..o
        };
        let req = login_request_for(0, [0; 16], &without);
        assert!(!req.immediate_data);
        assert_eq!(req.req_it_iu_len, IT_IU_LEN);
    }

    #[test]
    fn srp_urls_name_the_target_by_identifier_or_by_name() {
        let u = SrpUrl::parse("srp://192.0.2.7:5555/0011223344556677a8b9cadbecfd0e1f/3")
            .expect("parses");
        assert_eq!(u.addr, "192.0.2.7:5555".parse().expect("address"));
        assert_eq!(u.target_port_id[0], 0x00);
        assert_eq!(u.target_port_id[15], 0x1f);
        assert_eq!(u.lun, 3);
        let named =
            SrpUrl::parse("srp://[::1]:5555/iqn.2026-11.io.example:disk1/0").expect("parses");
        assert_eq!(
            named.target_port_id,
            srp::target_port::port_id_for("iqn.2026-11.io.example:disk1")
        );
        for bad in [
            "iscsi://h/t/0",
            "srp://nowhere/t/0",
            "srp://192.0.2.7:5555/t",
            "srp://192.0.2.7:5555/t/lun",
        ] {
            assert!(SrpUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
