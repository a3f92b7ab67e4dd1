"""Where a command's CPU time goes, by thread, and how much the host's hypervisor took (steal) meanwhile.

    python3 benchmarks/thread_cpu.py [--period 0.2] [--json OUT] -- python3 benchmarks/gpu_e2e.py ...

Runs the command and samples ``/proc`` every ``--period`` seconds: each descendant process's threads (name,
user + system CPU) and the host's ``/proc/stat`` counters. When the command ends it prints, for each process that
ran at least a second, its threads by CPU time, and the host's share of steal, iowait, idle and busy time over the
whole command. A thread that ended between two samples is counted up to its last sample. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def children_of(root: int) -> list[int]:
    """root and its descendants (from each process's parent id)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [p for p, pp in parent.items() if pp == pid]
    return found


def thread_times(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, user + system CPU seconds)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        out[int(tid)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / TICK)
    return out


def host_counters() -> list[int]:
    """user nice system idle iowait irq softirq steal, summed over CPUs (ticks)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--period", type=float, default=0.2)
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command after --")
    host0, t0 = host_counters(), time.monotonic()
    proc = subprocess.Popen(cmd)
    seen: dict[int, dict] = {}  # pid -> {"cmd": str, "threads": {tid: [name, cpu]}}
    while proc.poll() is None:
        for pid in children_of(proc.pid):
            entry = seen.get(pid)
            if entry is None:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                entry = seen[pid] = {"cmd": argv[:200], "threads": {}}
            for tid, (name, cpu) in thread_times(pid).items():
                entry["threads"][tid] = [name, cpu]
        time.sleep(args.period)
    wall = time.monotonic() - t0
    host1 = host_counters()
    delta = [b - a for a, b in zip(host0, host1)]
    total = sum(delta) or 1
    names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
    host = {n: round(100 * d / total, 2) for n, d in zip(names, delta)}
    summary = {"wall_s": round(wall, 1), "cpus": os.cpu_count(), "host_percent": host, "processes": []}
    print(f"\n=== thread_cpu: {wall:.1f} s wall, {os.cpu_count()} CPUs; host time: "
          + ", ".join(f"{n} {v}%" for n, v in host.items()))
    for pid, entry in seen.items():
        threads = sorted(entry["threads"].items(), key=lambda kv: -kv[1][1])
        cpu = sum(t[1] for _, t in threads)
        if cpu < 1.0:
            continue
        rows = [{"tid": tid, "name": name, "cpu_s": round(c, 2)} for tid, (name, c) in threads if c >= 0.05]
        summary["processes"].append({"pid": pid, "cmd": entry["cmd"], "cpu_s": round(cpu, 2), "threads": rows})
        print(f"--- pid {pid}, {cpu:.1f} s CPU in {len(threads)} threads: {entry['cmd'][:150]}")
        for r in rows[:12]:
            print(f"    {r['name']:<20} tid {r['tid']:<8} {r['cpu_s']:8.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
