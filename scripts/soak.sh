#!/usr/bin/env bash
# Soak: targetd under mixed, verified reads and writes from several sessions for a long time,
# some of them through initiator-bench's proxy cutting every connection after a few MiB, while
# the daemon's resident memory and open file descriptors are sampled. Not run in CI.
#
#   scripts/soak.sh [MINUTES] [OUT_DIR]     # defaults: 30 /tmp/targetd-soak
#
# `touch OUT_DIR/stop` ends it early (the rounds running finish first), still with its figures.
# Writes OUT_DIR/samples.csv (seconds, RSS KiB, fds, sessions, connections) and OUT_DIR/summary.txt;
# exits non-zero when a block fails verification, the daemon dies, or memory or descriptors grow
# by more than 10% between the end of the warm-up (the first fifth) and the end.
set -euo pipefail
minutes=${1:-30}
out=${2:-/tmp/targetd-soak}
port=${SOAK_PORT:-3290}
proxy_port=$((port + 1))
metrics_port=$((port + 2))
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$out/bin"

cargo build --release --quiet --manifest-path "$root/Cargo.toml" \
  --bin targetd --bin initiator-bench
rm -rf "$out"
mkdir -p "$bin"
# Copies, so a build during the soak does not change what it runs.
cp "$root/target/release/targetd" "$root/target/release/initiator-bench" "$bin/"
iqn=iqn.2026-11.io.example:soak
cat >"$out/config.toml" <<EOF
[server]
portals = ["127.0.0.1:$port"]
admin_socket = "$out/admin.sock"
metrics_listen = "127.0.0.1:$metrics_port"
reactors = 2

[[targets]]
name = "$iqn"

[[targets.luns]]
lun = 0
backend = "file"
path = "$out/disk0.img"
size = "2GiB"

[[targets.luns]]
lun = 1
backend = "file"
path = "$out/disk1.img"
size = "1GiB"
write_cache = false

[[targets.luns]]
lun = 2
backend = "memory"
size = "1GiB"
EOF

"$bin/targetd" "$out/config.toml" >"$out/targetd.log" 2>&1 &
target_pid=$!
# Cut every relayed connection after 3 MiB towards the target or 5 MiB back.
"$bin/initiator-bench" proxy --listen "127.0.0.1:$proxy_port" --to "127.0.0.1:$port" \
  --cut-upstream 3145728 --cut-downstream 5242880 >"$out/proxy.log" 2>&1 &
proxy_pid=$!
cleanup() {
  kill "$proxy_pid" "$target_pid" 2>/dev/null || true
  jobs -p | xargs -r kill 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$metrics_port/metrics" >/dev/null 2>&1 && break
  sleep 0.1
done

direct="iscsi://127.0.0.1:$port/$iqn"
cut="iscsi://127.0.0.1:$proxy_port/$iqn"
end=$(($(date +%s) + minutes * 60))
running() { [ "$(date +%s)" -lt "$end" ] && [ ! -e "$out/stop" ]; }

# One loop of workloads: each works its own range with its own seed, so verification holds
# whichever write of a block came last; every round writes then verifies what it wrote.
# `$1` names it, the rest are initiator-bench run's arguments.
loop() {
  local name=$1
  shift
  local round=0
  while running; do
    round=$((round + 1))
    if ! "$bin/initiator-bench" run "$@" --verify --seed "$round" --time 30s --timeout 10s \
      --json >"$out/$name.last.json" 2>"$out/$name.last.err"; then
      if grep -q "failed verification" "$out/$name.last.err"; then
        echo "$name round $round: verification failed" >>"$out/failures.txt"
        cp "$out/$name.last.err" "$out/$name.failed-$round.err"
      elif [ "$name" = "${name#cut}" ]; then
        echo "$name round $round: $(tail -1 "$out/$name.last.err")" >>"$out/failures.txt"
      fi
    fi
    echo "$round" >"$out/$name.rounds"
  done
}
loop file-randrw "$direct/0" --rw randrw --bs 8k --qd 16 --sessions 2 --offset 0 --size 512m &
loop file-seq "$direct/0" --rw rw --bs 256k --qd 4 --offset 1g --size 512m &
loop writethrough "$direct/1" --rw randrw --bs 4k --qd 8 --size 256m &
loop memory "$direct/2" --rw randrw --bs 64k --qd 8 --sessions 2 --size 512m &
# Through the cutting proxy: commands fail when their connection is cut, the next one logs in
# again; whatever was acknowledged must still verify.
loop cut-file "$cut/0" --rw randrw --bs 64k --qd 8 --offset 1536m --size 256m &
loop cut-memory "$cut/2" --rw randrw --bs 128k --qd 4 --offset 512m --size 256m &

echo "seconds,rss_kib,fds,sessions,connections" >"$out/samples.csv"
start=$(date +%s)
while running; do
  if ! kill -0 "$target_pid" 2>/dev/null; then
    echo "targetd died" >>"$out/failures.txt"
    break
  fi
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$target_pid/status")
  fds=$(ls "/proc/$target_pid/fd" | wc -l)
  metrics=$(curl -sf "http://127.0.0.1:$metrics_port/metrics" || true)
  sessions=$(awk '$1 == "targetd_sessions" {print $2}' <<<"$metrics")
  connections=$(awk '$1 == "targetd_connections" {print $2}' <<<"$metrics")
  echo "$(($(date +%s) - start)),$rss,$fds,${sessions:-?},${connections:-?}" >>"$out/samples.csv"
  sleep 10
done
wait_for_loops() { for p in $(jobs -p); do [ "$p" = "$proxy_pid" ] || [ "$p" = "$target_pid" ] || wait "$p" || true; done; }
wait_for_loops

# Figures: the first sample after the warm-up against the last.
python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import csv, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = list(csv.DictReader(open(out / "samples.csv")))
if len(rows) < 5:
    print("too few samples"); sys.exit(1)
warm = rows[len(rows) // 5]
last = rows[-1]
rss = [int(r["rss_kib"]) for r in rows[len(rows) // 5:]]
fds = [int(r["fds"]) for r in rows[len(rows) // 5:]]
print(f"samples: {len(rows)} over {last['seconds']} s")
print(f"RSS after warm-up {int(warm['rss_kib']) / 1024:.1f} MiB, at the end {int(last['rss_kib']) / 1024:.1f} MiB, "
      f"min {min(rss) / 1024:.1f}, max {max(rss) / 1024:.1f}")
print(f"fds after warm-up {warm['fds']}, at the end {last['fds']}, min {min(fds)}, max {max(fds)}")
rounds = {p.name.split('.')[0]: int(p.read_text()) for p in out.glob("*.rounds")}
print("rounds of 30 s per workload:", ", ".join(f"{k} {v}" for k, v in sorted(rounds.items())))
grew = int(last["rss_kib"]) > 1.1 * int(warm["rss_kib"]) or int(last["fds"]) > 1.1 * int(warm["fds"]) + 2
failures = (out / "failures.txt").read_text() if (out / "failures.txt").exists() else ""
print("failures:", failures.strip() or "none")
print("growth beyond 10%:", "yes" if grew else "no")
sys.exit(1 if grew or failures else 0)
EOF
