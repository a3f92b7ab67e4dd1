"""Redis discovery across a Redis restart: a redis-server that comes back empty must not leave the router with no
node (every request a 503) until the nodes' next heartbeats; a node that really left still drops out at once."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import redis_server  # noqa: E402,F401

from pdpool.kv_index import IndexReader, NodeIndex, NodeInfo, PoolKeys, connect  # noqa: E402
from pdpool.router import discovery_redis  # noqa: E402
from pdpool.router.discovery_redis import RedisDiscovery  # noqa: E402
from pdpool.router.endpoints import Pool  # noqa: E402

KEYS = PoolKeys("ns", "p")


async def run_sync(fn, *args):
    return fn(*args)


def node_index(server, node_id: str, role: str) -> NodeIndex:
    index = NodeIndex(connect(server.url, server.password), KEYS, node_id, "i1", backoff_initial=0.0)
    assert index.heartbeat(NodeInfo(node_id, role, f"http://{node_id}:8000", "i1"))
    return index


def test_nodes_survive_a_redis_restart_and_departures_still_count(redis_server, monkeypatch):
    prefill, decode = node_index(redis_server, "p0", "prefill"), node_index(redis_server, "d0", "decode")
    pool = Pool()
    discovery = RedisDiscovery(IndexReader(connect(redis_server.url, redis_server.password), KEYS), pool, 0.5,
                               run_sync)
    assert asyncio.run(discovery.refresh())
    assert set(pool.endpoints) == {"p0", "d0"}

    redis_server.stop()
    assert not asyncio.run(discovery.refresh())      # down: the last known nodes stay
    assert set(pool.endpoints) == {"p0", "d0"}
    redis_server.start()                              # back, empty: no heartbeat yet
    assert asyncio.run(discovery.refresh())
    assert set(pool.endpoints) == {"p0", "d0"}        # before the fix: {} -> "no ready decode node" 503s

    assert prefill.heartbeat(NodeInfo("p0", "prefill", "http://p0:8000", "i1"))   # p0 registers again, d0 not
    monkeypatch.setattr(discovery_redis.time, "monotonic",
                        lambda: discovery_redis.time.perf_counter() + 10 * discovery_redis.RESTART_GRACE_S)
    assert asyncio.run(discovery.refresh())
    assert set(pool.endpoints) == {"p0"}              # d0 never came back: dropped after the grace
    monkeypatch.undo()

    assert decode.heartbeat(NodeInfo("d0", "decode", "http://d0:8000", "i1"))
    assert asyncio.run(discovery.refresh())
    assert set(pool.endpoints) == {"p0", "d0"}
    decode.deregister()                               # a clean departure, same server: gone at the next refresh
    assert asyncio.run(discovery.refresh())
    assert set(pool.endpoints) == {"p0"}


def test_nodes_whose_heartbeats_expired_during_an_outage_are_kept(redis_server):
    """Redis unreachable (frozen here, as a hung or partitioned server) longer than the heartbeat TTL: its keys
    expire, the same server answers again without them; the nodes could not renew them, they are not gone."""
    import signal
    import time

    index = NodeIndex(connect(redis_server.url, redis_server.password), KEYS, "d0", "i1", heartbeat_ttl=0.3)
    assert index.heartbeat(NodeInfo("d0", "decode", "http://d0:8000", "i1"))
    pool = Pool()
    discovery = RedisDiscovery(IndexReader(connect(redis_server.url, redis_server.password, timeout=0.2), KEYS),
                               pool, 0.5, run_sync)
    assert asyncio.run(discovery.refresh()) and set(pool.endpoints) == {"d0"}
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert not asyncio.run(discovery.refresh())
        time.sleep(0.5)                               # past the heartbeat TTL
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert asyncio.run(discovery.refresh())
    assert set(pool.endpoints) == {"d0"}              # before the fix: {} until d0's next heartbeat
