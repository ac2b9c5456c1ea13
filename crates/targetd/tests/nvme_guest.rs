//! targetd's NVMe/TCP portal with Linux's own NVMe/TCP host: a Linux guest under QEMU
//! (scripts/rdma-guest.sh: Debian's kernel with nvme_tcp, busybox, nvme-cli and fio copied in
//! with their libraries) runs targetd on its loopback and connects to it with `nvme connect`
//! and default host options, then with header and data digests (after `nvme discover` at the
//! discovery portal and at the I/O portal): `nvme list`, `id-ctrl`,
//! `id-ns`, `smart-log`, `ana-log`, `get-feature`; fio's verified random writes of 4 KiB and
//! 128 KiB at queue depth 16; Flush, Write Zeroes and Dataset Management (and blkdiscard)
//! with zeros read back; `nvme disconnect`. A namespace added with `targetctl namespace add`
//! while the host is connected appears to it (the host rescans on the Namespace Attribute
//! Changed notice), grown with `targetctl namespace resize` shows its new size with its data
//! kept, and removed (`targetctl namespace remove --force`) goes away.
//! Reservations through nvme-cli's resv-* commands: register, replace, unregister, acquire,
//! preempt, release and clear, each checked in resv-report; two hosts (two host NQNs and
//! Host Identifiers) on one namespace, the second's writes refused with Reservation Conflict
//! while the first holds Write Exclusive. Then targetd is stopped with
//! SIGTERM while the host is connected (holding a reservation made with PTPL) and started
//! again: the host reconnects, what it wrote before is there, and so is the reservation.
//!
//! The same guest runs Linux's own NVMe/TCP target (nvmet_tcp) on a RAM-backed namespace
//! with the same fio job, and the test prints both figures side by side: the CPU is emulated
//! (TCG), so they compare the two targets with each other, not with hardware.
//!
//! Needs what scripts/rdma-guest.sh needs (qemu-system-x86_64, Debian's archive for the
//! kernel, iproute2's `rdma`, the rxe provider), nvme-cli and fio; without them it says
//! which is missing and skips, and fails under `CI`.

mod common;

use std::time::Instant;

use common::guest;

const NQN: &str = "nqn.2026-11.io.example:guest";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:4c696e75-7800-4000-8000-6e766d652d67";
const HOST2: &str = "nqn.2014-08.org.nvmexpress:uuid:4c696e75-7800-4000-8000-6e766d652d68";

const GUEST_SCRIPT: &str = r#"
NQN=@NQN@
HOST=@HOST@
HOST2=@HOST2@
SHARED=nqn.2026-11.io.example:shared
cat > /tmp/targetd.toml <<EOF
[server]
portals = ["127.0.0.1:3260"]
nvme_portals = ["127.0.0.1:4420", "127.0.0.2:4420"]
nvme_discovery_portals = ["127.0.0.1:8009"]
admin_socket = "/tmp/targetd.sock"
metrics_listen = "127.0.0.1:9100"
reactors = 1
log = "info"
state_dir = "/tmp/state"

[[subsystems]]
nqn = "$NQN"
hosts = ["$HOST"]

[[subsystems.namespaces]]
nsid = 1
backend = "memory"
size = "128MiB"

[[subsystems.namespaces]]
nsid = 2
backend = "file"
path = "/tmp/ns2.img"
size = "32MiB"

[[subsystems]]
nqn = "$SHARED"
hosts = ["$HOST", "$HOST2"]

[[subsystems.namespaces]]
nsid = 1
backend = "memory"
size = "16MiB"
EOF
start_targetd /tmp/targetd.toml

# resv_report NS: the Reservation Status with 128-bit Host Identifiers (nvme-cli's --eds, or
# CDW11 bit 0 where it has no such option).
resv_report() {
  if nvme resv-report --help 2>&1 | grep -q -- '--eds'; then
    nvme resv-report "$1" --eds
  else
    nvme resv-report "$1" --cdw11=1
  fi
}

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
  grep -q "err= 0" /tmp/fio.txt && [ "$status" = 0 ] || { cat /tmp/fio.txt; fail "$1: fio failed"; }
  iops=$(grep -o "IOPS=[0-9.k]*" /tmp/fio.txt | head -1)
  echo "$1: fio verified $2 random writes ($iops)"
}

