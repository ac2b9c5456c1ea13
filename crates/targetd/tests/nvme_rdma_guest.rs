//! targetd's NVMe/RDMA portal on real verbs with Linux's own NVMe/RDMA host: a Linux guest
//! under QEMU (scripts/rdma-guest.sh: Debian's kernel, soft-RoCE on its virtio interface,
//! nvme_rdma loaded, nvme-cli and fio copied in with their libraries) runs targetd with
//! `nvme_rdma_portals` on the rxe device's address, then `nvme connect -t rdma` with default
//! host options after `nvme discover -t rdma` at the same portal (an admin queue and an I/O
//! queue per CPU, Connect's data and every command's
//! data by keyed SGL, small writes in the capsule): `nvme list`, `id-ctrl`, `id-ns`; 8 MiB
//! written and read back in 4 KiB and 1 MiB direct I/O; fio's verified random writes of
//! 4 KiB and 128 KiB at queue depth 16; Flush and Write Zeroes; `nvme disconnect`. Then
//! targetd is killed with SIGKILL while the host is connected and started again: the host
//! reconnects by itself and reads back what it wrote before.
//!
//! Needs what scripts/rdma-guest.sh needs (qemu-system-x86_64, Debian's archive for the
//! kernel, iproute2's `rdma`, the rxe provider), nvme-cli and fio; without them it says
//! which is missing and skips, and fails under `CI`.
#![cfg(feature = "rdma")]

mod common;

use std::time::Instant;

use common::guest;

/// Set in the guest: the test binary runs initiator-bench's NVMe/RDMA host there.
const GUEST: &str = "TARGETD_NVME_RDMA_GUEST";

const NQN: &str = "nqn.2026-11.io.example:rdma-guest";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:4c696e75-7800-4000-8000-6e766d652d72";

const GUEST_SCRIPT: &str = r#"
NQN=@NQN@
HOST=@HOST@
cat > /tmp/targetd.toml <<EOF
[server]
portals = ["127.0.0.1:3260"]
nvme_rdma_portals = ["$RDMA_ADDR:4420"]
admin_socket = "/tmp/targetd.sock"
metrics_listen = "127.0.0.1:9100"
reactors = 1
log = "@LOG@"

[[subsystems]]
nqn = "$NQN"
hosts = ["$HOST"]

[[subsystems.namespaces]]
nsid = 1
backend = "file"
path = "/tmp/ns1.img"
size = "128MiB"
EOF
start_targetd /tmp/targetd.toml

# zeros FILE: whether FILE holds only zeros.
zeros() {
  [ -z "$(od -An -v -tx1 "$1" | tr -d ' 0\n')" ]
}

# fio_job NAME BS DEV: verified random writes at queue depth 16; prints the write IOPS.
fio_job() {
  fio --name="$1" --filename="$3" --rw=randwrite --bs="$2" --iodepth=16 --ioengine=libaio \
    --direct=1 --size=16m --verify=crc32c --do_verify=1 --verify_fatal=1 --thread \
    --output=/tmp/fio.txt > /dev/null 2>&1
  status=$?
  grep -q "err= 0" /tmp/fio.txt && [ "$status" = 0 ] || { cat /tmp/fio.txt; tail -n 40 /tmp/targetd.log; fail "$1: fio failed"; }
  iops=$(grep -o "IOPS=[0-9.k]*" /tmp/fio.txt | head -1)
  echo "$1: fio verified $2 random writes ($iops)"
}

# Discovery over RDMA at the I/O portal: the subsystem, reached over RDMA by rdma_cm.
nvme discover -t rdma -a $RDMA_ADDR -s 4420 --hostnqn="$HOST" > /tmp/disc.txt \
  || { cat /tmp/disc.txt; tail -n 40 /tmp/targetd.log; fail "nvme discover -t rdma failed"; }
cat /tmp/disc.txt
grep -q "subnqn: *$NQN" /tmp/disc.txt && grep -q "trtype: *rdma" /tmp/disc.txt \
  && grep -q "rdma_cms: *rdma-cm" /tmp/disc.txt && echo "nvme-rdma discover: names the subsystem over rdma"
