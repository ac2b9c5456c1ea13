//! `targetctl upgrade` under Linux's own iSCSI initiator and NVMe/TCP host: a Linux guest
//! under QEMU (scripts/rdma-guest.sh: Debian's kernel with iscsi_tcp and nvme_tcp, busybox,
//! open-iscsi, nvme-cli and fio copied in with their libraries) runs targetd on its loopback
//! with a file LUN and a subsystem with a file namespace, logs in with open-iscsi's iscsid
//! and iscsiadm and connects with `nvme connect` (default settings both), and runs fio's
//! verified random writes on both disks at once while targetd upgrades to its own binary
//! twice. Checked: fio's writes all read back on both (`--verify_fatal`), no I/O error, no
//! connection error, session recovery, controller reset or reconnect in the guest's kernel
//! log, the same TSIH and the same controller (CNTLID) before and after, the successors'
//! metrics count no login (the session came over, it did not log in again), and the old
//! processes are gone. The longest write fio saw on each (its completion latency's max, of
//! the writes made across the upgrades) is printed beside the pause each upgrade reported.
//!
//! Needs what scripts/rdma-guest.sh needs (qemu-system-x86_64, Debian's archive for the
//! kernel, iproute2's `rdma`, the rxe provider), open-iscsi, nvme-cli and fio; without them
//! it says which is missing and skips, and fails under `CI`.

mod common;

use std::time::Instant;

use common::{guest, TARGET};

const GUEST_SCRIPT: &str = r#"
cat > /tmp/targetd.toml <<CONFIG
[server]
portals = ["127.0.0.1:3260"]
admin_socket = "/tmp/targetd.sock"
metrics_listen = "127.0.0.1:9100"
reactors = 1
log = "info"

nvme_portals = ["127.0.0.1:4420"]

[[targets]]
name = "@TARGET@"

[[targets.luns]]
lun = 0
backend = "file"
path = "/tmp/disk.img"
size = "64MiB"

[[subsystems]]
nqn = "@NQN@"

[[subsystems.namespaces]]
nsid = 1
backend = "file"
path = "/tmp/ns.img"
size = "64MiB"
CONFIG
start_targetd /tmp/targetd.toml
first=$daemon
# open-iscsi's defaults (NOP-Outs every 5 s, replacement_timeout 120 s), but no automatic login.
start_iscsid iqn.2026-12.io.example:linux-upgrade
/bin/iscsiadm -m discovery -t st -p 127.0.0.1:3260 > /dev/null || fail "linux: discovery failed"
/bin/iscsiadm -m node -T @TARGET@ -p 127.0.0.1:3260 --login > /dev/null || fail "linux: login failed"
find_disk "linux"
# Linux's NVMe/TCP host with its defaults (keep alive 5 s, reconnect after 10 s).
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n @NQN@ --hostnqn=@HOST@ > /dev/null || fail "nvme connect failed"
wait_ns 1
echo "nvme: connected, $ns"
cntlid() { cat /sys/class/nvme/nvme*/cntlid 2>/dev/null | head -n 1; }
cntlid_before=$(cntlid)
tsih() { /bin/targetctl --socket /tmp/targetd.sock --json sessions | grep -o '"tsih": *[0-9]*' | grep -o '[0-9]*$'; }
before=$(tsih)
echo "linux: session $before"
seen=$(dmesg | wc -l)
fio --name=upgrade --filename=$disk --rw=randwrite --bs=4k --iodepth=16 --ioengine=libaio \
  --direct=1 --size=48m --verify=crc32c --do_verify=1 --verify_fatal=1 --thread \
  --output=/tmp/fio.txt > /dev/null 2>&1 &
fio=$!
fio --name=upgrade-nvme --filename=$ns --rw=randwrite --bs=4k --iodepth=16 --ioengine=libaio \
  --direct=1 --size=48m --verify=crc32c --do_verify=1 --verify_fatal=1 --thread \
  --output=/tmp/fio-nvme.txt > /dev/null 2>&1 &
fio_nvme=$!
for round in 1 2; do
  sleep 3
  /bin/targetctl --socket /tmp/targetd.sock upgrade > /tmp/upgrade.txt 2>&1 || { cat /tmp/upgrade.txt; fail "upgrade $round failed"; }
  echo "upgrade $round: $(cat /tmp/upgrade.txt)"
