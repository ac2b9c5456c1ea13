#!/usr/bin/env bash
# Runs programs in a small Linux guest that has an RDMA device: soft-RoCE (rdma_rxe) over the
# guest's virtio network interface, under QEMU without KVM (TCG). For targetd's tests of SRP
# over real verbs on machines that have no RDMA hardware.
#
#   scripts/rdma-guest.sh run DIR SCRIPT [EXE...]
#
# DIR caches what it fetches and builds (Debian's kernel and busybox-static packages, fetched
# with `apt-get download`, and the initramfs). The guest boots Debian's kernel with an
# initramfs of busybox, the kernel modules rdma_rxe needs, the host's `rdma` tool and rxe
# verbs provider, and each EXE with the shared libraries it links (as the host has them). It
# loads the modules, gives eth0 the address 10.0.2.15, creates rxe0 on it, then runs SCRIPT (a
# shell script, copied to /script, run with the helpers of /guest.sh: fail, start_targetd,
# find_disk, check_disk; the EXEs are in /bin, with busybox's tools; the modules of
# Linux's SRP, iSER and iSCSI/TCP initiators (ib_srp, ib_iser, iscsi_tcp), of SCSI disks with
# ALUA (scsi_dh_alua), of dm-multipath, of LIO's file backstore, of the NVMe/TCP host
# (nvme_tcp) and target (nvmet_tcp, configfs mounted) and of the NVMe/RDMA host (nvme_rdma)
# are loaded; Linux's SRP target, ib_srpt, is in /lib/modules/extra for a script to
# insmod with its parameters) in /tmp with RDMA_ADDR=10.0.2.15,
# and powers off. Everything the guest prints comes out on stdout; the exit status is
# SCRIPT's (2 when the guest did not say, 3 when it did not finish in RDMA_GUEST_TIMEOUT
# seconds, 300 by default).
#
# Needs qemu-system-x86_64 (Debian's qemu-system-x86), apt-get with Debian's archive
# reachable, rdma (iproute2), the rxe provider of libibverbs (ibverbs-providers) and cpio or
# busybox. A missing one is named, with exit status 4.
set -euo pipefail

die() { echo "rdma-guest: $*" >&2; exit "${2:-1}"; }

