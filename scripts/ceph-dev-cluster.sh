#!/usr/bin/env bash
# A throwaway single-host Ceph cluster on 127.0.0.1 for targetd's RBD tests and benchmarks.
#
#   scripts/ceph-dev-cluster.sh start DIR [OSDS]   one monitor, OSDS memstore OSDs (default 1),
#                                                  pool "rbd" (size 1), cephx on; prints the env
#   scripts/ceph-dev-cluster.sh stop DIR           stops every daemon of DIR and removes DIR
#   scripts/ceph-dev-cluster.sh status DIR         exit 0 when the cluster answers an object put/get
#   scripts/ceph-dev-cluster.sh stop-osd DIR ID    stops one OSD (tests of cluster trouble)
#   scripts/ceph-dev-cluster.sh start-osd DIR ID   starts it again
#
# Needs Debian's ceph-mon, ceph-osd and ceph-common (Ceph 16.2). No mgr: RBD I/O, exclusive
# lock, watch/notify and omap need none. Everything lives in DIR: the config (DIR/ceph.conf),
# the keyrings, the monitor's store, the OSDs (memstore: every byte in memory, so keep the
# data written to about 1 GiB per cluster), logs and admin sockets. `start` writes DIR/env,
# a file to source: CEPH_CONF, CEPH_KEYRING, CEPH_CLIENT (client.targetd, rbd profile on the
# pool "rbd") and CEPH_POOL.
#
# The monitor's port is CEPH_MON_PORT, or a free one; each OSD takes ports from a range of 16
# just above it, so several clusters can run side by side.
set -euo pipefail

die() { echo "ceph-dev-cluster: $*" >&2; exit 1; }

