#!/usr/bin/env bash
# Starts targetd (this repository's, release build) on loopback with N targets, each one thin
# file-backed LUN 1, at targetd's defaults: the counterpart of tgtd-lab.sh, so that an
# experiment runs with the same commands against both; prints their URLs.
#
#   scripts/targetd-lab.sh start [PORT] [TARGETS] [SIZE]   # defaults: 3263 1 1GiB
#   scripts/targetd-lab.sh stop [PORT]
set -euo pipefail
cmd=${1:-start}
port=${2:-3263}
targets=${3:-1}
size=${4:-1GiB}
dir=${TARGETD_LAB_DIR:-/tmp/targetd-lab-$port}
bin=${TARGETD:-$(dirname "$0")/../target/release/targetd}

case "$cmd" in
  start)
    [ -x "$bin" ] || { echo "$bin not found: cargo build --release --bin targetd" >&2; exit 1; }
    mkdir -p "$dir"
    {
      printf '[server]\nportals = ["127.0.0.1:%s"]\nadmin_socket = "%s/targetd.sock"\n\n' "$port" "$dir"
      for t in $(seq "$targets"); do
        printf '[[targets]]\nname = "iqn.2026-11.io.storage-target:targetd-lab-%s"\n' "$t"
        printf '[[targets.luns]]\nlun = 1\nbackend = "file"\npath = "%s/disk%s.img"\nsize = "%s"\n\n' "$dir" "$t" "$size"
      done
    } >"$dir/config.toml"
    "$bin" "$dir/config.toml" >"$dir/targetd.log" 2>&1 &
    echo $! >"$dir/targetd.pid"
    for _ in $(seq 100); do grep -q "listening" "$dir/targetd.log" 2>/dev/null && break; sleep 0.05; done
    grep -q "listening" "$dir/targetd.log" || { cat "$dir/targetd.log" >&2; exit 1; }
    for t in $(seq "$targets"); do
      echo "iscsi://127.0.0.1:$port/iqn.2026-11.io.storage-target:targetd-lab-$t/1"
    done
    ;;
  stop)
    pid=$(cat "$dir/targetd.pid" 2>/dev/null || true)
    if [ -n "$pid" ]; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    fi
    rm -rf "$dir"
    ;;
  *) echo "usage: $0 start|stop [PORT] [TARGETS] [SIZE]" >&2; exit 2 ;;
esac
