"""How fresh the router's index mirror is: the time from a node's ``NodeIndex.publish`` to the moment a router's
mirror holds the published block, per mirror read interval, all mirrors in one run.

    python benchmarks/router_mirror_freshness.py [--intervals 0.01 0.05] [--seconds 20] [--step-ms 10]

One real redis-server (``router_overhead.start_redis``); two real ``NodeIndex`` publishers in threads, as two
nodes: node ``a`` publishes one fresh block hash at a random moment in every ``--step-ms`` (uniform, so that
publishes and reads are out of phase as in a pool), node ``b`` a fresh block every step as background traffic
(the overhead benchmark's stubs publish once per 10 ms step while they serve). One ``IndexMirror`` per interval
(``AsyncIndexReader.start_mirror(min_interval=...)``, its own connection, as in a router) tails the stream on
this process's event loop; the time a hash of ``a`` first appears in a mirror's set is taken right after the
mirror applies a batch. Reported per interval: p50, p90, p99 and max of publish -> visible, in ms, and the
mirror's reads per second. The publish time is taken before ``publish`` queues the event (what the engine's
step sees); it includes the publisher thread's MULTI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402  (Redis, the spawner, teardown)

from pdpool.block_hash import HASH_BYTES  # noqa: E402
from pdpool.kv_index import NodeIndex, NodeInfo, PoolKeys, connect  # noqa: E402
from pdpool.router.index_reader import AsyncIndexReader  # noqa: E402

KEYS = PoolKeys("bench", "freshness")


def node(url: str, node_id: str) -> NodeIndex:
    index = NodeIndex(connect(url), KEYS, node_id, f"{node_id}-1")
    index.resync([])
    index.heartbeat(NodeInfo(node_id, "both", f"http://{node_id}", f"{node_id}-1"))
    return index


def publisher(index: NodeIndex, step: float, seconds: float, jitter: bool, sent: dict | None,
              stop: threading.Event) -> None:
    rng = random.Random(index.node_id)
    end = time.monotonic() + seconds
    start = time.monotonic()
    k = 0
    while not stop.is_set() and time.monotonic() < end:
        k += 1
        at = start + (k - 1 + (rng.random() if jitter else 0.0)) * step
        wait = at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        h = rng.randbytes(HASH_BYTES)
        if sent is not None:
            sent[h] = time.monotonic()
        index.publish(stored=[h])
        if k % 100 == 0:
            index.heartbeat(NodeInfo(index.node_id, "both", f"http://{index.node_id}", index.incarnation))


def watch(mirror, sent: dict, seen: dict) -> None:
    """Wrap the mirror's ``_apply``: after each batch, the hashes of ``a`` that became visible."""
    apply = mirror._apply
    mirror.reads = 0

    def timed(entries):
        out = apply(entries)
        now = time.monotonic()
        mirror.reads += 1
        a = mirror.nodes.get("a")
        if a is not None:
            for h in [h for h in sent if h not in seen and h in a.blocks]:
                seen[h] = now
        return out
    mirror._apply = timed


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main_async(args) -> None:
    procs = []
    spawn = ro.spawner(procs, Path(args.logs))
    try:
        _, url = ro.start_redis(spawn)
        a, b = node(url, "a"), node(url, "b")
        readers, mirrors, seen = [], [], []
        sent: dict[bytes, float] = {}
        for interval in args.intervals:
            reader = AsyncIndexReader(url, None, KEYS)
            mirror = reader.start_mirror(min_interval=interval)
            readers.append(reader)
            mirrors.append(mirror)
            seen.append({})
            watch(mirror, sent, seen[-1])
        while not all(m.live for m in mirrors):
            await asyncio.sleep(0.01)
        stop = threading.Event()
        step = args.step_ms / 1000
        threads = [threading.Thread(target=publisher, args=(a, step, args.seconds, True, sent, stop)),
                   threading.Thread(target=publisher, args=(b, step, args.seconds, False, None, stop))]
        reads0 = [m.reads for m in mirrors]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            await asyncio.sleep(0.05)
        a.flush()
        b.flush()
        await asyncio.sleep(max(args.intervals) + 0.6)
        elapsed = time.monotonic() - t0
        for interval, mirror, got, r0 in zip(args.intervals, mirrors, seen, reads0):
            lag = [1000 * (got[h] - t) for h, t in sent.items() if h in got]
            print(json.dumps({"interval_ms": interval * 1000, "published": len(sent), "seen": len(lag),
                              "p50_ms": round(pct(lag, 0.5), 2), "p90_ms": round(pct(lag, 0.9), 2),
                              "p99_ms": round(pct(lag, 0.99), 2), "max_ms": round(max(lag), 2),
                              "reads_per_s": round((mirror.reads - r0) / elapsed, 1)}), flush=True)
        for r in readers:
            await r.close()
    finally:
        ro.stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.01, 0.05],
                    help="the mirrors' read intervals (min_interval), seconds")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--step-ms", type=float, default=10, help="each node publishes once per step")
    ap.add_argument("--logs", default="/tmp/router-freshness-logs")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
