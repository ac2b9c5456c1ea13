#!/usr/bin/env bash
# Starts tgtd (Debian package tgt) on loopback with N targets, each one thin file-backed LUN 1,
# for experiments and comparisons; prints their URLs. Needs root.
#
#   scripts/tgtd-lab.sh start [PORT] [TARGETS] [SIZE]   # defaults: 3262 1 1G
#   scripts/tgtd-lab.sh stop [PORT]
set -euo pipefail
cmd=${1:-start}
port=${2:-3262}
targets=${3:-1}
size=${4:-1G}
ctl=$((1000 + port % 31000))   # tgtd's control ports stop at 32767
dir=${TGTD_LAB_DIR:-/tmp/tgtd-lab-$port}
adm() { tgtadm -C "$ctl" --lld iscsi "$@"; }

case "$cmd" in
  start)
    command -v tgtd >/dev/null || { echo "tgtd not found: apt-get install tgt" >&2; exit 1; }
    mkdir -p "$dir"
    tgtd -f -C "$ctl" --iscsi "portal=127.0.0.1:$port" >"$dir/tgtd.log" 2>&1 &
    echo $! >"$dir/tgtd.pid"
    for _ in $(seq 100); do adm --op show --mode sys >/dev/null 2>&1 && break; sleep 0.05; done
    for t in $(seq "$targets"); do
      iqn="iqn.2026-11.io.storage-target:tgtd-lab-$t"
      truncate -s "$size" "$dir/disk$t.img"
      adm --op new --mode target --tid "$t" -T "$iqn"
      adm --op new --mode logicalunit --tid "$t" --lun 1 -b "$dir/disk$t.img"
      adm --op bind --mode target --tid "$t" -I ALL
      # Let the initiator's proposals decide R2T behaviour, as targetd does.
      adm --op update --mode target --tid "$t" --name InitialR2T --value No
      echo "iscsi://127.0.0.1:$port/$iqn/1"
    done
    ;;
  stop)
    pid=$(cat "$dir/tgtd.pid" 2>/dev/null || pgrep -f "tgtd -f -C $ctl " || true)
    if [ -n "$pid" ]; then
      kill "$pid" 2>/dev/null || true
      # tgtd is slow to act on SIGTERM, and a restart must not find the old one still there.
      for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
      kill -9 "$pid" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    fi
    rm -rf "$dir"
    ;;
  *) echo "usage: $0 start|stop [PORT] [TARGETS] [SIZE]" >&2; exit 2 ;;
esac
