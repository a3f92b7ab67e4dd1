"""Router overhead: two fast stub upstreams behind a router; added latency per request (p50, p99) and the
router's CPU per 100 req/s, at fixed open-loop rates, for pdpool router, vllm-router and sglang-router.

    python benchmarks/router_overhead.py --rates 200 1000 --seconds 20 [--workers 1 2] [--peers vllm-router sglang-router]

Conditions: prompts of about 1k tokens, pdpool with its default scorers and Redis on (the stubs heartbeat into
Redis as pdpool nodes, so every request does the precise prefix lookup), the peers with ``cache_aware``. Each peer
is installed benchmark-only in its own venv under /tmp/router-bench-venvs (pip, once; ``--venvs`` for another
folder, e.g. venvs made offline on a lent machine by ``benchmarks/router_device.sh``). Added latency = latency
through the router minus latency straight to a stub, percentile by percentile, in the same run.

CPU: every row gives ``cpu_ms_per_request`` for every part of the harness, from ``/proc`` over the timed run:
the router (its process group; ``router_split``: the supervisor's and each worker's share with ``--workers N``),
the two stubs, Redis, and the load generator (this process), so a saturated machine shows who takes the cores.
The stubs' index work (hashing a request's blocks and publishing them) runs only for requests that carry
pdpool's token ids, so it is in pdpool's rows and not in the peers' or the direct baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
VENVS = Path("/tmp/router-bench-venvs")
LOGS = Path("/tmp/router-overhead-logs")
# Both peers export Prometheus metrics on port 29000 by default: two of them (or anything else there) and the
# second panics at start ("failed to install Prometheus metrics exporter: Address already in use"), which is why
# sglang-router never answered in an earlier run. Each gets a free port, and each is stopped after its turn.
PEERS = {
    "vllm-router": ("vllm-router", lambda py, port, workers: [
        str(Path(py).parent / "vllm-router"), "--port", str(port), "--policy", "cache_aware",
        "--prometheus-port", str(free_port()), "--worker-urls", *workers]),
    "sglang-router": ("sglang-router", lambda py, port, workers: [
        py, "-m", "sglang_router.launch_router", "--port", str(port), "--policy", "cache_aware",
        "--prometheus-port", str(free_port()), "--worker-urls", *workers]),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_cpu(pgid: int) -> dict[int, float]:
    """User + system CPU seconds of every process in process group ``pgid``, by pid (each router, stub and Redis
    is spawned as a group leader: with ``--workers N`` that is the supervisor and its N workers; a thread's time
    is its process's)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:   # pgrp
            out[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def cpu_seconds(pid: int) -> float:
    return sum(group_cpu(pid).values())


class Parts:
    """CPU of every part of the harness over one measurement: the router (its process group), the stubs, Redis
    and the load generator (this process, all its threads), so a saturated machine shows who takes the cores."""

    def __init__(self, stubs: list[int], redis: int) -> None:
        self.stubs = stubs
        self.redis = redis

    def snapshot(self, router: int | None) -> dict:
        return {"router": group_cpu(router) if router else {}, "stubs": sum(cpu_seconds(p) for p in self.stubs),
                "redis": cpu_seconds(self.redis), "loadgen": time.process_time()}

    @staticmethod
    def per_request(before: dict, after: dict, requests: int) -> dict:
        """ms of CPU per request of each part; ``router_split``: each router process's share (supervisor and
        workers, by pid order), which shows whether ``--workers N`` splits the load evenly."""
        ms = 1000 / max(1, requests)
        out = {k: round((after[k] - before[k]) * ms, 3) for k in ("stubs", "redis", "loadgen")}
        if after["router"]:
            per_pid = {pid: after["router"][pid] - before["router"].get(pid, 0.0) for pid in after["router"]}
            out["router"] = round(sum(per_pid.values()) * ms, 3)
            out["router_split"] = [round(per_pid[pid] * ms, 3) for pid in sorted(per_pid)]
        out["total"] = round(sum(v for k, v in out.items() if k != "router_split"), 3)
        return out


def peer_python(name: str, venvs: Path = VENVS) -> str:
    """The peer's venv under ``venvs`` (``--venvs``), created with pip on first use; where it exists already (made
    offline by ``benchmarks/router_device.sh`` on a lent machine) it is used as it is."""
    venv = venvs / name
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", PEERS[name][0]], check=True)
    return str(py)


async def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status < 500:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()


def bodies_for(n: int, seed: int, distinct: int = 0) -> list[bytes]:
    """Request bodies of about 1k tokens: one of 8 shared system prompts (600 words, about 700 tokens) and a
    question of 250 words (about 290 tokens). Every question is fresh (``distinct`` 0), as in real traffic, so
    a router's caches help only with the shared part; ``distinct`` N > 0 cycles N prompts instead (the run
    before the token cache used 64)."""
    shared_rng = random.Random(0)
    shared = [" ".join(shared_rng.choices(WORDS, k=600)) for _ in range(8)]
    rng = random.Random(seed)
    count = distinct or n
    prompts = [shared[i % 8] + " " + " ".join(rng.choices(WORDS, k=250)) for i in range(count)]
    return [json.dumps({"model": "demo", "prompt": prompts[i % count], "max_tokens": 1}).encode()
            for i in range(n)]


async def wait_completion(url: str, timeout: float) -> None:
    body = {"model": "demo", "prompt": "hello", "max_tokens": 1}
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(url)


CLIENTS = 1  # --clients


async def load(url: str, rate: float, seconds: float, bodies: list[bytes]) -> list[float]:
    """Open loop: one request every 1/rate s; returns latencies (s) of the 200s. Request i goes through client
    i % CLIENTS, each with its own keep-alive connection pool. One client opens only as many connections as it has
    requests in flight at once (a handful at these rates), and the kernel spreads connections, not requests, over
    ``--workers``: a few connections can split unevenly. Many clients hold many connections, as a gateway's
    users do.

    The clients are the router's lean HTTP/1.1 client (``router/http1.py``: pooled keep-alive connections,
    llhttp), on uvloop: the load generator shares the 2-core machine with the routers measured, and before round 4
    it was aiohttp's client on asyncio's loop, which cost every router CPU at 1000 req/s. What is timed is the
    same: from just before the request is written to the last byte of the answer."""
    from pdpool.router.http1 import HTTPClientError, Http1Client

    lat: list[float] = []
    late: list[float] = []   # how long after its due time each request was written (the generator's own lag)
    errors = 0
    clients = [Http1Client() for _ in range(CLIENTS)]
    headers = {"Content-Type": "application/json"}
    try:
        async def one(client: Http1Client, body: bytes, due: float) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            late.append(t0 - due)
            try:
                r = await client.request(url, body, headers, timeout=60, connect_timeout=10)
                try:
                    await r.read()
                finally:
                    r.close()
                if r.status == 200:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1
            except (HTTPClientError, asyncio.TimeoutError):
                errors += 1

        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(clients[i % CLIENTS], bodies[i % len(bodies)], start + i / rate)))
        await asyncio.gather(*tasks)
    finally:
        for client in clients:
            client.close()
    if errors:
        print(f"  {errors} errors at {url}", file=sys.stderr)
    return Latencies(sorted(lat), sorted(late))


