"""``pdpool bench`` plots for docs/performance.md (issue 11): shared-prefix workload on CPU, in one invocation.

    flock -x /tmp/cpu.lock .venv/bin/python benchmarks/bench_plots.py [--images docs/images] [--out /tmp/bench-plots]

Three pools, each two demo node processes and the router on one Redis, with the built-in example's node and
router flags (``pdpool.up.pool.plan``: ``--max-num-seqs 8 --max-num-batched-tokens 512 --num-threads 1``, UCX over
tcp) so that only what is compared differs:

- ``disaggregated``: 1 prefill + 1 decode node (the ``pdpool up`` example), the default scheduler;
- ``colocated``: 2 ``--role both`` nodes, the default scheduler (prefix-aware, load-aware);
- ``colocated, round-robin``: the same 2 nodes, the router with ``--picker round-robin``.

The colocated pool has the same number of node processes, each with one torch thread, so on 2 cores both pools
get the same CPU; each node of either pool runs a NIXL agent (a pool node with Redis runs the KV connector).
Every run sends fresh system prompts (its own ``--seed``), so none profits from another's cache, after
``--concurrency`` unrelated warm-up requests that are not measured.
``pdpool bench compare`` then draws disaggregated vs colocated and prefix-aware vs round-robin on the same axes;
with ``--images`` the PNGs are copied there as ``bench-disagg-vs-colocated-*.png`` and
``bench-prefix-vs-round-robin-*.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from redis_server import RedisServer  # noqa: E402

from pdpool.node_process import NodeProcess, http_get, parse_metrics  # noqa: E402
from pdpool.up.pool import load_pool, node_spec, router_spec, shared_env  # noqa: E402

PDPOOL = str(Path(sys.executable).parent / "pdpool")


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def start_nodes(pool, roles: list[str], redis_url: str, env: dict, log_dir: Path) -> list[NodeProcess]:
    """One node process per role; ``both`` takes the prefill node's flags with ``--role both``."""
    nodes = []
    for i, role in enumerate(roles):
        name = f"{role}-{roles[:i].count(role)}"
        node = NodeProcess(name)
        spec = node_spec(pool, "prefill" if role == "both" else role, i, node.port, redis_url, [])
        argv = with_flag(with_flag(spec.argv, "--role", role), "--node-id", name)
        nodes.append(node.launch(argv, {**env, **spec.env}, log_dir / f"{name}.log"))
    for node in nodes:
        node.wait_ready(600)
    return nodes


def start_router(pool, redis_url: str, env: dict, log_path: Path, extra: list[str], roles: list[str]) -> NodeProcess:
    """The router, once it serves and sees every node as usable."""
    router = NodeProcess("router")
    spec = router_spec(pool, "127.0.0.1", router.port, redis_url)
    router.launch([*spec.argv, *extra], env, log_path).wait_ready(120)
    deadline = time.monotonic() + 60
    while True:
        status, body = http_get(router.url + "/metrics", timeout=5)
        m = parse_metrics(body.decode()) if status == 200 else {}
        if all(m.get(f'pdpool_router_nodes{{role="{role}",usable="true"}}', 0) >= n
               for role, n in Counter(roles).items()):
            return router
        if time.monotonic() > deadline:
            router.stop()
            raise TimeoutError(f"the router does not see the nodes {roles}:\n{router.log_tail()}")
        time.sleep(0.5)


def warm_up(args, url: str) -> None:
    """A pool's first requests pay one-time costs (the first KV transfer's UCX wire-up, first kernel calls): send
    ``--concurrency`` short unrelated requests first, not measured."""
    subprocess.run([PDPOOL, "bench", "--url", url, "--model", "demo", "--tokenizer", "none", "--random-input-len",
                    "64", "--random-output-len", "4", "--num-requests", str(args.concurrency), "--seed", "99",
                    "--no-progress"], check=True, cwd="/tmp", stdout=subprocess.DEVNULL)


def bench(args, url: str, label: str, seed: int, out: Path) -> dict:
    warm_up(args, url)
    cmd = [PDPOOL, "bench", "--url", url, "--model", "demo", "--tokenizer", "demo", "--dataset", "shared-prefix",
           "--num-groups", str(args.num_groups), "--prompts-per-group", str(args.prompts_per_group),
           "--system-prompt-len", str(args.system_prompt_len), "--question-len", str(args.question_len),
           "--output-len", str(args.output_len), "--ignore-eos", "--concurrency", str(args.concurrency),
           "--seed", str(seed), "--slo", args.slo, "--label", label, "--out", str(out), "--no-progress"]
    done = subprocess.run(cmd, cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout, flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"pdpool bench failed ({done.returncode})")
    return json.loads((out / "bench.json").read_text())["runs"][0]["summary"]


def compare(results: list[Path], out: Path, images: Path | None, name: str) -> None:
    subprocess.run([PDPOOL, "bench", "compare", *map(str, results), "--out", str(out)], check=True, cwd="/tmp",
                   stdout=subprocess.DEVNULL)
    if images is not None:
        images.mkdir(parents=True, exist_ok=True)
        for png in ("latency_cdf.png", "ttft_over_time.png"):
            shutil.copy(out / png, images / f"{name}-{png.replace('_', '-')}")


def row(label: str, s: dict) -> str:
    return (f"| {label} | {s['completed']} | {s['request_throughput']:.3f} | {s['output_throughput']:.2f} | "
            f"{s['ttft_ms']['mean']:.0f} | {s['ttft_ms']['p90']:.0f} | {s['tpot_ms']['mean']:.0f} | "
            f"{s['tpot_ms']['p90']:.0f} | {s['prefix_cache_hit_ratio']:.3f} | {s['goodput']:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=6)
    ap.add_argument("--system-prompt-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--slo", default="ttft=5000,tpot=500", help="for goodput (ms)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-plots"))
    ap.add_argument("--images", type=Path, default=None, help="copy the compare PNGs here (docs/images)")
    args = ap.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    logs = args.out / "logs"
    logs.mkdir(parents=True)
    pool, _ = load_pool(None)
    summaries = {}
    with RedisServer() as redis:
        env = {**os.environ, **shared_env(pool, None, secrets.token_hex(16))}
        setups = [("disaggregated", ["prefill", "decode"], [[]]),
                  ("colocated", ["both", "both"], [[], ["--picker", "round-robin"]])]
        seed = 0
        for name, roles, routers in setups:
            nodes = start_nodes(pool, roles, redis.url, env, logs)
            try:
                for extra in routers:
                    label = name + (", round-robin" if extra else "")
                    slug = label.replace(", ", "-")
                    router = start_router(pool, redis.url, env, logs / f"router-{slug}.log", extra, roles)
                    try:
                        print(f"==== {label}: {', '.join(n.name for n in nodes)} behind {router.url}", flush=True)
                        summaries[label] = bench(args, router.url, label, seed, args.out / slug)
                        seed += 1
                    finally:
                        router.stop()
            finally:
                for node in nodes:
                    node.stop()
    compare([args.out / "disaggregated", args.out / "colocated"], args.out / "compare-disagg", args.images,
            "bench-disagg-vs-colocated")
    compare([args.out / "colocated", args.out / "colocated-round-robin"], args.out / "compare-routing",
            args.images, "bench-prefix-vs-round-robin")
    print(f"| pool | done | req/s | out tok/s | TTFT mean | TTFT p90 | TPOT mean | TPOT p90 | prefix hits | "
          f"goodput ({args.slo}) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, s in summaries.items():
        print(row(label, s))
    (args.out / "summaries.json").write_text(json.dumps(summaries, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
