"""Routing quality on the shared-prefix workload: 3 demo nodes (role both) behind pdpool router with the default
scheduler, round-robin and random pickers, all in one run. Reports the realized prefix-hit ratio (the nodes'
counters), TTFT mean and p90 (streaming, first content event) and throughput.

    python benchmarks/router_quality.py [--groups 8 --per-group 12 --concurrency 8 --system-words 512
                                         --question-words 32 --num-kv-blocks 160 --max-model-len 1024]

Workload (the shape of inference-perf's ``shared_prefix``): ``groups`` system prompts of ``system-words`` words
(one token each with the demo tokenizer: 512 tokens, 32 blocks of 16), each followed by ``per-group`` questions
of ``question-words`` words, sent interleaved (group 0, 1, ..., 7, 0, 1, ...) by ``concurrency`` clients, 8
output tokens each, after an unmeasured warm-up of one request per group (as load generators warm up; every
scheduler gets one, through its own routing). Each node's KV cache (``num-kv-blocks``, 160 blocks) holds 5 of
the 8 groups' system prompts: enough for the ~3 groups a node serves under prefix affinity plus its running
requests (about 3 x 32 + 8 x 3 = 120 blocks), not enough for every group, so where a group's requests land
decides whether its prefix is computed once or again and again. Each scheduler gets fresh system prompts, so no
run profits from the cache of the one before.
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


def workload(tag: str, groups: int, per_group: int, system_words: int, question_words: int
             ) -> tuple[list[str], list[str]]:
    """(warm-up prompts: one per group, measured prompts: ``per_group`` per group, interleaved)."""
    rng = random.Random(tag)
    systems = [f"[{tag} {g}] " + " ".join(rng.choices(WORDS, k=system_words)) for g in range(groups)]
    warm = [f"{system}\nWarm-up: {' '.join(rng.choices(WORDS, k=question_words))}?" for system in systems]
    reqs = [f"{systems[g]}\nQ{i}: {' '.join(rng.choices(WORDS, k=question_words))}?"
            for i in range(per_group) for g in range(groups)]  # interleaved groups
    return warm, reqs


def achievable_hit_ratio(prompts: list[str], groups: int, block_size: int = 16) -> tuple[float, float]:
    """(mean prompt tokens, the hit ratio of a perfect router with unbounded caches): after the warm-up, every
    request reuses the full blocks its group shares."""
    from pdpool.frontend import Frontend

    tok = Frontend.from_model("demo").tokenizer
    ids = [tok.encode(p, True) for p in prompts]
    hits = 0
    for g in range(groups):
        members = ids[g::groups]
        common = min(len(os.path.commonprefix([members[0], m])) for m in members[1:]) if len(members) > 1 else 0
        hits += len(members) * (common // block_size) * block_size  # after the warm-up, every request
    total = sum(len(i) for i in ids)
    return total / len(ids), hits / total


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
    ap.add_argument("--num-kv-blocks", type=int, default=160)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--system-words", type=int, default=512)
    ap.add_argument("--question-words", type=int, default=32)
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
                                       "--max-model-len", str(args.max_model_len),
                                       "--num-kv-blocks", str(args.num_kv_blocks)]),
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
                warm, prompts = workload(name, args.groups, args.per_group, args.system_words, args.question_words)
                mean_tokens, achievable = achievable_hit_ratio(prompts, args.groups)
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:  # not measured
                    list(ex.map(lambda p: ttft(r.url, p, args.max_tokens), warm))
                before = [n.metrics() for n in nodes]
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
                (log_dir / f"ttft-{name}.json").write_text(json.dumps(ttfts))  # in request order, for a look
                results.append({"scheduler": name, "hit_ratio": round(hit / max(1, queried), 3),
                                "achievable_hit_ratio": round(achievable, 3), "prompt_tokens": round(mean_tokens),
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