done
wait $fio
status=$?
grep -q "err= 0" /tmp/fio.txt && [ "$status" = 0 ] || { cat /tmp/fio.txt; fail "fio failed across the upgrades"; }
echo "fio: verified 48 MiB of random 4 KiB writes across two upgrades"
# Each direction's line (its IOPS) and its completion latencies (the writes; the reads are
# fio's verification after them).
grep -E "^ *(read|write): |^ *clat .*max=" /tmp/fio.txt | awk '{$1=$1; print "fio: " $0}'
wait $fio_nvme
status=$?
grep -q "err= 0" /tmp/fio-nvme.txt && [ "$status" = 0 ] || { cat /tmp/fio-nvme.txt; fail "fio on NVMe/TCP failed across the upgrades"; }
echo "fio: verified 48 MiB of random 4 KiB writes on NVMe/TCP across two upgrades"
grep -E "^ *(read|write): |^ *clat .*max=" /tmp/fio-nvme.txt | awk '{$1=$1; print "fio nvme: " $0}'
[ -n "$cntlid_before" ] && [ "$cntlid_before" = "$(cntlid)" ] && echo "nvme: the same controller after the upgrades ($cntlid_before)"
after=$(tsih)
[ -n "$before" ] && [ "$before" = "$after" ] && echo "linux: the same session after the upgrades ($after)"
new=$(dmesg | awk "NR > $seen")
echo "$new" | grep -iE "conn error|connection[0-9:]* error|recovery|I/O error|blk_update_request|timed out|offline|reconnect|reset|failed" \
  && fail "the kernel saw trouble across the upgrades" \
  || echo "linux: no connection error, recovery or I/O error in the kernel log"
wget -qO /tmp/metrics http://127.0.0.1:9100/metrics
grep 'targetd_logins_total{transport="tcp",status="success"}' /tmp/metrics
grep -q 'targetd_logins_total{transport="tcp",status="success"} 0' /tmp/metrics \
  && echo "targetd: no login in the process serving now"
kill -0 $first 2>/dev/null && fail "the first targetd still runs" || echo "targetd: the first process exited"
/bin/iscsiadm -m node -T @TARGET@ -p 127.0.0.1:3260 --logout > /dev/null && echo "linux: logged out"
nvme disconnect -n @NQN@ > /dev/null && echo "nvme: disconnected"
serving=$(/bin/targetctl --socket /tmp/targetd.sock --json status | grep -o '"pid": *[0-9]*' | grep -o '[0-9]*$')
kill $serving
sleep 1
grep -E "upgrade|adopted|handed over|WARN|ERROR" /tmp/targetd.log | tail -n 20
"#;

#[test]
fn open_iscsi_and_linux_nvme_tcp_with_fio_go_on_across_two_upgrades_in_a_linux_guest() {
    let Some(mut exes) = guest::tools(
        &["iscsid", "iscsiadm", "nvme", "fio"],
        "open-iscsi, nvme-cli or fio is missing (Debian packages open-iscsi, nvme-cli, fio)",
    ) else {
        return;
    };
    exes.insert(0, env!("CARGO_BIN_EXE_targetd").to_string());
    exes.insert(1, env!("CARGO_BIN_EXE_targetctl").to_string());
    let script = GUEST_SCRIPT
        .replace("@TARGET@", TARGET)
        .replace("@NQN@", "nqn.2026-12.io.example:upgrade")
        .replace(
            "@HOST@",
            "nqn.2014-08.org.nvmexpress:uuid:4c696e75-7800-4000-8000-7570677264",
        );
    let started = Instant::now();
    let Some(console) = guest::run_checked(
        "upgrade-guest",
        &script,
        &exes,
        &[],
        &[
            "linux: logged in",
            "upgrade 1: upgraded:",
            "upgrade 2: upgraded:",
            "fio: verified 48 MiB of random 4 KiB writes across two upgrades",
            "linux: the same session after the upgrades",
            "nvme: connected",
            "fio: verified 48 MiB of random 4 KiB writes on NVMe/TCP across two upgrades",
            "nvme: the same controller after the upgrades",
            "nvme: disconnected",
            "linux: no connection error, recovery or I/O error in the kernel log",
            "targetd: no login in the process serving now",
            "targetd: the first process exited",
            "linux: logged out",
        ],
    ) else {
        return;
    };
    for line in console
        .lines()
        .filter(|l| l.starts_with("upgrade ") || l.starts_with("fio"))
    {
        println!("{line}");
    }
    println!(
        "open-iscsi and nvme-tcp with fio across two upgrades in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
