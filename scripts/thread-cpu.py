#!/usr/bin/env python3
"""Where a process's CPU goes, by thread, while a command runs: the CPU time each of PID's
threads (summed by thread name: `reactor-0`, librados' `msgr-worker-*` and `io_context_pool`,
...) used from the command's start to its end, from /proc/PID/task/*/stat. When the command
prints initiator-bench's `--json` report, the times are also given per I/O.

    scripts/thread-cpu.py PID -- COMMAND [ARGS...]

For example, targetd's threads during 10 s of 4 KiB random writes to an RBD LUN:

    scripts/thread-cpu.py "$(pgrep -f 'targetd t.toml')" -- initiator-bench run \\
        iscsi://127.0.0.1:3260/iqn.2026-11.io.example:t/0 --rw randwrite --bs 4k --qd 32 \\
        --time 10s --json

Thread times are in clock ticks (usually 10 ms): run for several seconds.
"""
import json
import os
import subprocess
import sys

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid):
    """CPU seconds (user + system) per thread name of process `pid`."""
    by_name = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        # The fields after the command name (which may hold spaces) in parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        utime, stime = int(fields[11]), int(fields[12])
        by_name[name] = by_name.get(name, 0.0) + (utime + stime) / TICK
    return by_name


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    pid = int(sys.argv[1])
    before = threads(pid)
    run = subprocess.run(sys.argv[3:], stdout=subprocess.PIPE, text=True)
    after = threads(pid)
    sys.stdout.write(run.stdout)
    ios = None
    try:
        ios = json.loads(run.stdout).get("ios")
    except (ValueError, AttributeError):
        pass
    used = {n: after[n] - before.get(n, 0.0) for n in after}
    used = {n: s for n, s in used.items() if s > 0}
    total = sum(used.values())
    for name, secs in sorted(used.items(), key=lambda x: -x[1]) + [("total", total)]:
        line = f"{name:<20} {secs:8.2f} s"
        if ios:
            line += f"  {secs * 1e6 / ios:8.1f} us per I/O"
        print(line)
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
