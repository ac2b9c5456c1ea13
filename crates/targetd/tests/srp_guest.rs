//! targetd's SRP port on real verbs: a Linux guest under QEMU (scripts/rdma-guest.sh: Debian's
//! kernel, soft-RoCE on its virtio interface) runs this test binary again, whose guest side
//! serves SRP on the rxe device and logs in to it as Linux's ib_srp does by default (8260-byte
//! IUs with immediate data), over rdma_cm: verified reads and writes of several sizes, writes
//! as immediate data, 32-region commands, a second channel of the nexus (MULTI CHANNEL), a
//! channel lost without a logout, and a logout.
//!
//! Needs qemu-system-x86_64, Debian's archive for `apt-get download` (the kernel and
//! busybox-static), iproute2's `rdma` and the rxe provider (ibverbs-providers); without them it
//! says which is missing and skips, and fails under `CI`. The guest boots in about 5 s (TCG).
#![cfg(feature = "rdma")]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::{config, guest, memory_target, Daemon, TARGET};
use initiator_bench::srp::{
    login_request, place_len, run_channels, LinkModel, RdmaOptions, IMM_DATA_OFFSET,
};
use initiator_bench::workload::{Rw, Workload};
use rdma::ibverbs::{QpHandle, QueueDepth, RdmaVerbs};
use srp::initiator::channel::InitiatorChannel;
use srp::initiator::Registration;
use srp::iu::{Iu, MultiChannelAction, MultiChannelResult, SrpLoginReq, SrpLoginRsp};

/// Set in the guest: the test binary runs its guest side there.
const GUEST: &str = "TARGETD_SRP_GUEST";

/// Set in the guest for the side that logs in to Linux's SRP target (ib_srpt).
const SRPT: &str = "TARGETD_SRPT_GUEST";

/// ib_srpt's service GUID in the guest (its module parameter `srpt_service_guid`): an SRP
/// target port identifier of it twice.
const SRPT_SERVICE_GUID: u64 = 0x0002_c903_0000_0001;

