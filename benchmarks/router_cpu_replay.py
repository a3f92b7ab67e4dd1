"""The router's CPU per request, old tree against new tree, with a resolution fine enough for single cuts.

    python benchmarks/router_cpu_replay.py --trees HEAD~1 . [--requests 1500] [--repeats 8] [--concurrency 1]

Each tree (a git revision, ``.`` for the working tree, or a folder already flattened) is flattened into a snapshot under ``--work`` (the
packages laid out as ``pyproject.toml``'s package-dir maps them: ``router/`` becomes ``pdpool/router/``) and run as
the real ``pdpool router`` (``--workers 1``, ``PYTHONPATH`` = the snapshot): its HTTP server, handlers, front end,
scheduler, index mirror, metrics and log line, behind one real Redis and two real stub upstreams
(``benchmarks/router_stub_upstream.py``) that heartbeat and publish their prefix caches through ``NodeIndex`` as
nodes do. The load is ``router_overhead.py``'s bodies (about 1k tokens: one of 8 shared system prompts and a fresh
question per request), sent closed-loop at a fixed ``--concurrency`` (1: each request alone, as at 200 req/s,
where a request rarely meets another in the router) over keep-alive connections of the router's own HTTP/1.1
client.

All routers run at once and get the same requests, interleaved: each body goes to every router in turn (A then B,
the next body B then A), so old and new share the machine's state of the moment (other processes, caches, clock)
request by request, and the difference between them is not buried under the run-to-run spread of separate runs
(0.5-1 ms of CPU per request in round 6's A/Bs). A repeat is ``--requests`` bodies; what is measured is each
router process's CPU time over the repeat (every thread: ``/proc/PID/task/*/schedstat``, in ns; ``/proc/PID/stat``
counts 10 ms ticks), divided by the requests it answered: µs per request, including its background work over the
same time (index mirror, discovery), which every tree has alike. The output gives every repeat, each tree's
median, and for each tree after the first its per-repeat difference to the first, with their median and
spread. ``--trees X X`` (the same tree twice) measures the method's own noise: its differences are what
"no change" looks like.

Run it under the exclusive CPU lock: ``flock -x /tmp/cpu.lock .venv/bin/python benchmarks/router_cpu_replay.py ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402  (the bodies, the spawner, Redis, wait helpers)

ROOT = Path(__file__).resolve().parents[1]
# package -> folder in the checkout, as pyproject.toml's [tool.setuptools] package-dir
PACKAGE_DIRS = {"pdpool": "pdpool", "pdpool/operator": "operator", "pdpool/router": "router",
                "pdpool/prefill_node": "prefill_node", "pdpool/decode_node": "decode_node",
                "pdpool/kernels": "kernels"}


def snapshot(tree: str, dest: Path) -> str:
    """Flatten ``tree`` (a git revision, or ``.`` for the working tree as it is now) into ``dest``; returns a
    description (the commit, or 'working tree of <HEAD>')."""
    if dest.exists():
        shutil.rmtree(dest)
    if (Path(tree) / "pdpool" / "router").is_dir():   # already flattened (a scratch variant): used as it is
        shutil.copytree(tree, dest, ignore=shutil.ignore_patterns("__pycache__"))
        return f"snapshot {tree}"
    dest.mkdir(parents=True)
    folders = sorted(set(PACKAGE_DIRS.values()))
    if tree == ".":
        for package, folder in sorted(PACKAGE_DIRS.items()):
            shutil.copytree(ROOT / folder, dest / package, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        return f"working tree of {head}"
    commit = subprocess.run(["git", "rev-parse", "--short", tree], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    data = subprocess.run(["git", "archive", "--format=tar", commit, *folders], cwd=ROOT, capture_output=True,
                          check=True).stdout
    raw = dest / ".raw"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(raw, filter="data")
    for package, folder in sorted(PACKAGE_DIRS.items()):
        if (raw / folder).exists():
            shutil.copytree(raw / folder, dest / package, dirs_exist_ok=True)
    shutil.rmtree(raw)
    return commit


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` in ns (schedstat's first field; /proc/PID/stat counts in 10 ms ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            pass   # a thread that ended meanwhile (the router's threads live as long as it does)
    return total


async def closed_loop(urls: list[str], bodies: list[bytes], concurrency: int,
                      rate: float = 0.0) -> tuple[list[int], int, float, list[list[float]]]:
    """Send every body to every URL through ``concurrency`` lanes, each on keep-alive connections: a lane takes the
    next body and sends it to each URL in turn, each after the previous answer, the order rotated by one per body
    (with two trees: A then B, then B then A), so every router gets the same requests in the same machine state.
    ``rate`` > 0 paces the bodies: body k starts no earlier than k / rate seconds after the first (each router then
    gets about ``rate`` requests per second, and its background work, e.g. the index mirror's reads, weighs per
    request as at that rate; a lane that falls behind goes on at once). Returns (answered with 200, per URL),
    failed, seconds, and per URL the latency of each answered request in µs (request sent -> body read)."""
    from pdpool.router.http1 import HTTPClientError, Http1Client

    headers = {"Content-Type": "application/json"}
    client = Http1Client()
    ok = [0] * len(urls)
    latency: list[list[float]] = [[] for _ in urls]
    failed = 0
    it = iter(enumerate(bodies))
    t0 = time.perf_counter()

    async def lane() -> None:
        nonlocal failed
        for k, body in it:
            if rate > 0 and (wait := t0 + k / rate - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            for j in range(len(urls)):
                i = (k + j) % len(urls)
                try:
                    sent = time.perf_counter()
                    r = await client.request(urls[i], body, headers, timeout=60, connect_timeout=10)
                    try:
                        await r.read()
                    finally:
                        r.close()
                    if r.status == 200:
                        ok[i] += 1
                        latency[i].append(1e6 * (time.perf_counter() - sent))
                    else:
                        failed += 1
                except (HTTPClientError, asyncio.TimeoutError):
                    failed += 1

    try:
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    finally:
        client.close()
    return ok, failed, time.perf_counter() - t0, latency


def mad(xs: list[float]) -> float:
    m = statistics.median(xs)
    return statistics.median(abs(x - m) for x in xs)


async def main_async(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = [f"{i}:{t}" for i, t in enumerate(args.trees)]
    described = {}
    for name, tree in zip(names, args.trees):
        described[name] = snapshot(tree, work / f"tree{name.split(':')[0]}")
    print(json.dumps({"trees": described, "requests": args.requests, "repeats": args.repeats,
                      "concurrency": args.concurrency, "rate": args.rate, "warmup": args.warmup}), flush=True)
    procs: list[subprocess.Popen] = []
    spawn = ro.spawner(procs, work / "logs")
    try:
        redis, redis_url = ro.start_redis(spawn, args.redis_server)
        stubs, _ = ro.start_stubs(spawn, redis_url, "--pool", "replay")
        for s in stubs:
            await ro.wait_http(s + "/health")
        routers = {}
        for name in names:
            port = ro.free_port()
            env = dict(os.environ, PYTHONPATH=str(work / f"tree{name.split(':')[0]}"))
            argv = [sys.executable, "-m", "pdpool.cli", "router", "--model", "demo", "--host", "127.0.0.1",
                    "--port", str(port), "--redis", redis_url, "--pool", "replay", "--dtype", "float32",
                    "--workers", "1", *args.router_args]
            log = open(work / "logs" / f"router-{name.split(':')[0]}.log", "wb")
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/tmp",
                                 env=env)
            procs.append(p)
            routers[name] = (p, f"http://127.0.0.1:{port}")
        urls = [routers[n][1] + "/v1/completions" for n in names]
        for name, (p, url) in routers.items():
            await ro.wait_http(url + "/health/ready")
            await ro.wait_completion(url + "/v1/completions", 60)
        await closed_loop(urls, ro.bodies_for(args.warmup, -7), args.concurrency)

        cpu: dict[str, list[float]] = {n: [] for n in names}
        p50: dict[str, list[float]] = {n: [] for n in names}   # each repeat's median latency, µs
        for rep in range(args.repeats):
            before = [process_cpu_ns(routers[n][0].pid) for n in names]
            ok, failed, seconds, latency = await closed_loop(urls, ro.bodies_for(args.requests, 1000 + rep), args.concurrency,
                                                   args.rate)
            after = [process_cpu_ns(routers[n][0].pid) for n in names]
            row = {"repeat": rep, "ok": ok, "failed": failed, "seconds": round(seconds, 2)}
            for name, c0, c1, n_ok, lat in zip(names, before, after, ok, latency):
                cpu[name].append((c1 - c0) / 1000 / max(1, n_ok))
                p50[name].append(statistics.median(lat) if lat else float("nan"))
                row[name] = round(cpu[name][-1], 1)
                row[name + " p50 latency"] = round(p50[name][-1], 1)
            print(json.dumps(row), flush=True)
        summary = {"median_us": {n: round(statistics.median(v), 1) for n, v in cpu.items()},
                   "per_repeat_us": {n: [round(x, 1) for x in v] for n, v in cpu.items()},
                   "latency_p50_us": {n: round(statistics.median(v), 1) for n, v in p50.items()}}
        base = names[0]
        for name in names[1:]:
            diffs = [b - a for a, b in zip(cpu[base], cpu[name])]
            ratios = [b / a - 1 for a, b in zip(cpu[base], cpu[name])]
            summary[f"{name} minus {base}"] = {
                "per_repeat_us": [round(d, 1) for d in diffs], "median_us": round(statistics.median(diffs), 1),
                # the machine's level moves between repeats (other processes): the relative difference, in µs at
                # the base's median level, is steadier than the absolute one
                "per_repeat_percent": [round(100 * r, 2) for r in ratios],
                "median_percent": round(100 * statistics.median(ratios), 2),
                "median_relative_us": round(statistics.median(ratios) * statistics.median(cpu[base]), 1),
                "mad_us": round(mad(diffs), 1),
                "stdev_us": round(statistics.stdev(diffs), 1) if len(diffs) > 1 else None,
                "range_us": [round(min(diffs), 1), round(max(diffs), 1)],
                # the client's latency (what a request alone waits: the added p50's serial path), paired the same way
                "latency_p50_per_repeat_us": [round(b - a, 1) for a, b in zip(p50[base], p50[name])],
                "latency_p50_median_us": round(statistics.median(b - a for a, b in zip(p50[base], p50[name])), 1),
                "latency_p50_mad_us": round(mad([b - a for a, b in zip(p50[base], p50[name])]), 1)}
        print(json.dumps(summary, indent=1), flush=True)
    finally:
        ro.stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", default=["HEAD", "."],
                    help="git revisions, . for the working tree, or a folder holding a flattened snapshot (pdpool/router/...); "
                         "the first is the base of the differences")
    ap.add_argument("--requests", type=int, default=1500, help="requests per measurement")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rate", type=float, default=0.0,
                    help="bodies per second (each router gets this rate); 0: as fast as the routers answer")
    ap.add_argument("--warmup", type=int, default=200, help="requests before each measurement (not measured)")
    ap.add_argument("--work", default="/tmp/router-cpu-replay", help="snapshots and logs")
    ap.add_argument("--redis-server", default=None, help="the redis-server binary (default: the one on PATH)")
    ap.add_argument("--venvs", help=argparse.SUPPRESS)   # passed by benchmarks/router_device.sh's runner; unused
    ap.add_argument("--logs", help=argparse.SUPPRESS)    # the same; logs go under --work
    ap.add_argument("--router-args", nargs=argparse.REMAINDER, default=[],
                    help="more flags for every router (last on the line)")
    args = ap.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_async(args))
    else:
        uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