[ $# -ge 2 ] || die "usage: $0 start|stop|status|stop-osd|start-osd DIR [ARG]"
cmd=$1
dir=$2

free_port() {
  python3 - <<'EOF'
import socket
# A port whose next 64 are free too: the OSDs bind above the monitor.
for _ in range(200):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    if p + 64 > 65535:
        continue
    ok = True
    for q in range(p, p + 64):
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", q))
        except OSError:
            ok = False
        finally:
            t.close()
        if not ok:
            break
    if ok:
        print(p); break
EOF
}

ceph_() { timeout 60 ceph -c "$dir/ceph.conf" -k "$dir/client.admin.keyring" -n client.admin "$@"; }

start_osd() {
  local id=$1
  ceph-osd -c "$dir/ceph.conf" -i "$id" >"$dir/log/osd.$id.out" 2>&1
}

stop_pid() {
  local pidfile=$1 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile" 2>/dev/null || true)
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

ready() {
  local probe=$dir/probe
  echo "probe $$" >"$probe"
  timeout 20 rados -c "$dir/ceph.conf" -k "$dir/client.admin.keyring" -n client.admin \
    -p rbd put probe "$probe" >/dev/null 2>&1 &&
    timeout 20 rados -c "$dir/ceph.conf" -k "$dir/client.admin.keyring" -n client.admin \
      -p rbd get probe "$probe.back" >/dev/null 2>&1 &&
    cmp -s "$probe" "$probe.back"
}

case "$cmd" in
start)
  osds=${3:-1}
  for tool in ceph-mon ceph-osd ceph ceph-authtool monmaptool rados; do
    command -v "$tool" >/dev/null || die "$tool is missing (Debian packages ceph-mon, ceph-osd, ceph-common)"
  done
  [ ! -e "$dir/ceph.conf" ] || die "$dir already holds a cluster (stop it first)"
  mkdir -p "$dir/run" "$dir/log" "$dir/mon.a"
  dir=$(cd "$dir" && pwd)
  port=${CEPH_MON_PORT:-$(free_port)}
  [ -n "$port" ] || die "no free port range found"
  fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  cat >"$dir/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$port
mon initial members = a
public network = 127.0.0.0/8
ms bind msgr1 = false
ms bind port min = $((port + 1))
ms bind port max = $((port + 63))
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
crash dir = $dir/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
# The monitor refuses to start, silently, when its disk has no more than "crit" percent free:
# a big shared disk at 99% still has gigabytes, and the monitor's store needs a few MB.
mon data avail warn = 1
mon data avail crit = 0
paxos propose interval = 0.1
osd objectstore = memstore
memstore device bytes = 4294967296
memstore page set = true
osd min pg log entries = 100
osd max pg log entries = 500
osd pg log dups tracked = 500
osd data = $dir/osd.\$id
osd op num shards = 1
osd op num threads per shard = 2
osd memory target = 536870912
debug ms = 0
debug osd = 0
debug mon = 0
debug paxos = 0

[mon.a]
mon data = $dir/mon.a

[client]
keyring = $dir/client.admin.keyring
EOF
  conf=$dir/ceph.conf
  ceph-authtool --create-keyring "$dir/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool --create-keyring "$dir/client.admin.keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
  ceph-authtool "$dir/mon.keyring" --import-keyring "$dir/client.admin.keyring" >/dev/null
  monmaptool --create --addv a "[v2:127.0.0.1:$port]" --fsid "$fsid" "$dir/monmap" >/dev/null
  ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/mon.keyring" \
    >"$dir/log/mon.a.mkfs" 2>&1 || { cat "$dir/log/mon.a.mkfs" >&2; die "ceph-mon --mkfs failed"; }
  ceph-mon -c "$conf" -i a >"$dir/log/mon.a.out" 2>&1 || {
    cat "$dir/log/mon.a.out" >&2
    tail -n 20 "$dir/log/mon.a.log" >&2 2>/dev/null || true
    df -h "$dir" >&2
    die "ceph-mon did not start (its output, the end of its log and the free space of $dir are above)"
  }
  for i in $(seq 0 $((osds - 1))); do
    uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    key=$(ceph-authtool --gen-print-key)
    id=$(echo "{\"cephx_secret\": \"$key\"}" | ceph_ osd new "$uuid" -i -)
    mkdir -p "$dir/osd.$id"
    printf '[osd.%s]\n\tkey = %s\n' "$id" "$key" >"$dir/osd.$id/keyring"
    ceph-osd -c "$conf" -i "$id" --mkfs --osd-uuid "$uuid" >"$dir/log/osd.$id.mkfs" 2>&1 ||
      { cat "$dir/log/osd.$id.mkfs" >&2; die "ceph-osd --mkfs failed"; }
    # Pacific's --mkfs does not write the keyring it was given: write it again.
    printf '[osd.%s]\n\tkey = %s\n' "$id" "$key" >"$dir/osd.$id/keyring"
    start_osd "$id" || die "ceph-osd $id did not start: $(cat "$dir/log/osd.$id.out")"
  done
  ceph_ osd pool create rbd 8 8 >/dev/null 2>&1
  ceph_ osd pool application enable rbd rbd >/dev/null 2>&1
  ceph_ auth get-or-create client.targetd mon 'profile rbd' osd 'profile rbd pool=rbd' \
    -o "$dir/client.targetd.keyring" >/dev/null
  for _ in $(seq 1 120); do
    ready && break
    sleep 0.5
  done
  ready || die "the cluster in $dir does not answer an object put/get (logs in $dir/log)"
  cat >"$dir/env" <<EOF
export CEPH_CONF=$conf
export CEPH_KEYRING=$dir/client.targetd.keyring
export CEPH_CLIENT=targetd
export CEPH_POOL=rbd
EOF
  echo "cluster up in $dir (monitor v2:127.0.0.1:$port, $osds OSD): source $dir/env"
  ;;
stop)
  [ -d "$dir" ] || exit 0
  for pidfile in "$dir"/run/osd.*.pid "$dir"/run/mon.*.pid; do
    [ -e "$pidfile" ] && stop_pid "$pidfile"
  done
  # Anything still holding the directory's config (a daemon whose pid file was lost).
  pkill -f -- "-c $dir/ceph.conf" 2>/dev/null || true
  rm -rf "$dir"
  ;;
status)
  [ -f "$dir/ceph.conf" ] || die "no cluster in $dir"
  ready
  ;;
stop-osd)
  stop_pid "$dir/run/osd.${3:?osd id}.pid"
  ;;
start-osd)
  start_osd "${3:?osd id}"
  ;;
*)
  die "unknown command $cmd"
  ;;
esac
