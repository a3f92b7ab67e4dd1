"""The Redis index against a real redis-server: publish/resync/lookup, liveness, pool isolation (and the operator's
key deletion), outages."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash
from pdpool.kv_index import (HeartbeatThread, IndexReader, NodeIndex, NodeInfo, NodeLoad, PoolKeys, connect,
                             delete_pool_keys)
from pdpool.kv_index.redis_index import LOOKUP_LUA

ROOT = root_hash(ModelFingerprint("demo", "float32", 4))
HASHES = hash_prompt_blocks(list(range(40)), 4, ROOT)  # 10 chained block hashes


def make_node(server, node_id, pool="p1", namespace="ns", hb_ttl=5.0, state_ttl=None, role="both"):
    index = NodeIndex(connect(server.url, server.password), PoolKeys(namespace, pool), node_id, "inc1",
                      heartbeat_ttl=hb_ttl, state_ttl=state_ttl, backoff_initial=0.05, backoff_max=0.2)
    info = NodeInfo(node_id=node_id, role=role, url=f"http://{node_id}:8000", incarnation="inc1",
                    agent_name=f"{node_id}#inc1", load=NodeLoad(num_waiting=1, num_running=2, kv_usage=0.25,
                                                                num_free_blocks=7))
    return index, info


def make_reader(server, pool="p1", namespace="ns"):
    return IndexReader(connect(server.url, server.password), PoolKeys(namespace, pool))


def cmdstats(client) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}


def test_lookup_counts_leading_blocks_of_live_nodes(redis_server):
    a, a_info = make_node(redis_server, "a")
    b, b_info = make_node(redis_server, "b")
    c, c_info = make_node(redis_server, "c")
    for index, info in ((a, a_info), (b, b_info), (c, c_info)):
        assert index.heartbeat(info)
    a.publish(stored=HASHES[:4])
    assert a.flush()
    b.publish(stored=[HASHES[0], HASHES[1], HASHES[3]])  # a gap at block 2
    assert b.flush()
    reader = make_reader(redis_server)
    assert reader.lookup(HASHES[:5]) == {"a": 4, "b": 2, "c": 0}
    assert reader.lookup([h.hex() for h in HASHES[:5]]) == {"a": 4, "b": 2, "c": 0}  # hex works too
    assert reader.lookup([]) == {"a": 0, "b": 0, "c": 0}

    a.publish(stored=[HASHES[4]], removed=[HASHES[1]])
    assert a.flush()
    assert reader.lookup(HASHES[:5]) == {"a": 1, "b": 2, "c": 0}

    # One round trip each: the lookup is one EVALSHA, a step's publish one MULTI with one SADD for 100 blocks.
    client = redis_server.client()
    before = cmdstats(client)
    reader.lookup(HASHES)
    many = [i.to_bytes(16, "big") for i in range(100)]
    c.publish(stored=many, removed=[])
    assert c.flush()
    after = cmdstats(client)
    assert after["evalsha"] - before["evalsha"] == 1
    assert after["multi"] - before["multi"] == 1
    assert after["sadd"] - before.get("sadd", 0) == 1


def test_long_prompt_lookup_crosses_chunks(redis_server):
    a, info = make_node(redis_server, "a")
    a.heartbeat(info)
    hashes = hash_prompt_blocks(list(range(3000 * 4)), 4, ROOT)  # 3000 blocks: several SMISMEMBER chunks
    a.publish(stored=hashes[:2500])
    assert a.flush()
    assert make_reader(redis_server).lookup(hashes) == {"a": 2500}


_POOLS = iter(range(10**9))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.lists(st.sets(st.integers(0, 79)), min_size=1, max_size=4), num_blocks=st.integers(0, 80))
def test_lookup_is_each_nodes_leading_run_of_held_blocks(redis_server, held, num_blocks):
    """The script cuts the one concatenated argument into chunks shared by every node: whatever each node holds,
    its answer is the length of its leading run, as a plain Python walk over the hashes says."""
    hashes = hash_prompt_blocks(list(range(80 * 4)), 4, ROOT)[:num_blocks]
    pool = f"prop{next(_POOLS)}"
    for i, blocks in enumerate(held):
        index, info = make_node(redis_server, f"n{i}", pool=pool)
        assert index.heartbeat(info)
        index.publish(stored=[hashes[b] for b in blocks if b < num_blocks])
        assert index.flush()
    expected = {}
    for i, blocks in enumerate(held):
        run = 0
        while run < num_blocks and run in blocks:
            run += 1
        expected[f"n{i}"] = run
    assert make_reader(redis_server, pool=pool).lookup(hashes) == expected


def test_lookup_refuses_a_hash_of_the_wrong_length(redis_server):
    import pytest
    import redis

    client = connect(redis_server.url, redis_server.password)
    with pytest.raises(redis.ResponseError, match="16 bytes each"):
        client.eval(LOOKUP_LUA, 1, PoolKeys("ns", "p1").nodes, PoolKeys("ns", "p1").prefix, b"x" * 17)
    with pytest.raises(ValueError):
        make_reader(redis_server).lookup([b"short"])


def test_dead_node_is_excluded_then_pruned(redis_server):
    live, live_info = make_node(redis_server, "live")
    dead, dead_info = make_node(redis_server, "dead", hb_ttl=0.3, state_ttl=0.8)
    live.heartbeat(live_info)
    dead.heartbeat(dead_info)
    live.publish(stored=HASHES[:2])
    assert live.flush()
    dead.publish(stored=HASHES[:6])
    assert dead.flush()
    reader = make_reader(redis_server)
    assert reader.lookup(HASHES) == {"live": 2, "dead": 6}
    assert set(reader.live_nodes()) == {"live", "dead"}
    time.sleep(0.45)  # the dead node's heartbeat expired; its blocks set has not yet
    assert reader.lookup(HASHES) == {"live": 2}
    assert set(reader.live_nodes()) == {"live"}
    keys = PoolKeys("ns", "p1")
    assert redis_server.client().sismember(keys.nodes, "dead")
    time.sleep(0.5)  # now its blocks set expired too: the lookup prunes it from the registry
    assert reader.lookup(HASHES) == {"live": 2}
    assert not redis_server.client().sismember(keys.nodes, "dead")


def test_heartbeat_payload_and_agent_metadata(redis_server):
    a, info = make_node(redis_server, "a", role="prefill")
    info.draining = True
    assert a.heartbeat(info)
    assert a.set_agent_metadata(b"\x00nixl-md\xff")
    reader = make_reader(redis_server)
    got = reader.live_nodes()["a"]
    assert got == info
    assert (got.role, got.url, got.draining, got.load.kv_usage) == ("prefill", "http://a:8000", True, 0.25)
    assert reader.agent_metadata("a", "inc1") == b"\x00nixl-md\xff"
    assert reader.agent_metadata("a", "another-incarnation") is None
    ttl = redis_server.client().pttl(PoolKeys("ns", "p1").heartbeat("a"))
    assert 0 < ttl <= 5000


def test_resync_replaces_the_set(redis_server):
    a, info = make_node(redis_server, "a")
    a.heartbeat(info)
    a.publish(stored=HASHES[:5])
    assert a.flush()
    assert a.resync(HASHES[5:7])
    members = redis_server.client().smembers(PoolKeys("ns", "p1").blocks("a"))
    assert members == set(HASHES[5:7])
    # An update lost behind the index's back heals at the next resync from the mirror.
    redis_server.client().srem(PoolKeys("ns", "p1").blocks("a"), HASHES[5])
    assert make_reader(redis_server).lookup(HASHES[5:7]) == {"a": 0}
    assert a.resync()
    assert make_reader(redis_server).lookup(HASHES[5:7]) == {"a": 2}


def test_pools_are_isolated_and_delete_pool_keys(redis_server):
    client = redis_server.client()
    nodes = {}
    for namespace, pool in (("ns", "p1"), ("ns", "p1x"), ("other", "p1")):
        index, info = make_node(redis_server, "n", pool=pool, namespace=namespace)
        index.heartbeat(info)
        index.set_agent_metadata(b"md")
        nodes[namespace, pool] = index
    nodes["ns", "p1"].publish(stored=HASHES[:3])
    assert nodes["ns", "p1"].flush()
    nodes["ns", "p1x"].publish(stored=HASHES[:1])
    assert nodes["ns", "p1x"].flush()
    client.set("unrelated:key", "1")
    assert make_reader(redis_server, "p1", "ns").lookup(HASHES) == {"n": 3}
    assert make_reader(redis_server, "p1x", "ns").lookup(HASHES) == {"n": 1}
    assert make_reader(redis_server, "p1", "other").lookup(HASHES) == {"n": 0}

    p1_keys = {k for k in client.scan_iter(match=PoolKeys("ns", "p1").scan_pattern)}
    assert len(p1_keys) == 5  # nodes, hb:n, blocks:n, nixl:n:inc1, events
    before = set(client.scan_iter())
    assert asyncio.run(delete_pool_keys(redis_server.url, redis_server.password, "ns", "p1", batch=2)) == 5
    assert set(client.scan_iter()) == before - p1_keys
    assert make_reader(redis_server, "p1", "ns").lookup(HASHES) == {}
    assert make_reader(redis_server, "p1x", "ns").lookup(HASHES) == {"n": 1}
    assert client.get("unrelated:key") == b"1"


def test_deregister_removes_the_node(redis_server):
    a, info = make_node(redis_server, "a")
    a.heartbeat(info)
    a.set_agent_metadata(b"md")
    a.publish(stored=HASHES[:2])
    assert a.flush()
    assert a.deregister()
    client = redis_server.client()
    keys = PoolKeys("ns", "p1")
    assert list(client.scan_iter()) == [keys.events.encode()]   # the pool's stream, shared by its nodes
    last = client.xrevrange(keys.events, count=1)[0][1]
    assert last[b"n"] == b"a" and last[b"k"] == b"r"            # a reset: the routers' mirrors read it again


def test_redis_outage_never_raises_and_heals(redis_server):
    a, info = make_node(redis_server, "a")
    a.heartbeat(info)
    a.set_agent_metadata(b"md")
    a.publish(stored=HASHES[:3])
    assert a.flush()
    redis_server.stop()

    t0 = time.monotonic()
    for i in range(3, 8):  # engine steps during the outage: queued, the publisher fails and keeps the mirror
        a.publish(stored=[HASHES[i]], removed=[HASHES[0]] if i == 3 else [])
        assert a.heartbeat(info) is False
    assert a.flush() is False
    assert a.resync() is False
    assert time.monotonic() - t0 < 2.0
    assert a.dirty and a.num_errors >= 1

    redis_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 5
    while a.dirty:  # the publisher retries once the backoff allows, rewriting everything, with no new event
        assert time.monotonic() < deadline
        time.sleep(0.05)
    reader = make_reader(redis_server)
    assert reader.lookup(HASHES[1:8]) == {"a": 7}
    assert reader.agent_metadata("a", "inc1") == b"md"
    assert reader.live_nodes()["a"] == info


def test_silent_redis_restart_is_noticed_by_the_heartbeat(redis_server):
    a, info = make_node(redis_server, "a")
    a.heartbeat(info)
    a.publish(stored=HASHES[:4])
    assert a.flush()
    redis_server.client().flushall()  # as if Redis restarted between two calls
    assert a.heartbeat(info)
    assert make_reader(redis_server).lookup(HASHES) == {"a": 4}


def test_heartbeat_thread(redis_server):
    a, info = make_node(redis_server, "a", hb_ttl=0.5)
    a.publish(stored=HASHES[:2])
    assert a.flush()
    thread = HeartbeatThread(a, lambda: info, period=0.05, resync_every=3).start()
    try:
        reader = make_reader(redis_server)
        deadline = time.monotonic() + 5
        while "a" not in reader.live_nodes():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.6)  # longer than the TTL: still live, the thread keeps it so
        assert reader.lookup(HASHES) == {"a": 2}
    finally:
        thread.stop()
    a.deregister()
    assert make_reader(redis_server).live_nodes() == {}



def test_node_index_from_config(redis_server):
    from pdpool import config
    from pdpool.kv_index import new_incarnation

    cfg = config.build(redis=redis_server.url, redis_password=redis_server.password, pool="p9", namespace="team",
                       heartbeat_seconds=0.5)
    incarnation = new_incarnation()
    index = NodeIndex.from_config(cfg.disagg, "node-1:8000", incarnation)
    assert index.heartbeat_ttl_ms == 1500
    assert index.heartbeat(NodeInfo("node-1:8000", "decode", "http://n1:8000", incarnation))
    assert set(make_reader(redis_server, "p9", "team").live_nodes()) == {"node-1:8000"}
    assert new_incarnation() != incarnation


def test_publish_never_waits_on_a_stalled_redis(redis_server):
    """Redis stopped (SIGSTOP: connections hang, nothing is refused): an engine step's publish only queues."""
    import os
    import signal

    a, info = make_node(redis_server, "a")
    a.heartbeat(info)
    a.publish(stored=HASHES[:2])
    assert a.flush()
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        durations = []
        for i in range(2, 10):
            t0 = time.perf_counter()
            a.publish(stored=[HASHES[i]], removed=[HASHES[0]] if i == 2 else [])
            durations.append(time.perf_counter() - t0)
            time.sleep(0.05)  # the publisher meanwhile blocks on Redis (0.5 s socket timeout)
        assert max(durations) < 1e-3, durations
        assert a.flush(timeout=0.2) is False  # still stuck on Redis
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not (a.flush(timeout=1.0) and not a.dirty):
        assert time.monotonic() < deadline, "the index did not heal"
    assert make_reader(redis_server).lookup(HASHES) == {"a": 0}  # block 0 was removed
    assert make_reader(redis_server).lookup(HASHES[1:]) == {"a": 9}
    assert a.deregister()