[ $# -ge 3 ] && [ "$1" = run ] || die "usage: $0 run DIR SCRIPT [EXE...]"
dir=$2
script=$3
shift 3

for tool in qemu-system-x86_64 apt-get apt-cache dpkg-deb ldd gzip; do
  command -v "$tool" >/dev/null || die "$tool is missing" 4
done
rdma_tool=$(command -v rdma || true)
[ -n "$rdma_tool" ] || die "rdma is missing (Debian package iproute2)" 4
provider=$(find /usr/lib /usr/lib64 -name 'librxe-rdmav*.so' 2>/dev/null | head -1)
[ -n "$provider" ] && [ -f /etc/libibverbs.d/rxe.driver ] ||
  die "the rxe verbs provider is missing (Debian package ibverbs-providers)" 4

mkdir -p "$dir/debs"
dir=$(cd "$dir" && pwd)

# Debian's current kernel and busybox, fetched once.
if [ ! -f "$dir/kernel.ok" ]; then
  kernel_of() {
    apt-cache depends linux-image-amd64 2>/dev/null |
      awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
  }
  kernel_pkg=$(kernel_of)
  if [ -z "$kernel_pkg" ] && [ "$(id -u)" = 0 ]; then
    # No package lists yet (a fresh machine whose packages were all installed).
    apt-get update -qq >/dev/null 2>&1 || true
    kernel_pkg=$(kernel_of)
  fi
  [ -n "$kernel_pkg" ] || die "apt-cache names no kernel for linux-image-amd64 (apt-get update?)" 4
  rm -rf "$dir/debs"/* "$dir/k" "$dir/bb"
  (cd "$dir/debs" && apt-get download -q "$kernel_pkg" busybox-static >/dev/null 2>&1) ||
    die "apt-get download $kernel_pkg busybox-static failed" 4
  mkdir -p "$dir/k" "$dir/bb"
  dpkg-deb -x "$dir"/debs/linux-image-*.deb "$dir/k"
  dpkg-deb -x "$dir"/debs/busybox-static_*.deb "$dir/bb"
  touch "$dir/kernel.ok"
fi
kver=$(ls "$dir/k/lib/modules" | head -1)
kmods=$dir/k/lib/modules/$kver
vmlinuz=$dir/k/boot/vmlinuz-$kver
[ -f "$vmlinuz" ] || die "no kernel in $dir/k/boot"

# Modules in load order: each after those its .modinfo depends on.
modules=$(python3 - "$kmods" <<'EOF'
import os, re, sys
base = sys.argv[1]
index = {}
for root, _, files in os.walk(base):
    for f in files:
        for ext in (".ko", ".ko.xz", ".ko.zst"):
            if f.endswith(ext):
                index[f[: -len(ext)].replace("-", "_")] = os.path.join(root, f)
def deps(m):
    data = open(index[m], "rb").read()
    found = re.search(rb"depends=([^\x00]*)\x00", data)
    return [d.replace("-", "_") for d in found.group(1).decode().split(",") if d] if found else []
order = []
def visit(m):
    if m in order:
        return
    if m not in index:
        sys.exit(f"no module {m}")
    for d in deps(m):
        visit(d)
    order.append(m)
# rxe computes its ICRC with the crypto API's crc32; iscsi_tcp its digests with crc32c.
# Linux's own SRP and iSER initiators (ib_srp, ib_iser) and SCSI disks (sd_mod), as peers;
# its iSCSI/TCP initiator with ALUA and dm-multipath (iscsi_tcp, scsi_dh_alua, dm_multipath,
# dm_round_robin), as a multipath host runs them.
# Linux's NVMe/TCP host (nvme_tcp, with native multipath in nvme_core) and its NVMe/TCP
# target (nvmet_tcp), as a peer to compare with; its NVMe/RDMA host (nvme_rdma).
for m in ["crc32_generic", "crc32c_generic", "virtio_pci", "virtio_net", "rdma_rxe", "ib_uverbs", "rdma_ucm",
          "ib_srp", "ib_iser", "sd_mod", "target_core_file", "scsi_dh_alua", "iscsi_tcp",
          "dm_multipath", "dm_round_robin", "nvme_tcp", "nvmet_tcp", "nvme_rdma"]:
    visit(m)
# Linux's SRP target, loaded by a script that wants it (with its parameters): what it
# needs is loaded.
extra = ["ib_srpt"]
for m in extra:
    for d in deps(m):
        visit(d)
for m in order:
    print(index[m])
for m in extra:
    print("extra:" + index[m])
EOF
)

root=$dir/root
rm -rf "$root"
mkdir -p "$root"/{bin,etc/libibverbs.d,proc,sys,dev,tmp,lib/modules}
cp "$dir/bb/bin/busybox" "$root/bin/busybox"
for a in sh mount insmod ip poweroff cat echo ls sleep dmesg dd cmp wget grep head tail seq sync kill \
  mkdir rm printf find ln cut awk timeout tr basename od blkdiscard wc; do
  ln -sf busybox "$root/bin/$a"
done
: >"$root/modules.order"
mkdir -p "$root/lib/modules/extra"
for m in $modules; do
  case $m in
    extra:*.ko) cp "${m#extra:}" "$root/lib/modules/extra/" ;;
    *.ko) cp "$m" "$root/lib/modules/"; basename "$m" >>"$root/modules.order" ;;
    *) die "compressed module $m: not supported" ;;
  esac
done
# A program and the shared libraries it links, at the host's paths.
with_libs() {
  local from=$1 to=$2
  mkdir -p "$root$(dirname "$to")"
  cp -L "$from" "$root$to"
  ldd "$from" 2>/dev/null | grep -o '/[^ )]*' | while read -r lib; do
    [ -e "$root$lib" ] && continue
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}
for e in "$@"; do
  [ -x "$e" ] || die "$e is not an executable"
  with_libs "$e" "/bin/$(basename "$e")"
done
with_libs "$rdma_tool" /bin/rdma
with_libs "$provider" "$provider"
cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
cp "$script" "$root/script"
# Helpers SCRIPT may call (sourced before it runs).
cat >"$root/guest.sh" <<'EOF'
# fail WHAT: says so, shows the kernel's and the daemon's last words, and ends the script.
fail() {
  echo "$1"
  dmesg | tail -n 30
  [ -f /tmp/iscsid.log ] && cat /tmp/iscsid.log
  [ -f /tmp/targetd.log ] && tail -n 30 /tmp/targetd.log
  exit 1
}
# start_targetd CONFIG: runs /bin/targetd on CONFIG (logging to /tmp/targetd.log, its pid in
# $daemon) and waits for its metrics endpoint, which CONFIG puts on 127.0.0.1:9100.
start_targetd() {
  /bin/targetd "$1" > /tmp/targetd.log 2>&1 &
  daemon=$!
  for i in $(seq 1 100); do wget -qO /dev/null http://127.0.0.1:9100/metrics && return 0; sleep 0.1; done
  fail "targetd did not start"
}
# start_iscsid INITIATOR [CONF]: open-iscsi's iscsid for initiator name INITIATOR, its
# iscsid.conf `node.startup = manual` and then CONF's lines (printf's escapes), its log in
# /tmp/iscsid.log. iscsid lets only root's iscsiadm in, by name: /etc/passwd and /etc/group
# name root.
start_iscsid() {
  mkdir -p /etc/iscsi/nodes /etc/iscsi/send_targets /etc/iscsi/ifaces /run/lock/iscsi /var/lock /var/lib/iscsi
  echo "InitiatorName=$1" > /etc/iscsi/initiatorname.iscsi
  echo "root:x:0:0:root:/root:/bin/sh" > /etc/passwd
  echo "root:x:0:" > /etc/group
  printf "node.startup = manual\n${2:-}" > /etc/iscsi/iscsid.conf
  /bin/iscsid -f > /tmp/iscsid.log 2>&1 &
  sleep 1
}
# wait_ns NSID: waits (30 s at most) for the block device of NVMe namespace NSID
# (/dev/nvme*n$1) and sets $ns.
wait_ns() {
  ns=
  for i in $(seq 1 300); do
    for b in /sys/block/nvme*n$1; do [ -e "$b" ] && ns=/dev/${b##*/}; done
    [ -n "$ns" ] && [ -e "$ns" ] && return 0
    sleep 0.1
  done
  fail "no namespace $1 appeared"
}
# find_disk WHO: waits for the SCSI disk an initiator made and sets $disk.
find_disk() {
  disk=
  for i in $(seq 1 200); do
    for b in /sys/block/sd*; do [ -e "$b" ] && disk=/dev/${b##*/}; done
    [ -n "$disk" ] && [ -e "$disk" ] && break
    sleep 0.1
  done
  [ -n "$disk" ] || fail "$1 made no disk"
  echo "$1: logged in, $disk"
}
# check_disk WHO: 8 MiB written to $disk in 4 KiB direct writes and read back, then in 1 MiB.
check_disk() {
  dd if=/dev/urandom of=/tmp/a bs=1048576 count=8 2>/dev/null
  dd if=/tmp/a of=$disk bs=4096 oflag=direct 2>/dev/null || fail "$1: writes failed"
  dd if=$disk of=/tmp/b bs=65536 count=128 iflag=direct 2>/dev/null
  cmp /tmp/a /tmp/b && echo "$1: 8 MiB written in 4 KiB writes and read back" || fail "$1: data differ"
  dd if=/dev/urandom of=/tmp/a bs=1048576 count=8 2>/dev/null
  dd if=/tmp/a of=$disk bs=1048576 oflag=direct 2>/dev/null || fail "$1: writes failed"
  dd if=$disk of=/tmp/b bs=1048576 count=8 iflag=direct 2>/dev/null
  cmp /tmp/a /tmp/b && echo "$1: 8 MiB written in 1 MiB writes and read back" || fail "$1: data differ"
}
EOF
cat >"$root/init" <<'EOF'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in $(cat /modules.order); do
  insmod "/lib/modules/$m" || echo "rdma-guest: insmod $m failed"
done
# configfs (a module here) is there once the targets that need it are loaded.
mount -t configfs none /sys/kernel/config 2>/dev/null
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
if rdma link add rxe0 type rxe netdev eth0; then
  rdma link
  cd /tmp
  RDMA_ADDR=10.0.2.15 sh -c '. /guest.sh; . /script'
  echo "GUEST-EXIT $?"
else
  dmesg | tail -n 20
  echo "rdma-guest: no rxe device"
  echo "GUEST-EXIT 5"
fi
poweroff -f
EOF
chmod +x "$root/init"
if command -v cpio >/dev/null; then
  (cd "$root" && find . | cpio -o -H newc 2>/dev/null | gzip -1 >"$dir/initrd.gz")
else
  (cd "$root" && find . | "$root/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1 >"$dir/initrd.gz")
fi

log=$dir/console.log
set +e
timeout "${RDMA_GUEST_TIMEOUT:-300}" qemu-system-x86_64 -accel tcg,thread=multi -smp 2 -m 2048 \
  -nographic -no-reboot -kernel "$vmlinuz" -initrd "$dir/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1" \
  -netdev user,id=n0 -device virtio-net-pci,netdev=n0 </dev/null >"$log" 2>&1
qemu=$?
set -e
# The console, without the firmware's screen codes.
tr -d '\r' <"$log" | sed -e 's/\x1b\[[0-9;?]*[a-zA-Z]//g'
[ "$qemu" -ne 124 ] || exit 3
status=$(tr -d '\r' <"$log" | sed -n 's/^GUEST-EXIT \([0-9]*\).*/\1/p' | tail -1)
exit "${status:-2}"
