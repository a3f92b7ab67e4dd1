"""Paired A/B of the router's precise prefix lookup: ``--index-lookup redis`` (one Lua round trip per request) vs
``--index-lookup mirror`` (the router-local mirror fed by the nodes' event stream), same stubs, same Redis.

    python benchmarks/router_index_ab.py [--rate 200] [--seconds 6] [--repeats 6] [--clients 32]

One Redis, two stub upstreams (``benchmarks/router_stub_upstream.py``) that heartbeat and publish their prefix
caches through ``NodeIndex`` as nodes do, and both routers (``--workers 1``) started once. Each repeat measures
the direct baseline (straight to a stub) and then each router in turn, alternating which goes first; the router
not measured is stopped with SIGSTOP meanwhile (so its mirror costs the machine nothing) and resumed before its
own 2 s warm-up. The workload is ``benchmarks/router_overhead.py``'s (about 1k tokens: one of 8 shared system
prompts and a fresh question per request). Per measurement: added p50/p99 (through the router minus straight
to a stub, the direct run of the same repeat), the router's CPU per request (its process group), and Redis's.
At the end, each router's predicted prefix-hit tokens over prompt tokens (from its /metrics), which shows that
both lookups saw the stubs' blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402  (the workload, the load generator, CPU accounting)

ROOT = Path(__file__).resolve().parents[1]
LOGS = Path("/tmp/router-index-ab-logs")


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def main_async(args) -> None:
    procs: list[subprocess.Popen] = []
    spawn = ro.spawner(procs, LOGS)
    try:
        redis, redis_url = ro.start_redis(spawn)
        stubs, _ = ro.start_stubs(spawn, redis_url, "--kv-blocks", str(args.kv_blocks))
        for s in stubs:
            await ro.wait_http(s + "/health")
        routers = {}
        for mode in ("redis", "mirror"):
            port = ro.free_port()
            p = spawn([sys.executable, "-m", "pdpool.cli", "router", "--model", "demo", "--host", "127.0.0.1",
                       "--port", str(port), "--redis", redis_url, "--pool", "bench", "--dtype", "float32",
                       "--index-lookup", mode, "--workers", str(args.workers)], f"router-{mode}")
            routers[mode] = (p, f"http://127.0.0.1:{port}")
        for mode, (p, url) in routers.items():
            await ro.wait_http(url + "/health/ready")
            await ro.wait_completion(url + "/v1/completions", 60)
            os.killpg(p.pid, signal.SIGSTOP)

        def bodies(n: int, seed: int) -> list[bytes]:
            return ro.bodies_for(n, seed, 0)

        n = int(args.rate * args.seconds)
        rows = []
        for rep in range(args.repeats):
            direct = await ro.load(stubs[0] + "/v1/completions", args.rate, args.seconds, bodies(n, 1000 + rep))
            order = ("redis", "mirror") if rep % 2 == 0 else ("mirror", "redis")
            for mode in order:
                p, url = routers[mode]
                os.killpg(p.pid, signal.SIGCONT)
                await ro.load(url + "/v1/completions", args.rate, 2, bodies(int(args.rate * 2), -1 - rep))  # warm-up
                c0, r0 = ro.cpu_seconds(p.pid), proc_cpu(redis.pid)
                lat = await ro.load(url + "/v1/completions", args.rate, args.seconds, bodies(n, 2000 + rep))
                c1, r1 = ro.cpu_seconds(p.pid), proc_cpu(redis.pid)
                os.killpg(p.pid, signal.SIGSTOP)
                row = {"repeat": rep, "lookup": mode, "ok": len(lat),
                       "p50_added_ms": ro.pct(lat, 0.5) - ro.pct(direct, 0.5),
                       "p99_added_ms": ro.pct(lat, 0.99) - ro.pct(direct, 0.99),
                       "direct_p50_ms": ro.pct(direct, 0.5),
                       "router_cpu_ms_per_req": (c1 - c0) / max(1, len(lat)) * 1000,
                       "redis_cpu_ms_per_req": (r1 - r0) / max(1, len(lat)) * 1000}
                rows.append(row)
                print(json.dumps(row), flush=True)
        for mode, (p, url) in routers.items():
            os.killpg(p.pid, signal.SIGCONT)
        for mode, (p, url) in routers.items():
            hits = metric_sum(url, "pdpool_router_prefix_predicted_hit_tokens_total")
            prompt = metric_sum(url, "pdpool_router_prompt_tokens_total")
            print(json.dumps({"lookup": mode, "predicted_hit_tokens_over_prompt_tokens": hits / max(1.0, prompt)}))

        def per_repeat(key: str) -> list[float]:
            by = {(r["repeat"], r["lookup"]): r[key] for r in rows}
            return [by[i, "mirror"] - by[i, "redis"] for i in range(args.repeats)]

        for key in ("p50_added_ms", "p99_added_ms", "router_cpu_ms_per_req", "redis_cpu_ms_per_req"):
            diffs = per_repeat(key)
            vals = {m: [r[key] for r in rows if r["lookup"] == m] for m in ("redis", "mirror")}
            print(json.dumps({"metric": key, "redis": [round(v, 3) for v in vals["redis"]],
                              "mirror": [round(v, 3) for v in vals["mirror"]],
                              "mirror_minus_redis": [round(d, 3) for d in diffs],
                              "median_diff": round(statistics.median(diffs), 3)}), flush=True)
    finally:
        ro.stop_all(procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200)
    p.add_argument("--seconds", type=float, default=6)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--workers", type=int, default=1, help="the routers' --workers")
    args = p.parse_args()
    ro.run(main_async(args), args.clients)


if __name__ == "__main__":
    main()