for port in 8009 4420; do
  nvme discover -t tcp -a 127.0.0.1 -s $port --hostnqn="$HOST" > /tmp/disc.txt \
    || { cat /tmp/disc.txt; fail "nvme discover ($port) failed"; }
  grep -q "subnqn: *$NQN" /tmp/disc.txt && grep -q "trsvcid: *4420" /tmp/disc.txt \
    && echo "nvme discover ($port): names the subsystem at 4420"
done
nvme discover -t tcp -a 127.0.0.1 -s 8009 \
  --hostnqn=nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000bad > /tmp/disc.txt
grep -q "$NQN" /tmp/disc.txt || echo "nvme discover: a host the subsystem does not admit is not told of it"

for digests in none "--hdr-digest --data-digest"; do
  opts=
  [ "$digests" = none ] || opts=$digests
  nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$NQN" --hostnqn="$HOST" $opts \
    || fail "nvme connect ($digests) failed"
  wait_ns 1
  echo "nvme ($digests): connected, $ns"
  ctrl=/dev/${ns#/dev/}; ctrl=${ctrl%n1}
  nvme list | grep -q "${ns#/dev/}" && echo "nvme ($digests): listed"
  nvme id-ctrl "$ctrl" | grep -q "subnqn *: $NQN" && echo "nvme ($digests): id-ctrl names the subsystem"
  nvme id-ns "$ns" | grep -q "nsze *: 0x40000" && echo "nvme ($digests): id-ns says 128 MiB"
  nvme smart-log "$ctrl" > /dev/null && echo "nvme ($digests): smart-log"
  nvme ana-log "$ctrl" > /dev/null && echo "nvme ($digests): ana-log"
  nvme get-feature "$ctrl" -f 7 > /dev/null && nvme get-feature "$ctrl" -f 0x0f > /dev/null \
    && echo "nvme ($digests): get-feature 07h and 0Fh"
  disk=$ns
  check_disk "nvme ($digests)"
  fio_job "targetd 4k ($digests)" 4k "$ns"
  fio_job "targetd 128k ($digests)" 128k "$ns"
  nvme flush "$ns" > /dev/null && echo "nvme ($digests): flush"
  dd if=/dev/urandom of="$ns" bs=4096 count=4 oflag=direct 2>/dev/null
  nvme write-zeroes "$ns" -s 0 -c 15 > /dev/null || fail "write-zeroes failed"
  dd if="$ns" of=/tmp/z bs=4096 count=2 iflag=direct 2>/dev/null
  zeros /tmp/z && echo "nvme ($digests): write-zeroes read back as zeros"
  dd if=/dev/urandom of="$ns" bs=4096 count=4 seek=16 oflag=direct 2>/dev/null
  nvme dsm "$ns" --ad -s 128 -b 16 > /dev/null || fail "dsm failed"
  dd if="$ns" of=/tmp/z bs=4096 count=2 skip=16 iflag=direct 2>/dev/null
  zeros /tmp/z && echo "nvme ($digests): dsm --ad read back as zeros"
  dd if=/dev/urandom of="$ns" bs=4096 count=4 seek=32 oflag=direct 2>/dev/null
  blkdiscard -o 131072 -l 16384 "$ns" || fail "blkdiscard failed"
  dd if="$ns" of=/tmp/z bs=4096 count=4 skip=32 iflag=direct 2>/dev/null
  zeros /tmp/z && echo "nvme ($digests): blkdiscard read back as zeros"
  nvme disconnect -n "$NQN" | grep -q "disconnected 1" && echo "nvme ($digests): disconnected"
  sleep 1
done

# A namespace added while connected: the host hears of it (Namespace Attribute Changed) and
# rescans; removed (forced: a controller is connected), it goes away.
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$NQN" --hostnqn="$HOST" || fail "nvme connect failed"
wait_ns 1
tctl() { targetctl --socket /tmp/targetd.sock "$@"; }
tctl namespace add "$NQN" 3 --backend memory --size 16MiB > /dev/null || fail "namespace add failed"
wait_ns 3
echo "hot add: the host found namespace 3 ($ns)"
dd if=/dev/urandom of=/tmp/a bs=4096 count=4 2>/dev/null
dd if=/tmp/a of="$ns" bs=4096 oflag=direct 2>/dev/null && dd if="$ns" of=/tmp/b bs=4096 count=4 iflag=direct 2>/dev/null \
  && cmp -s /tmp/a /tmp/b && echo "hot add: namespace 3 written and read back"
tctl namespace resize "$NQN" 3 32MiB > /dev/null || fail "namespace resize failed"
grown=
for i in $(seq 1 100); do
  [ "$(cat /sys/block/${ns#/dev/}/size)" = 65536 ] && { grown=1; break; }
  sleep 0.1
done
[ -n "$grown" ] && dd if="$ns" of=/tmp/b bs=4096 count=4 iflag=direct 2>/dev/null && cmp -s /tmp/a /tmp/b \
  && echo "hot resize: the host sees 32 MiB and the data stayed"
tctl namespace remove "$NQN" 3 > /dev/null 2>&1 && fail "namespace remove without --force while connected"
tctl namespace remove "$NQN" 3 --force > /dev/null || fail "namespace remove --force failed"
gone=
for i in $(seq 1 100); do
  [ -e /sys/block/${ns#/dev/} ] || { gone=1; break; }
  sleep 0.1
done
[ -n "$gone" ] && echo "hot remove: namespace 3 went away"

# Reservations through Linux's host: register, replace, unregister, acquire, preempt (the
# holder changing the type), release, clear; the report after each step.
wait_ns 1
r() { resv_report "$ns" > /tmp/resv.txt || fail "resv-report failed"; grep -Eq "^ *$1 *: *$2\$" /tmp/resv.txt || { cat /tmp/resv.txt; fail "resv-report: $1 is not $2 ($3)"; }; }
nvme resv-register "$ns" --nrkey=4 --rrega=0 > /dev/null || fail "resv-register failed"
r regctl 1 register; r rtype 0 register
nvme resv-register "$ns" --crkey=4 --nrkey=5 --rrega=2 > /dev/null || fail "resv-register replace failed"
r rkey 5 replace
nvme resv-register "$ns" --crkey=5 --rrega=1 > /dev/null || fail "resv-register unregister failed"
r regctl 0 unregister
nvme resv-register "$ns" --nrkey=4 --rrega=0 > /dev/null && nvme resv-acquire "$ns" --crkey=4 --rtype=1 --racqa=0 > /dev/null \
  || fail "resv-acquire failed"
r rtype 1 acquire; r rcsts 1 acquire
dd if=/dev/urandom of="$ns" bs=4096 count=1 oflag=direct 2>/dev/null || fail "the holder could not write"
nvme resv-acquire "$ns" --crkey=4 --rtype=2 --racqa=1 > /dev/null || fail "resv-acquire preempt failed"
r rtype 2 preempt
nvme resv-release "$ns" --crkey=4 --rtype=2 --rrela=0 > /dev/null || fail "resv-release failed"
r rtype 0 release; r regctl 1 release
nvme resv-acquire "$ns" --crkey=4 --rtype=1 --racqa=0 > /dev/null || fail "resv-acquire failed"
nvme resv-release "$ns" --crkey=4 --rrela=1 > /dev/null || fail "resv-release clear failed"
r regctl 0 clear; r rtype 0 clear
echo "reservations: register, replace, unregister, acquire, preempt, release and clear as reported"
nvme disconnect -n "$NQN" > /dev/null
sleep 1

# Two hosts (two host NQNs and Host Identifiers) on one namespace: while the first holds
# Write Exclusive the second's writes are refused. Each host's commands go through its own
# controller's character device (the subsystem has one namespace, as that needs). The
# second host comes through the second portal: nvme-cli 2.3 takes a second connection to the
# same address and subsystem for one it has ("already connected"), whatever the host NQN.
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$SHARED" --hostnqn="$HOST" \
  --hostid=4c696e75-7800-4000-8000-000000000001 > /dev/null || fail "nvme connect (host 1) failed"
nvme connect -t tcp -a 127.0.0.2 -s 4420 -n "$SHARED" --hostnqn="$HOST2" \
  --hostid=4c696e75-7800-4000-8000-000000000002 > /dev/null || fail "nvme connect (host 2) failed"
c1=; c2=
for i in $(seq 1 100); do
  for c in /sys/class/nvme/nvme*; do
    [ "$(cat $c/subsysnqn 2>/dev/null)" = "$SHARED" ] || continue
    case "$(cat $c/hostnqn)" in
      "$HOST") c1=/dev/${c##*/} ;;
      "$HOST2") c2=/dev/${c##*/} ;;
    esac
  done
  [ -n "$c1" ] && [ -n "$c2" ] && [ -e "$c1" ] && [ -e "$c2" ] && break
  sleep 0.1
done
[ -n "$c1" ] && [ -n "$c2" ] || fail "the two hosts' controllers did not appear"
head -c 512 /dev/urandom > /tmp/blk
w() {
  nvme io-passthru "$1" --opcode=0x01 --namespace-id=1 --data-len=512 --write \
    --input-file=/tmp/blk > /tmp/w.txt 2>&1
}
w "$c2" || { cat /tmp/w.txt; fail "host 2 could not write before any reservation"; }
nvme resv-register "$c1" --namespace-id=1 --nrkey=0x11 --rrega=0 > /dev/null \
  && nvme resv-acquire "$c1" --namespace-id=1 --crkey=0x11 --rtype=1 --racqa=0 > /dev/null \
  || fail "host 1 could not reserve"
if w "$c2"; then cat /tmp/w.txt; fail "host 2 wrote under host 1's Write Exclusive"; fi
grep -qi "reservation" /tmp/w.txt && echo "two hosts: the second host's write got Reservation Conflict"
w "$c1" || { cat /tmp/w.txt; fail "the holder could not write"; }
nvme resv-release "$c1" --namespace-id=1 --crkey=0x11 --rrela=1 > /dev/null || fail "clear failed"
w "$c2" && echo "two hosts: after the clear the second host writes again"
nvme disconnect -n "$SHARED" > /dev/null
sleep 1

# A stop and a start while connected: the host reconnects, and the file namespace has what
# was written before.
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$NQN" --hostnqn="$HOST" --reconnect-delay=1 \
  || fail "nvme connect failed"
wait_ns 2
dd if=/dev/urandom of=/tmp/before bs=65536 count=16 2>/dev/null
dd if=/tmp/before of="$ns" bs=65536 oflag=direct 2>/dev/null || fail "writes before the restart failed"
# A reservation that persists through power loss (CPTPL 11b): kept in server.state_dir.
nvme resv-register "$ns" --nrkey=0x77 --rrega=0 --cptpl=3 > /dev/null \
  && nvme resv-acquire "$ns" --crkey=0x77 --rtype=1 --racqa=0 > /dev/null || fail "PTPL reservation failed"
kill -TERM $daemon
for i in $(seq 1 100); do kill -0 $daemon 2>/dev/null || break; sleep 0.1; done
kill -0 $daemon 2>/dev/null && fail "targetd did not stop on SIGTERM"
echo "restart: targetd stopped"
start_targetd /tmp/targetd.toml
ok=
for i in $(seq 1 60); do
  if dd if="$ns" of=/tmp/after bs=65536 count=16 iflag=direct 2>/dev/null && cmp -s /tmp/before /tmp/after; then
    ok=1; break
  fi
  sleep 1
done
[ -n "$ok" ] || fail "the host did not come back after the restart"
echo "restart: the host reconnected and read back what it wrote before"
r rtype 1 "after the restart"; r ptpls 1 "after the restart"
nvme resv-release "$ns" --crkey=0x77 --rrela=1 > /dev/null || fail "resv-release clear failed"
echo "restart: the reservation made with PTPL was still there"
nvme disconnect -n "$NQN" > /dev/null
kill -TERM $daemon
sleep 1

# Linux's own target, nvmet_tcp, on a RAM-backed namespace: the same fio job.
dd if=/dev/zero of=/tmp/nvmet.img bs=1048576 count=128 2>/dev/null
cfg=/sys/kernel/config/nvmet
mkdir $cfg/subsystems/nqn.2026-11.io.example:nvmet || fail "no nvmet in configfs"
echo 1 > $cfg/subsystems/nqn.2026-11.io.example:nvmet/attr_allow_any_host
mkdir $cfg/subsystems/nqn.2026-11.io.example:nvmet/namespaces/1
echo -n /tmp/nvmet.img > $cfg/subsystems/nqn.2026-11.io.example:nvmet/namespaces/1/device_path
# tmpfs has no O_DIRECT: the file is read and written through the page cache.
echo 1 > $cfg/subsystems/nqn.2026-11.io.example:nvmet/namespaces/1/buffered_io
echo 1 > $cfg/subsystems/nqn.2026-11.io.example:nvmet/namespaces/1/enable || fail "nvmet namespace"
mkdir $cfg/ports/1
echo 127.0.0.1 > $cfg/ports/1/addr_traddr
echo tcp > $cfg/ports/1/addr_trtype
echo 4421 > $cfg/ports/1/addr_trsvcid
echo ipv4 > $cfg/ports/1/addr_adrfam
ln -s $cfg/subsystems/nqn.2026-11.io.example:nvmet $cfg/ports/1/subsystems/
nvme connect -t tcp -a 127.0.0.1 -s 4421 -n nqn.2026-11.io.example:nvmet --hostnqn="$HOST" \
  || fail "nvme connect to nvmet failed"
for i in $(seq 1 100); do
  ns=; for b in /sys/block/nvme*n1; do [ -e "$b" ] && ns=/dev/${b##*/}; done
  [ -n "$ns" ] && break; sleep 0.1
done
fio_job "nvmet 4k (none)" 4k "$ns"
fio_job "nvmet 128k (none)" 128k "$ns"
nvme disconnect -n nqn.2026-11.io.example:nvmet > /dev/null
echo "nvme guest: done"
"#;

#[test]
fn linux_nvme_tcp_host_in_a_guest() {
    let Some(mut exes) = guest::tools(
        &["nvme", "fio"],
        "nvme-cli or fio is missing (Debian packages nvme-cli, fio)",
    ) else {
        return;
    };
    exes.insert(0, env!("CARGO_BIN_EXE_targetd").to_string());
    exes.insert(1, env!("CARGO_BIN_EXE_targetctl").to_string());
    let text = GUEST_SCRIPT
        .replace("@NQN@", NQN)
        .replace("@HOST2@", HOST2)
        .replace("@HOST@", HOST);
    let started = Instant::now();
    let timeout = std::env::var("RDMA_GUEST_TIMEOUT").unwrap_or_else(|_| "1200".into());
    let mut expected = Vec::new();
    for d in ["none", "--hdr-digest --data-digest"] {
        for what in [
            "connected",
            "listed",
            "id-ctrl names the subsystem",
            "id-ns says 128 MiB",
            "smart-log",
            "ana-log",
            "get-feature 07h and 0Fh",
            "8 MiB written in 4 KiB writes and read back",
            "8 MiB written in 1 MiB writes and read back",
            "flush",
            "write-zeroes read back as zeros",
            "dsm --ad read back as zeros",
            "blkdiscard read back as zeros",
            "disconnected",
        ] {
            expected.push(format!("nvme ({d}): {what}"));
        }
        expected.push(format!("targetd 4k ({d}): fio verified 4k random writes"));
        expected.push(format!(
            "targetd 128k ({d}): fio verified 128k random writes"
        ));
    }
    for port in [8009, 4420] {
        expected.push(format!(
            "nvme discover ({port}): names the subsystem at 4420"
        ));
    }
    expected.push("nvme discover: a host the subsystem does not admit is not told of it".into());
    expected.push("hot add: namespace 3 written and read back".into());
    expected.push("hot resize: the host sees 32 MiB and the data stayed".into());
    expected.push("hot remove: namespace 3 went away".into());
    expected.push("restart: the host reconnected and read back what it wrote before".into());
    expected.push(
        "reservations: register, replace, unregister, acquire, preempt, release and clear as reported"
            .into(),
    );
    expected.push("restart: the reservation made with PTPL was still there".into());
    expected.push("two hosts: the second host's write got Reservation Conflict".into());
    expected.push("two hosts: after the clear the second host writes again".into());
    expected.push("nvme guest: done".into());
    let lines: Vec<&str> = expected.iter().map(String::as_str).collect();
    let Some(console) = guest::run_checked(
        "nvme-guest",
        &text,
        &exes,
        &[("RDMA_GUEST_TIMEOUT", timeout)],
        &lines,
    ) else {
        return;
    };
    // The figures side by side (emulated CPU: a ratio between the two targets).
    for line in console.lines().filter(|l| l.contains("fio verified")) {
        println!("{line}");
    }
    println!(
        "Linux's NVMe/TCP host served in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
