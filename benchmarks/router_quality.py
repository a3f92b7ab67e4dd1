"""Routing quality on the shared-prefix workload: 3 demo nodes (role both) behind pdpool router with the default
scheduler, round-robin and random pickers, all in one run. Reports the realized prefix-hit ratio (the nodes'
counters), TTFT mean and p90 (streaming, first content event) and throughput.

    python benchmarks/router_quality.py [--groups 8 --per-group 12 --concurrency 8 --num-kv-blocks 64]

Each scheduler gets fresh system prompts, so no run profits from the cache of the one before.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from redis_server import RedisServer  # noqa: E402

from pdpool.node_process import NodeProcess  # noqa: E402

WORDS = "river mountain lantern harbor violet copper meadow falcon orchard glacier pepper saddle thunder".split()
SCHEDULERS = {"default": [], "round-robin": ["--picker", "round-robin"], "random": ["--picker", "random"]}


def workload(tag: str, groups: int, per_group: int) -> list[str]:
    rng = random.Random(tag)
    systems = [f"[{tag} {g}] " + " ".join(rng.choice(WORDS) for _ in range(120)) for g in range(groups)]
    reqs = [f"{systems[g]}\nQ{i}: {' '.join(rng.choice(WORDS) for _ in range(10))}?"
            for i in range(per_group) for g in range(groups)]  # interleaved groups
    return reqs


def ttft(url: str, prompt: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=300,
                      json={"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
        first = None
        for line in r.iter_lines():
            if line.startswith("data: ") and first is None:
                first = time.perf_counter() - t0
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    args = ap.parse_args()
    log_dir = Path("/tmp/router-quality-logs")
    log_dir.mkdir(exist_ok=True)
    nodes, routers = [], []
    with RedisServer() as redis:
        try:
            for i in range(3):
                n = NodeProcess(f"node-{i}")
                n.launch(n.serve_argv(["--role", "both", "--node-id", f"node-{i}", "--redis", redis.url,
                                       "--heartbeat-seconds", "0.2", "--dtype", "float32", "--block-size", "16",
                                       "--max-model-len", "512", "--num-kv-blocks", str(args.num_kv_blocks)]),
                         dict(os.environ), log_dir / f"node-{i}.log")
                nodes.append(n)
            for n in nodes:
                n.wait_ready(600)
            results = []
            for name, flags in SCHEDULERS.items():
                r = NodeProcess(f"router-{name}")
                r.launch(["router", "--model", "demo", "--host", "127.0.0.1", "--port", str(r.port), "--redis",
                          redis.url, "--dtype", "float32", "--discovery-seconds", "0.1", *flags],
                         dict(os.environ), log_dir / f"router-{name}.log")
                routers.append(r)
                r.wait_ready(120)
                before = [n.metrics() for n in nodes]
                prompts = workload(name, args.groups, args.per_group)
                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
                    ttfts = list(ex.map(lambda p: ttft(r.url, p, args.max_tokens), prompts))
                elapsed = time.perf_counter() - t0
                after = [n.metrics() for n in nodes]
                hit = sum(a["pdpool_prefix_cache_hit_tokens_total"] - b["pdpool_prefix_cache_hit_tokens_total"]
                          for a, b in zip(after, before))
                queried = sum(a["pdpool_prefix_cache_queried_tokens_total"]
                              - b["pdpool_prefix_cache_queried_tokens_total"] for a, b in zip(after, before))
                ts = sorted(ttfts)
                results.append({"scheduler": name, "hit_ratio": round(hit / max(1, queried), 3),
                                "ttft_mean_s": round(statistics.mean(ts), 3),
                                "ttft_p90_s": round(ts[int(0.9 * (len(ts) - 1))], 3),
                                "requests_per_s": round(len(prompts) / elapsed, 2)})
                print(json.dumps(results[-1]), flush=True)
            print(json.dumps(results, indent=1))
        finally:
            for p in routers + nodes:
                p.stop(grace=10)


if __name__ == "__main__":
    main()