#[test]
fn srp_over_soft_roce_in_a_linux_guest() {
    if std::env::var_os(GUEST).is_some() {
        return; // The guest runs only its side.
    }
    let me = std::env::current_exe().expect("this test's path");
    let id = targetd::srp::port_id(TARGET);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let guest_script = format!(
        "{GUEST}=1 /bin/{me_name} --exact guest_side --nocapture --test-threads 1 || exit 1\n\
         {LINUX_INITIATOR}\n{LINUX_TARGET}",
        me_name = me.file_name().unwrap().to_string_lossy(),
    )
    .replace("@ME@", &me.file_name().unwrap().to_string_lossy())
    .replace("@SRPT_GUID@", &format!("{SRPT_SERVICE_GUID:#018x}"))
    .replace("@TARGET@", TARGET)
    .replace("@ID_EXT@", &hex(&id[..8]))
    .replace("@IOC_GUID@", &hex(&id[8..]));
    let started = Instant::now();
    let exes = [
        me.display().to_string(),
        env!("CARGO_BIN_EXE_targetd").to_string(),
        env!("CARGO_BIN_EXE_targetctl").to_string(),
    ];
    let Some(run) = guest::run("srp-guest.sh", &guest_script, &exes, &[]) else {
        return;
    };
    let (console, errors) = (&run.console, &run.errors);
    println!("{console}");
    assert!(
        run.status.success(),
        "the guest failed ({:?}): {errors}\n{console}",
        run.status.code()
    );
    assert!(
        console.contains("guest side: all done"),
        "the guest side did not finish:\n{console}"
    );
    for line in [
        "ib_srpt: crates/srp's initiator logged in",
        "ib_srpt: all done",
        "ib_srp: logged in",
        "ib_srp: 8 MiB written in 4 KiB writes and read back",
        "ib_srp: 8 MiB written in 1 MiB writes and read back",
        "ib_srp: the resize came as an SRP_AER_REQ",
        "ib_srp: the disk is 128 MiB now",
        "guest side: initiator-bench's own SRP login accepted by a default port",
    ] {
        assert!(console.contains(line), "{line:?} missing:\n{console}");
    }
    let immediate: u64 = console
        .lines()
        .find_map(|l| l.strip_prefix("targetd_srp_immediate_writes_total "))
        .and_then(|n| n.trim().parse().ok())
        .expect("the daemon's immediate-data counter");
    assert!(
        immediate >= 2048,
        "ib_srp's 4 KiB writes come as immediate data: {immediate}"
    );
    println!(
        "booted, served and checked in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// The guest's second part: targetd (the daemon itself) on rxe0, and Linux's ib_srp with its
/// default settings logging in to it over rdma_cm; the disk it makes is written with 4 KiB
/// direct writes (immediate data), read back, written in 1 MiB and read back again; then
/// the unit is resized with targetctl: ib_srp hears of it at once by SRP_AER_REQ (which it
/// logs and answers), and the disk takes the new size.
const LINUX_INITIATOR: &str = r#"
cat > /tmp/targetd.toml <<CONFIG
[server]
portals = ["127.0.0.1:3260"]
admin_socket = "/tmp/targetd.sock"
reactors = 1
rdma_portals = ["$RDMA_ADDR:5556"]
metrics_listen = "127.0.0.1:9100"

[[targets]]
name = "@TARGET@"

[[targets.luns]]
lun = 0
backend = "memory"
size = "64MiB"
CONFIG
start_targetd /tmp/targetd.toml
echo "id_ext=@ID_EXT@,ioc_guid=@IOC_GUID@,dest=$RDMA_ADDR:5556" > /sys/class/infiniband_srp/srp-rxe0-1/add_target || fail "ib_srp: add_target refused"
find_disk ib_srp
check_disk ib_srp
/bin/targetctl -s /tmp/targetd.sock lun resize @TARGET@ 0 128MiB > /dev/null || fail "targetctl: resize"
for i in $(seq 1 50); do dmesg | grep -q "ignoring AER for LUN 0" && break; sleep 0.1; done
dmesg | grep -q "ignoring AER for LUN 0" && echo "ib_srp: the resize came as an SRP_AER_REQ" || fail "ib_srp: no AER"
echo 1 > /sys/block/${disk##*/}/device/rescan
dd if=$disk of=/dev/null bs=4096 count=1 iflag=direct 2>/dev/null || fail "ib_srp: a read after the resize failed"
[ "$(cat /sys/block/${disk##*/}/size)" = 262144 ] && echo "ib_srp: the disk is 128 MiB now" || fail "ib_srp: the disk is $(cat /sys/block/${disk##*/}/size) sectors"
wget -qO- http://127.0.0.1:9100/metrics | grep -E "^targetd_srp_(immediate_writes_total|channels) "
kill $daemon
"#;

/// The guest's third part: Linux's SRP target (ib_srpt on LIO, a file backstore, configured
/// through configfs, its rdma_cm port 5557) as a known-good peer for crates/srp's initiator.
const LINUX_TARGET: &str = r#"
insmod /lib/modules/extra/ib_srpt.ko srpt_service_guid=@SRPT_GUID@ || fail "ib_srpt: insmod"
mount -t configfs none /sys/kernel/config
T=/sys/kernel/config/target
mkdir -p $T/core/fileio_0/disk0
echo "fd_dev_name=/tmp/srpt.img,fd_dev_size=67108864" > $T/core/fileio_0/disk0/control
echo 1 > $T/core/fileio_0/disk0/enable || fail "ib_srpt: the backstore"
mkdir -p $T/srpt
echo 5557 > $T/srpt/discovery_auth/rdma_cm_port || fail "ib_srpt: rdma_cm_port"
port=$(cat /sys/class/infiniband/rxe0/node_guid)
tpg=$T/srpt/$port/$port
mkdir -p $tpg || fail "ib_srpt: no port $port"
mkdir $tpg/lun/lun_0
ln -s $T/core/fileio_0/disk0 $tpg/lun/lun_0/disk0 || fail "ib_srpt: the LUN"
# ib_srpt has no demo mode: the initiator gets an ACL, with the LUN mapped. Over rdma_cm it
# names an initiator by its IP address (its port identifier over IB CM).
mkdir -p $tpg/acls/$RDMA_ADDR/lun_0
ln -s $tpg/lun/lun_0 $tpg/acls/$RDMA_ADDR/lun_0/lun_0 || fail "ib_srpt: the ACL"
echo 1 > $tpg/enable || fail "ib_srpt: enable"
TARGETD_SRPT_GUEST=1 /bin/@ME@ --exact srpt_side --nocapture --test-threads 1 || fail "ib_srpt: crates/srp's initiator failed"
"#;

/// In the guest: crates/srp's initiator (initiator-bench's SRP runner) against Linux's SRP
/// target, ib_srpt: the login as ib_srp's, verified random reads and writes of 4 KiB (as
/// immediate data) and of 64 KiB in 16 regions, a logout.
#[test]
fn srpt_side() {
    if std::env::var_os(SRPT).is_none() {
        return; // Only in the guest, with ib_srpt set up.
    }
    let addr = guest::rdma_addr();
    let portal = SocketAddr::new(addr, 5557);
    let mut port_id = [0u8; 16];
    port_id[..8].copy_from_slice(&SRPT_SERVICE_GUID.to_be_bytes());
    port_id[8..].copy_from_slice(&SRPT_SERVICE_GUID.to_be_bytes());
    let mut verbs =
        RdmaVerbs::open(None, 4096, rdma::verbs::MESSAGE_BUFFER_LEN).expect("rxe0 opens");
    let mut o = RdmaOptions {
        registration: Registration::Pool,
        regions: 1,
        link: LinkModel::Free,
        immediate_data: true,
    };
    for (bs, regions, ios) in [(4096, 1, 400), (65536, 16, 200)] {
        let single = MultiChannelAction::SingleChannel;
        let (qp, rsp) = log_in_to(&mut verbs, portal, 0, single, port_id);
        println!(
            "ib_srpt: crates/srp's initiator logged in (limit {}, IU {} bytes, immediate data {})",
            rsp.req_lim_delta, rsp.max_it_iu_len, rsp.immediate_data
        );
        o.regions = regions;
        let w = verified(bs, ios);
        let mut ch =
            InitiatorChannel::new(&mut verbs, qp, &rsp, o.registration, 8, place_len(&w, &o))
                .expect("the channel's memory");
        o.immediate_data = ch.use_immediate_data(IMM_DATA_OFFSET);
        let mut channels = [ch];
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        assert_eq!(
            (r.ios, r.errors, r.verify_errors),
            (ios, 0, 0),
            "{bs} x {regions}"
        );
        println!(
            "ib_srpt: {ios} verified random I/Os of {bs} bytes in {regions} region(s), \
             {} blocks read back as written, immediate data {}",
            r.verified_blocks, o.immediate_data
        );
        channels[0].logout(&mut verbs).expect("logout sent");
    }
    println!("ib_srpt: all done");
}

/// Logs in to targetd's SRP port over rdma_cm as ib_srp does by default, as initiator port
/// `s`.
fn log_in(
    verbs: &mut RdmaVerbs,
    portal: SocketAddr,
    s: usize,
    action: MultiChannelAction,
) -> (QpHandle, SrpLoginRsp) {
    log_in_to(verbs, portal, s, action, targetd::srp::port_id(TARGET))
}

/// Logs in over rdma_cm as ib_srp does by default, as initiator port `s`, to the SRP target
/// port `port_id`.
fn log_in_to(
    verbs: &mut RdmaVerbs,
    portal: SocketAddr,
    s: usize,
    action: MultiChannelAction,
    port_id: [u8; 16],
) -> (QpHandle, SrpLoginRsp) {
    let mut req = login_request(s, port_id, 8260);
    req.multi_channel = action;
    log_in_with(verbs, portal, &req)
}

/// Sends the login request `req` over rdma_cm; the queue pair and the target's answer.
fn log_in_with(
    verbs: &mut RdmaVerbs,
    portal: SocketAddr,
    req: &SrpLoginReq,
) -> (QpHandle, SrpLoginRsp) {
    let mut private = Vec::new();
    req.encode_rdma_cm(&mut private);
    let depth = QueueDepth {
        send: 1024,
        recv: 256,
    };
    let (qp, reply) = verbs
        .connect(portal, depth, &private)
        .expect("logged in over rdma_cm");
    let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&reply) else {
        panic!("not an SRP_LOGIN_RSP: {reply:02x?}");
    };
    (qp, rsp)
}

/// `ios` verified random reads and writes of `bs` bytes over 16 MiB, 8 at a time.
fn verified(bs: u32, ios: u64) -> Workload {
    Workload {
        rw: Rw::Randrw,
        bs,
        qd: 8,
        sessions: 1,
        ios: Some(ios),
        size: Some(16 << 20),
        verify: true,
        ..Workload::default()
    }
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// In the guest: targetd on rxe0, and an initiator on the same device.
#[test]
fn guest_side() {
    if std::env::var_os(GUEST).is_none() {
        return; // Only in the guest.
    }
    let addr = guest::rdma_addr();
    let portal = SocketAddr::new(addr, 5555);
    let text = config("", &memory_target(TARGET, "")).replace(
        "reactors = 2",
        &format!("reactors = 2\nrdma_portals = [\"{portal}\"]"),
    );
    let d = Daemon::start(&text);
    let mut verbs =
        RdmaVerbs::open(None, 4096, rdma::verbs::MESSAGE_BUFFER_LEN).expect("rxe0 opens");

    // ib_srp's default login: accepted, with immediate data.
    let (qp, rsp) = log_in(&mut verbs, portal, 0, MultiChannelAction::SingleChannel);
    assert!(rsp.immediate_data, "immediate data granted");
    assert_eq!(rsp.max_it_iu_len, 8260);
    println!("guest side: logged in as ib_srp does, immediate data granted");

    let mut o = RdmaOptions {
        registration: Registration::Pool,
        regions: 1,
        link: LinkModel::Free,
        immediate_data: true,
    };
    // 4 KiB (immediate data), 64 KiB, and 128 KiB in 32 regions (an indirect table).
    let mut first = Some((qp, rsp));
    for (bs, regions, ios) in [(4096, 1, 400), (65536, 1, 200), (131072, 32, 100)] {
        o.regions = regions;
        let w = verified(bs, ios);
        let (qp, rsp) = first
            .take()
            .unwrap_or_else(|| log_in(&mut verbs, portal, 0, MultiChannelAction::SingleChannel));
        let mut ch =
            InitiatorChannel::new(&mut verbs, qp, &rsp, o.registration, 8, place_len(&w, &o))
                .expect("the channel's memory");
        assert!(ch.use_immediate_data(IMM_DATA_OFFSET));
        let before = d.registry.counters.srp_immediate_writes.load(Relaxed);
        let mut channels = [ch];
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        assert_eq!(
            (r.ios, r.errors, r.verify_errors),
            (ios, 0, 0),
            "{bs} x {regions}"
        );
        assert!(r.verified_blocks > 0, "reads were checked");
        let immediate = d.registry.counters.srp_immediate_writes.load(Relaxed) - before;
        assert_eq!(
            immediate > 0,
            bs <= 8192,
            "{bs}: {immediate} immediate writes"
        );
        println!(
            "guest side: {ios} verified random I/Os of {bs} bytes in {regions} region(s), \
             {immediate} writes as immediate data, {} blocks read back as written",
            r.verified_blocks
        );
        channels[0].logout(&mut verbs).expect("logout sent");
        eventually("the channel ends after its logout", || {
            d.registry.srp_channels().is_empty()
        });
    }
    println!("guest side: logouts end their channels");

    // initiator-bench's own login (`run --transport srp srp://...` sends what
    // login_request_for makes): accepted by the port at its defaults, and a run through it.
    o.regions = 1;
    let w = verified(65536, 100);
    let req = initiator_bench::srp::login_request_for(2, targetd::srp::port_id(TARGET), &o);
    let (qp, rsp) = log_in_with(&mut verbs, portal, &req);
    let ch = InitiatorChannel::new(&mut verbs, qp, &rsp, o.registration, 8, place_len(&w, &o))
        .expect("the channel's memory");
    let mut channels = [ch];
    let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
    assert_eq!((r.ios, r.errors, r.verify_errors), (100, 0, 0));
    channels[0].logout(&mut verbs).expect("logout sent");
    eventually("the channel ends after its logout", || {
        d.registry.srp_channels().is_empty()
    });
    println!(
        "guest side: initiator-bench's own SRP login accepted by a default port, 100 verified I/Os"
    );

    // A second channel of the same I_T nexus (MULTI CHANNEL), then both lost: the verbs of
    // the initiator go away without a logout.
    let (qp1, rsp1) = log_in(&mut verbs, portal, 1, MultiChannelAction::SingleChannel);
    let (qp2, rsp2) = log_in(&mut verbs, portal, 1, MultiChannelAction::MultiChannel);
    assert_eq!(rsp2.multi_channel, MultiChannelResult::Maintained);
    // The initiator holds the login response as soon as the target accepts; the target
    // lists the channel just after, so the count is awaited, not read once.
    eventually("two channels of one nexus", || {
        d.registry.srp_channels().len() == 2
    });
    let w = verified(4096, 100);
    for (qp, rsp) in [(qp1, rsp1), (qp2, rsp2)] {
        let ch = InitiatorChannel::new(&mut verbs, qp, &rsp, o.registration, 8, place_len(&w, &o))
            .expect("the channel's memory");
        let mut channels = [ch];
        o.regions = 1;
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        assert_eq!((r.errors, r.verify_errors), (0, 0));
    }
    println!("guest side: two channels of one nexus served");
    drop(verbs);
    eventually("lost channels end", || d.registry.srp_channels().is_empty());
    println!("guest side: channels lost without a logout end");
    d.stop();
    println!("guest side: all done");
}