def _conversion(fn, items):
    try:
        return ("ok", fn(items))
    except ValueError as exc:
        return ("refused", str(exc))


_hash_like = st.one_of(
    st.binary(min_size=16, max_size=16), st.binary(max_size=20),
    st.binary(min_size=16, max_size=16).map(bytearray), st.binary(min_size=16, max_size=16).map(memoryview),
    st.binary(min_size=16, max_size=16).map(bytes.hex), st.binary(max_size=20).map(bytes.hex))


@settings(max_examples=300, deadline=None)
@given(items=st.lists(_hash_like, max_size=12))
def test_raw_all_is_the_per_hash_conversion(items):
    """``_raw_all`` (the inline fast path of ``publish``, ``resync`` and ``lookup_args``) equals ``_raw`` per hash:
    the same bytes, the same refusals, on plain bytes, bytearrays, memoryviews and hex of any length."""
    from pdpool.kv_index.redis_index import _raw, _raw_all

    old = _conversion(lambda xs: [_raw(h) for h in xs], items)
    new = _conversion(_raw_all, items)
    assert new == old
    if new[0] == "ok":
        assert all(type(h) is bytes for h in new[1])


def test_reader_heartbeat_is_the_live_nodes_payload(redis_server):
    """What a decode node checks a handle's address against (``decode_node.peers.PeerDirectory.vouch``)."""
    keys = PoolKeys("ns", "hb")
    a = NodeIndex(redis_server.client(), keys, "a", "inc1")
    reader = IndexReader(redis_server.client(), keys)
    assert reader.heartbeat("a") is None
    assert a.heartbeat(NodeInfo("a", "prefill", "http://10.0.0.1:8000", "inc1", "a#inc1"))
    info = reader.heartbeat("a")
    assert (info.url, info.incarnation, info.agent_name) == ("http://10.0.0.1:8000", "inc1", "a#inc1")
    assert a.deregister() and reader.heartbeat("a") is None


@pytest.mark.parametrize("lost", ["blocks", "nixl"])
def test_a_lost_blocks_set_or_agent_metadata_is_noticed_by_the_heartbeat(redis_server, lost):
    """Redis dropped one of the node's keys but kept the ``nodes`` set (eviction under maxmemory takes keys with a TTL
    first: ``blocks:`` and ``nixl:`` have one, ``nodes`` has none; a failover that lost the last writes): the
    ``SADD nodes`` check saw nothing, and the index lacked the node's blocks or agent until the periodic resync
    (30 heartbeats, a minute at the default period)."""
    a, info = make_node(redis_server, "a")
    keys = PoolKeys("ns", "p1")
    assert a.heartbeat(info) and a.set_agent_metadata(b"md")
    a.publish(stored=HASHES[:4])
    assert a.flush()
    client = redis_server.client()
    client.delete(keys.blocks("a") if lost == "blocks" else keys.nixl("a", "inc1"))
    assert a.heartbeat(info)
    assert make_reader(redis_server).lookup(HASHES) == {"a": 4}
    assert make_reader(redis_server).agent_metadata("a", "inc1") == b"md"
