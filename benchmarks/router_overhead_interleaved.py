"""Router overhead, all routers in one interleaved run: the p50 comparison of ``router_overhead.py`` without the
machine's drift between one router's turn and the next.

    python benchmarks/router_overhead_interleaved.py [--rate 200] [--segment 5] [--rounds 8] [--workers 1]

``router_overhead.py`` gives each router its whole turn in sequence, and on this shared 2-core machine the state
can move between turns (round 9's run R: sglang-router took 0.30 ms of CPU per request in one run and 0.66 a
minute later). Here every router (pdpool, vllm-router and sglang-router, each with ``cache_aware``) runs at once
behind the same two stubs and Redis, and the load visits them in short segments: round k sends ``--segment`` s at
``--rate`` to each target in turn, the direct baseline (straight to a stub) among them, in an order rotated by
one each round. Every segment has fresh questions (the bodies of ``router_overhead.py``: about 1k tokens, one of 8
shared system prompts). Idle routers are not stopped: each keeps its own background work (pdpool's index mirror,
the peers' health checks), which a router has anyway.

Output, per target: added p50 and p99 over all its segments (the target's pooled percentile minus the direct
baseline's), and CPU per request of each part (``router_overhead.Parts``) over its segments. Per pair (pdpool
against each peer): the difference of their p50 in each round, its median, and in how many rounds pdpool was
lower. The direct baseline cancels out of that difference, and the two routers of a round ran within seconds of
each other.

The stubs do their index work (hashing and publishing the blocks of the prompts they served) only for requests
that carry pdpool's token ids, at their next 10 ms step: it lands in pdpool's segments, at most one step into
the next segment.

Run it under the exclusive CPU lock: ``flock -x /tmp/cpu.lock .venv/bin/python benchmarks/router_overhead_interleaved.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402  (bodies, load, stubs, peers, CPU of the parts)


async def start_targets(spawn, redis_url: str, stubs: list[str], args) -> dict[str, tuple[str, int | None]]:
    """name -> (completions URL, pid of the router's process group; None for the direct baseline)."""
    targets: dict[str, tuple[str, int | None]] = {"direct": (stubs[0] + "/v1/completions", None)}
    port = ro.free_port()
    ours = spawn([sys.executable, "-m", "pdpool.cli", "router", "--model", "demo", "--host", "127.0.0.1",
                  "--port", str(port), "--redis", redis_url, "--pool", "bench", "--dtype", "float32",
                  "--workers", str(args.workers)], "pdpool")
    await ro.wait_http(f"http://127.0.0.1:{port}/health/ready")
    await ro.wait_completion(f"http://127.0.0.1:{port}/v1/completions", 60)
    targets[f"pdpool-w{args.workers}"] = (f"http://127.0.0.1:{port}/v1/completions", ours.pid)
    for name in args.peers:
        py = ro.peer_python(name, args.venvs)
        port = ro.free_port()
        p = spawn(ro.PEERS[name][1](py, port, stubs), name)
        try:
            await ro.wait_http(f"http://127.0.0.1:{port}/health", 120)
            await ro.wait_completion(f"http://127.0.0.1:{port}/v1/completions", 60)
        except TimeoutError:
            print(f"  {name} did not come up; its log: {args.logs / name}.log", file=sys.stderr)
            os.killpg(p.pid, signal.SIGTERM)
            continue
        targets[name] = (f"http://127.0.0.1:{port}/v1/completions", p.pid)
    return targets


async def run(args) -> dict:
    procs = []
    spawn = ro.spawner(procs, args.logs)
    try:
        redis, redis_url = ro.start_redis(spawn, args.redis_server)
        stubs, stub_pids = ro.start_stubs(spawn, redis_url)
        for s in stubs:
            await ro.wait_http(s + "/health")
        targets = await start_targets(spawn, redis_url, stubs, args)
        parts = ro.Parts(stub_pids, redis.pid)
        names = list(targets)
        per_segment = int(args.rate * args.segment)
        seed = 1000
        for name, (url, _) in targets.items():   # warm-up, its own questions
            await ro.load(url, args.rate, 2, ro.bodies_for(int(args.rate * 2), -seed))
            seed += 1
        lat = {n: [] for n in names}
        late = {n: [] for n in names}
        p50s = {n: [] for n in names}
        cpu = {n: {} for n in names}
        count = {n: 0 for n in names}
        started = time.strftime("%H:%M:%S", time.gmtime())
        for k in range(args.rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            for name in order:
                url, pid = targets[name]
                bodies = ro.bodies_for(per_segment, seed)
                seed += 1
                before = parts.snapshot(pid)
                got = await ro.load(url, args.rate, args.segment, bodies)
                used = ro.Parts.per_request(before, parts.snapshot(pid), len(bodies))
                for part, ms in used.items():
                    if part != "router_split":
                        cpu[name][part] = cpu[name].get(part, 0.0) + ms * len(bodies)
                count[name] += len(bodies)
                lat[name] += got
                late[name] += got.late
                p50s[name].append(ro.pct(sorted(got), 0.5))
            print(json.dumps({"round": k, "p50_ms": {n: round(p50s[n][-1], 3) for n in names}}), flush=True)
        for n in names:
            lat[n].sort()
            late[n].sort()
        base50, base99 = ro.pct(lat["direct"], 0.5), ro.pct(lat["direct"], 0.99)
        rows = {}
        for n in names:
            row = {"ok": len(lat[n]), "of": count[n], "p50_ms": round(ro.pct(lat[n], 0.5), 3),
                   "p99_ms": round(ro.pct(lat[n], 0.99), 3),
                   "cpu_ms_per_request": {p: round(v / count[n], 3) for p, v in cpu[n].items()},
                   "send_late_p99_ms": round(ro.pct(late[n], 0.99), 3)}
            if n != "direct":
                row["p50_added_ms"] = round(row["p50_ms"] - base50, 3)
                row["p99_added_ms"] = round(row["p99_ms"] - base99, 3)
            rows[n] = row
        ours = f"pdpool-w{args.workers}"
        pairs = {}
        for peer in names:
            if peer in ("direct", ours):
                continue
            diffs = [a - b for a, b in zip(p50s[ours], p50s[peer])]
            pairs[f"{ours} - {peer}"] = {"p50_diff_ms_median": round(statistics.median(diffs), 3),
                                         "rounds_pdpool_lower": sum(d < 0 for d in diffs), "rounds": len(diffs),
                                         "per_round_ms": [round(d, 3) for d in diffs]}
        return {"started_utc": started, "rate": args.rate, "segment_s": args.segment, "rounds": args.rounds,
                "targets": rows, "pairs": pairs}
    finally:
        ro.stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200)
    ap.add_argument("--segment", type=float, default=5, help="seconds per target per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1, help="pdpool router --workers")
    ap.add_argument("--clients", type=int, default=32, help="clients (connection pools), as router_overhead.py's")
    ap.add_argument("--peers", nargs="*", default=list(ro.PEERS), choices=list(ro.PEERS))
    ap.add_argument("--venvs", type=Path, default=ro.VENVS)
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/router-overhead-interleaved-logs"))
    args = ap.parse_args()
    ro.CLIENTS = args.clients
    try:
        import uvloop
        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