class Latencies(list):
    """The answered requests' latencies (s, sorted), and ``late``: how long after its due time each request was
    written (s, sorted). A generator that fell behind (its own process stalled) writes the requests it owes in a
    burst, which a router then queues: ``late`` tells that apart from the router's own stalls."""

    def __init__(self, latencies: list[float], late: list[float]) -> None:
        super().__init__(latencies)
        self.late = late

    def late_ms(self) -> dict:
        return {"send_late_p99_ms": round(pct(self.late, 0.99), 3), "send_late_max_ms": round(pct(self.late, 1.0), 3)}


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def measure(name: str, url: str, pid: int | None, rates, seconds, make_bodies, direct, parts: Parts
                  ) -> list[dict]:
    rows = []
    for rate in rates:
        await load(url, rate, 2, make_bodies(int(rate * 2), -int(rate)))  # warm-up, its own questions
        bodies = make_bodies(int(rate * seconds), int(rate))
        before = parts.snapshot(pid)
        lat = await load(url, rate, seconds, bodies)
        cpu = parts.per_request(before, parts.snapshot(pid), len(bodies))
        base = direct[rate]
        rows.append({"router": name, "rate": rate, "p50_added_ms": pct(lat, 0.5) - pct(base, 0.5),
                     "p99_added_ms": pct(lat, 0.99) - pct(base, 0.99), "p99_ms": pct(lat, 0.99),
                     "cpu_per_100rps": cpu.get("router", float("nan")) / 10,   # cores per 100 req/s
                     "cpu_ms_per_request": cpu, "ok": len(lat), **lat.late_ms()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def spawner(procs: list[subprocess.Popen], logs: Path = LOGS):
    """spawn(argv, name): a process in its own session, its output in <logs>/<name>.log, appended to ``procs``."""
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(argv, name: str) -> subprocess.Popen:
        # cwd outside the checkout: `python -m` puts the cwd first on sys.path, and the checkout's operator/
        # folder would shadow the standard library's operator module in the peers' Pythons
        with open(logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/tmp")
        procs.append(p)
        return p

    return spawn


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Stop every spawned process group (resumed first, in case a measurement left one stopped), newest first,
    and reap them; one that does not exit in 10 s is killed."""
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def start_redis(spawn, server: str | None = None) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on a free port, without persistence: (process, URL). ``server``: the binary
    (``--redis-server``; default the one on PATH)."""
    port = free_port()
    redis = spawn([server or shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port),
                   "--save", "", "--appendonly", "no"], "redis")
    time.sleep(0.5)
    return redis, f"redis://127.0.0.1:{port}/0"


def start_stubs(spawn, redis_url: str, *extra: str, count: int = 2) -> tuple[list[str], list[int]]:
    """``count`` stub upstreams (``router_stub_upstream.py``) publishing into ``redis_url``, each with ``extra``
    arguments: (their URLs, their pids). Wait for them with ``wait_http(url + "/health")``."""
    urls, pids = [], []
    for i in range(count):
        port = free_port()
        pids.append(spawn([sys.executable, str(ROOT / "benchmarks/router_stub_upstream.py"), "--port", str(port),
                           "--redis", redis_url, "--node-id", f"stub-{i}", *extra], f"stub-{i}").pid)
        urls.append(f"http://127.0.0.1:{port}")
    return urls, pids


async def main_async(args) -> None:
    procs: list[subprocess.Popen] = []
    spawn = spawner(procs, args.logs)
    try:
        redis, redis_url = start_redis(spawn, args.redis_server)
        extra = (() if args.stub_kv_blocks is None else ("--kv-blocks", str(args.stub_kv_blocks))) + (
            ("--index-work", args.stub_index_work) if args.stub_index_work else ())
        stubs, stub_pids = start_stubs(spawn, redis_url, *extra)
        for s in stubs:
            await wait_http(s + "/health")
        def make_bodies(n: int, seed: int) -> list[bytes]:
            return bodies_for(n, seed, args.distinct_prompts)

        parts = Parts(stub_pids, redis.pid)
        direct = {}
        for r in args.rates:
            bodies = make_bodies(int(r * args.seconds), 7)
            before = parts.snapshot(None)
            direct[r] = await load(stubs[0] + "/v1/completions", r, args.seconds, bodies)
            print(json.dumps({"router": "direct", "rate": r, "p50_ms": pct(direct[r], 0.5),
                              "p99_ms": pct(direct[r], 0.99), **direct[r].late_ms(),
                              "cpu_ms_per_request": parts.per_request(before, parts.snapshot(None), len(bodies))}),
                  flush=True)
        results = []
        for workers in args.workers:
            port = free_port()
            name = f"pdpool-w{workers}"
            ours = spawn([sys.executable, "-m", "pdpool.cli", "router", "--model", "demo", "--host", "127.0.0.1",
                          "--port", str(port), "--redis", redis_url, "--pool", "bench", "--dtype", "float32",
                          "--workers", str(workers)], name)
            await wait_http(f"http://127.0.0.1:{port}/health/ready")
            await wait_completion(f"http://127.0.0.1:{port}/v1/completions", 60)
            results += await measure(name, f"http://127.0.0.1:{port}/v1/completions", ours.pid, args.rates,
                                     args.seconds, make_bodies, direct, parts)
            os.killpg(ours.pid, signal.SIGTERM)  # idle, it would still poll Redis during the peers' turns
            ours.wait(30)
        for name in args.peers:
            py = peer_python(name, args.venvs)
            port = free_port()
            p = spawn(PEERS[name][1](py, port, stubs), name)
            try:  # a router that answers /health may still have no worker: one real request must pass
                await wait_http(f"http://127.0.0.1:{port}/health", 120)
                await wait_completion(f"http://127.0.0.1:{port}/v1/completions", 60)
            except TimeoutError:
                print(f"  {name} did not come up; its log: {args.logs / name}.log", file=sys.stderr)
                continue
            results += await measure(name, f"http://127.0.0.1:{port}/v1/completions", p.pid, args.rates,
                                     args.seconds, make_bodies, direct, parts)
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)
        print(json.dumps(results, indent=1))
    finally:
        stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[200, 1000])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--clients", type=int, default=1,
                    help="clients (connection pools) the requests are spread over, round robin")
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="run pdpool router once per value, with --workers N (e.g. 1 2)")
    ap.add_argument("--distinct-prompts", type=int, default=0,
                    help="cycle this many prompts (0: every request has its own question)")
    ap.add_argument("--venvs", type=Path, default=VENVS,
                    help="folder of the peers' venvs, one per peer named as the peer (made here with pip if missing)")
    ap.add_argument("--stub-kv-blocks", type=int, default=None,
                    help="the stubs' prefix cache in blocks (default: the stub's, 4096); 0: the stubs publish nothing "
                         "(heartbeats only), which shows what their index work costs the other parts")
    ap.add_argument("--stub-index-work", choices=("step", "response"), default=None,
                    help="when the stubs hash and store a served prompt's blocks (default: the stub's, 'step': at "
                         "their next publish step; 'response': right after the answer, as before round 9)")
    ap.add_argument("--redis-server", default=None, help="redis-server binary (default: the one on PATH)")
    ap.add_argument("--logs", type=Path, default=LOGS, help="folder for every process's log")
    args = ap.parse_args()
    run(main_async(args), args.clients)


def run(coro, clients: int) -> None:
    """Run a measurement on uvloop where it is installed (asyncio's loop otherwise), over ``clients`` sessions."""
    global CLIENTS
    CLIENTS = clients
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


if __name__ == "__main__":
    main()