nvme connect -t rdma -a $RDMA_ADDR -s 4420 -n "$NQN" --hostnqn="$HOST" --reconnect-delay=1 \
  --ctrl-loss-tmo=60 || { tail -n 40 /tmp/targetd.log; dmesg | tail -n 20; fail "nvme connect -t rdma failed"; }
wait_ns 1
echo "nvme-rdma: connected, $ns"
ctrl=/dev/${ns#/dev/}; ctrl=${ctrl%n1}
nvme list | grep -q "${ns#/dev/}" && echo "nvme-rdma: listed"
cat /sys/class/nvme/${ctrl#/dev/}/transport | grep -q rdma && echo "nvme-rdma: the host's transport is rdma"
nvme id-ctrl "$ctrl" | grep -q "subnqn *: $NQN" && echo "nvme-rdma: id-ctrl names the subsystem"
nvme id-ns "$ns" | grep -q "nsze *: 0x40000" && echo "nvme-rdma: id-ns says 128 MiB"
disk=$ns
check_disk "nvme-rdma"
fio_job "nvme-rdma 4k" 4k "$ns"
fio_job "nvme-rdma 128k" 128k "$ns"
nvme flush "$ns" > /dev/null && echo "nvme-rdma: flush"
dd if=/dev/urandom of="$ns" bs=4096 count=4 oflag=direct 2>/dev/null
nvme write-zeroes "$ns" -s 0 -c 15 > /dev/null || fail "write-zeroes failed"
dd if="$ns" of=/tmp/z bs=4096 count=2 iflag=direct 2>/dev/null
zeros /tmp/z && echo "nvme-rdma: write-zeroes read back as zeros"

# targetd killed while the host is connected, and started again: the host reconnects by
# itself, and what it wrote (and flushed) before is there.
dd if=/dev/urandom of=/tmp/a bs=1048576 count=4 2>/dev/null
dd if=/tmp/a of="$ns" bs=1048576 oflag=direct conv=fsync 2>/dev/null || fail "writes before the kill failed"
kill -9 $daemon
sleep 2
start_targetd /tmp/targetd.toml
back=
for i in $(seq 1 60); do
  if dd if="$ns" of=/tmp/b bs=1048576 count=4 iflag=direct 2>/dev/null && cmp -s /tmp/a /tmp/b; then
    back=1
    break
  fi
  sleep 1
done
[ -n "$back" ] && echo "nvme-rdma restart: the host reconnected and read back what it wrote before" \
  || { dmesg | tail -n 30; tail -n 40 /tmp/targetd.log; fail "no reconnection after the restart"; }
nvme disconnect -n "$NQN" | grep -q "disconnected 1" && echo "nvme-rdma: disconnected"
# initiator-bench's NVMe/RDMA host: this test binary's guest side.
TARGETD_NVME_RDMA_GUEST=1 /bin/@ME@ --exact initiator_bench_over_nvme_rdma_in_the_guest --nocapture --test-threads 1 \
  || { tail -n 40 /tmp/targetd.log; fail "initiator-bench nvme-rdma: the run failed"; }
kill $daemon
sleep 1
tail -n ${LOG_LINES:-20} /tmp/targetd.log
dmesg | grep -i nvme | tail -n 20
echo "nvme-rdma guest: done"
"#;

#[test]
fn linux_nvme_rdma_host_over_soft_roce_in_a_guest() {
    if std::env::var_os(GUEST).is_some() {
        return; // The guest runs only its side.
    }
    let me = std::env::current_exe().expect("this test's path");
    let Some(mut exes) = guest::tools(
        &["nvme", "fio"],
        "nvme-cli or fio is missing (Debian packages nvme-cli, fio)",
    ) else {
        return;
    };
    exes.insert(0, env!("CARGO_BIN_EXE_targetd").to_string());
    exes.push(me.display().to_string());
    let text = GUEST_SCRIPT
        .replace("@ME@", &me.file_name().unwrap().to_string_lossy())
        .replace("@NQN@", NQN)
        .replace("@HOST@", HOST)
        .replace(
            "@LOG@",
            &std::env::var("TARGETD_NVME_RDMA_LOG").unwrap_or_else(|_| "info".into()),
        );
    let started = Instant::now();
    let timeout = std::env::var("RDMA_GUEST_TIMEOUT").unwrap_or_else(|_| "1200".into());
    let lines = [
        "nvme-rdma discover: names the subsystem over rdma",
        "nvme-rdma: connected",
        "nvme-rdma: listed",
        "nvme-rdma: the host's transport is rdma",
        "nvme-rdma: id-ctrl names the subsystem",
        "nvme-rdma: id-ns says 128 MiB",
        "nvme-rdma: 8 MiB written in 4 KiB writes and read back",
        "nvme-rdma: 8 MiB written in 1 MiB writes and read back",
        "nvme-rdma 4k: fio verified 4k random writes",
        "nvme-rdma 128k: fio verified 128k random writes",
        "nvme-rdma: flush",
        "nvme-rdma: write-zeroes read back as zeros",
        "nvme-rdma restart: the host reconnected and read back what it wrote before",
        "nvme-rdma: disconnected",
        "initiator-bench nvme-rdma: 4096-byte I/Os verified",
        "initiator-bench nvme-rdma: 65536-byte I/Os verified",
        "initiator-bench nvme-rdma: 1048576-byte I/Os verified",
        "nvme-rdma guest: done",
    ];
    let Some(console) = guest::run_checked(
        "nvme-rdma-guest",
        &text,
        &exes,
        &[("RDMA_GUEST_TIMEOUT", timeout)],
        &lines,
    ) else {
        return;
    };
    for line in console
        .lines()
        .filter(|l| l.contains("fio verified") || l.starts_with("initiator-bench"))
    {
        println!("{line}");
    }
    println!(
        "Linux's NVMe/RDMA host served over soft-RoCE in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}

/// In the guest (`TARGETD_NVME_RDMA_GUEST`): initiator-bench's NVMe/RDMA host against the
/// targetd the script started, over rxe0, as `run --transport nvme-rdma` runs it: verified
/// random reads and writes of 4 KiB, 64 KiB and 1 MiB, under each way of registering, every
/// block written read back.
#[test]
fn initiator_bench_over_nvme_rdma_in_the_guest() {
    use initiator_bench::nvme::{NvmeOptions, NvmeUrl};
    use initiator_bench::nvme_rdma::run_rdma;
    use initiator_bench::rdma::RdmaOptions;
    use initiator_bench::srp::LinkModel;
    use initiator_bench::workload::{Rw, Workload};
    use srp::initiator::Registration;
    if std::env::var_os(GUEST).is_none() {
        return; // Only in the guest.
    }
    let addr = guest::rdma_addr();
    let url = NvmeUrl::parse(&format!("nvme://{addr}:4420/{NQN}/1")).expect("the URL");
    let host = NvmeOptions {
        hostnqn: HOST.into(),
        ..NvmeOptions::default()
    };
    for (bs, ios, registration) in [
        (4096, 400, Registration::Pool),
        (65536, 200, Registration::Cache),
        (1 << 20, 40, Registration::PerCommand),
    ] {
        let w = Workload {
            rw: Rw::Randrw,
            bs,
            qd: 8,
            ios: Some(ios),
            size: Some(16 << 20),
            verify: true,
            ..Workload::default()
        };
        let o = RdmaOptions {
            registration,
            regions: 1,
            link: LinkModel::Free,
            immediate_data: false,
        };
        let r = run_rdma(&url, &host, &w, &o).expect("the run");
        assert_eq!((r.ios, r.errors, r.verify_errors), (ios, 0, 0), "{bs}");
        assert!(r.verified_blocks > 0, "reads were checked");
        println!(
            "initiator-bench nvme-rdma: {bs}-byte I/Os verified ({ios} random, {} blocks read \
             back, {:.0} IOPS, registration {})",
            r.verified_blocks,
            r.iops,
            registration.name()
        );
    }
}
