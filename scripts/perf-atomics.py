#!/usr/bin/env python3
"""How much of a program's own time sits right behind an atomic read-modify-write: the share
of its samples in a `perf record` whose instruction follows a `lock`-prefixed one or an
`xchg` (which locks implicitly), by function and instruction. A locked instruction waits for
the core's stores to drain, and a timer-driven sample lands on the instruction after it, so
this is where atomic operations (reference counts, lock words, shared counters) cost time.
Without a PMU (this project's virtual machine) perf samples by timer; the picture is the same.

    perf record -F 4999 -p "$(pgrep -f 'targetd t.toml')" -o perf.data -- sleep 4
    scripts/perf-atomics.py perf.data target/release/targetd

Needs perf, objdump and readelf.
"""
import collections
import re
import subprocess
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data, binary = sys.argv[1], sys.argv[2]
    name = binary.rsplit("/", 1)[-1]
    # The executable segment's offset-to-address delta in the file.
    delta = None
    for line in subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        f = line.split()
        if f and f[0] == "LOAD" and "E" in f[-2:-1][0]:
            delta = int(f[2], 16) - int(f[1], 16)
    if delta is None:
        sys.exit(f"{binary}: no executable LOAD segment")
    # Where perf saw the binary's executable mapping: [start(len) @ pgoff ...].
    mapping = None
    ips = collections.Counter()
    out = subprocess.run(["perf", "script", "-i", data, "-G", "--show-mmap-events",
                          "-F", "ip,dso"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "PERF_RECORD_MMAP" in line and name in line and "r-xp" in line:
            m = re.search(r"\[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+|0)", line)
            if m:
                mapping = (int(m.group(1), 16), int(m.group(3), 16))
            continue
        f = line.split()
        if len(f) == 2 and name in f[1]:
            ips[int(f[0], 16)] += 1
    if mapping is None:
        sys.exit(f"{data}: no executable mapping of {name}")
    start, pgoff = mapping
    # Each instruction, the one before it and its function.
    prev, ins, func = {}, {}, {}
    last, cur = None, None
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary], capture_output=True,
                         text=True, check=True).stdout
    for line in dis.splitlines():
        m = re.match(r"([0-9a-f]+) <(.*)>:", line)
        if m:
            cur = m.group(2)
            continue
        m = re.match(r"\s+([0-9a-f]+):\s+(.*)", line)
        if m:
            a = int(m.group(1), 16)
            ins[a], func[a] = m.group(2), cur
            if last is not None:
                prev[a] = last
            last = a
    total, behind = 0, collections.Counter()
    for ip, n in ips.items():
        a = ip - start + pgoff + delta
        total += n
        p = prev.get(a)
        if p is None:
            continue
        # `xchg %ax,%ax` is a two-byte no-op, not an exchange with memory.
        if ins[p].startswith("lock") or (ins[p].startswith("xchg") and "(" in ins[p]):
            behind[(func[p], ins[p])] += n
    if total == 0:
        sys.exit(f"{data}: no samples in {name}")
    atomic = sum(behind.values())
    print(f"{name}: {total} samples in its own code, {atomic} ({100 * atomic / total:.1f}%) "
          "right behind an atomic read-modify-write")
    demangle = subprocess.run(["c++filt"], input="\n".join(f for f, _ in behind),
                              capture_output=True, text=True).stdout.splitlines()
    names = dict(zip((f for f, _ in behind), demangle)) if demangle else {}
    for (f, i), n in behind.most_common(25):
        shown = re.sub(r"::h[0-9a-f]{16}$", "", names.get(f, f))
        print(f"{100 * n / total:5.1f}%  {i:32}  {shown[:100]}")


if __name__ == "__main__":
    main()
