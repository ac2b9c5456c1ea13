#!/usr/bin/env bash
# One RBD image, three ways to reach it, measured in one run with the same client (QEMU's
# qemu-img bench): QEMU's rbd driver on librbd directly (the ceiling: no iSCSI hop), targetd's
# rbd backend over iSCSI, and tgtd's rbd backstore (Debian package tgt-rbd) over iSCSI.
# Reads and writes of 4 KiB and 128 KiB at queue depths 1 and 32; the three alternate within
# each round and the table gives each one's median over the rounds, with the ratios.
#
#   scripts/rbd-bench.sh CLUSTER_DIR [ROUNDS]    (a cluster from scripts/ceph-dev-cluster.sh)
#
# Needs target/release/targetd built with `--features rbd`, tgtd with tgt-rbd, qemu-img with
# qemu-block-extra, and root (tgtd). Every write completes only once the OSDs have it on all
# three: targetd's LUN has write_cache = false, QEMU runs with -t none (rbd_cache off), and
# tgt's backstore reads a copy of the ceph.conf with rbd_cache off (otherwise its librbd turns
# write-back at the first SYNCHRONIZE CACHE, which qemu-img sends when it closes a device).
#
# The last row is the iSCSI hop alone: the same client against a targetd memory LUN.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: $0 CLUSTER_DIR [ROUNDS]}
rounds=${2:-3}
conf=$dir/ceph.conf
[ -f "$conf" ] || { echo "no cluster in $dir" >&2; exit 1; }
for tool in qemu-img tgtd tgtadm rbd; do
  command -v $tool >/dev/null || { echo "$tool is missing" >&2; exit 1; }
done
[ -x target/release/targetd ] || { echo "build first: cargo build --release -p storage-target-targetd --features rbd" >&2; exit 1; }

work=$(mktemp -d /tmp/rbd-bench.XXXXXX)
image="bench-$$"
port_t=3281
port_g=3282
ctl=$((1000 + port_g % 31000))
rbd_() { rbd -c "$conf" --id admin "$@"; }
cleanup() {
  [ -n "${targetd_pid:-}" ] && kill "$targetd_pid" 2>/dev/null || true
  [ -n "${tgtd_pid:-}" ] && { kill "$tgtd_pid" 2>/dev/null; sleep 1; kill -9 "$tgtd_pid" 2>/dev/null; } || true
  wait 2>/dev/null || true
  rbd_ rm "rbd/$image" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

rbd_ create --size 1G "rbd/$image"
# Every block written once, so reads read objects rather than holes.
rbd_ bench --io-type write --io-size 4M --io-threads 4 --io-total 1G --io-pattern seq "rbd/$image" >/dev/null

cat >"$work/targetd.toml" <<EOF
[server]
portals = ["127.0.0.1:$port_t"]
admin_socket = "$work/targetd.sock"

[[targets]]
name = "iqn.2026-11.io.example:bench"

[[targets.luns]]
lun = 1
backend = "memory"
size = "1GiB"

[[targets.luns]]
lun = 0
backend = "rbd"
pool = "rbd"
image = "$image"
ceph_conf = "$conf"
client = "admin"
write_cache = false
EOF
RUST_LOG=warn target/release/targetd "$work/targetd.toml" >"$work/targetd.log" 2>&1 &
targetd_pid=$!

cp "$conf" "$work/tgt-ceph.conf"
printf '\n[client]\nrbd cache = false\n' >>"$work/tgt-ceph.conf"
tgtd -f -C "$ctl" --iscsi "portal=127.0.0.1:$port_g" >"$work/tgtd.log" 2>&1 &
tgtd_pid=$!
for _ in $(seq 100); do tgtadm -C "$ctl" --lld iscsi --op show --mode sys >/dev/null 2>&1 && break; sleep 0.05; done
tgtadm -C "$ctl" --lld iscsi --op new --mode target --tid 1 -T iqn.2026-11.io.example:tgt-rbd
tgtadm -C "$ctl" --lld iscsi --op new --mode logicalunit --tid 1 --lun 1 --bstype rbd \
  --backing-store "rbd/$image" --bsopts "conf=$work/tgt-ceph.conf;id=admin"
tgtadm -C "$ctl" --lld iscsi --op bind --mode target --tid 1 -I ALL
sleep 1

declare -A url=(
  [librbd]="rbd:rbd/$image:conf=$conf:id=admin"
  [targetd]="iscsi://127.0.0.1:$port_t/iqn.2026-11.io.example:bench/0"
  [tgt-rbd]="iscsi://127.0.0.1:$port_g/iqn.2026-11.io.example:tgt-rbd/1"
  [memory]="iscsi://127.0.0.1:$port_t/iqn.2026-11.io.example:bench/1"
)
systems=(librbd targetd tgt-rbd memory)
# name rw size depth count
cases=(
  "4k-read-qd1 read 4k 1 3000"
  "4k-read-qd32 read 4k 32 40000"
  "4k-write-qd1 write 4k 1 3000"
  "4k-write-qd32 write 4k 32 40000"
  "128k-read-qd1 read 128k 1 1000"
  "128k-read-qd32 read 128k 32 4000"
  "128k-write-qd1 write 128k 1 1000"
  "128k-write-qd32 write 128k 32 4000"
)
results=$work/results.csv
for round in $(seq "$rounds"); do
  for c in "${cases[@]}"; do
    read -r name rw size depth count <<<"$c"
    flags=()
    [ "$rw" = write ] && flags+=(-w)
    for s in "${systems[@]}"; do
      secs=$(qemu-img bench -f raw -t none "${flags[@]}" -c "$count" -d "$depth" -s "$size" "${url[$s]}" 2>&1 |
        sed -n 's/^Run completed in \([0-9.]*\) seconds.*/\1/p')
      [ -n "$secs" ] || { echo "qemu-img bench on $s failed" >&2; exit 1; }
      echo "$round,$name,$size,$s,$count,$secs" >>"$results"
    done
  done
  echo "round $round done" >&2
done

python3 - "$results" <<'EOF'
import csv, statistics, sys
rows = list(csv.reader(open(sys.argv[1])))
by = {}
for _, name, size, system, count, secs in rows:
    by.setdefault((name, size), {}).setdefault(system, []).append(int(count) / float(secs))
unit = lambda size: 4096 if size == "4k" else 131072
print("| case | librbd (QEMU rbd) | targetd rbd | tgt-rbd | targetd / librbd | targetd / tgt-rbd | iSCSI alone (targetd memory) |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for (name, size), s in by.items():
    m = {k: statistics.median(v) for k, v in s.items()}
    def fmt(iops):
        mib = iops * unit(size) / 2**20
        return f"{iops:,.0f} IOPS" if size == "4k" else f"{mib:,.0f} MiB/s"
    print(f"| {name} | {fmt(m['librbd'])} | {fmt(m['targetd'])} | {fmt(m['tgt-rbd'])} | "
          f"{m['targetd'] / m['librbd']:.2f} | {m['targetd'] / m['tgt-rbd']:.2f} | {fmt(m['memory'])} |")
EOF
