"""The router's index mirror (``router/index_mirror.py``) against a real redis-server and real ``NodeIndex``
publishers: it answers as the Lua lookup does on random histories (stores, removes, resets, restarts, a trimmed
stream, a Redis restart), converges after a reconnect, and two mirrors (two routers) agree."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import RedisServer, redis_server  # noqa: E402,F401

from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash  # noqa: E402
from pdpool.kv_index import IndexReader, NodeIndex, NodeInfo, PoolKeys, connect  # noqa: E402
from pdpool.router.index_reader import AsyncIndexReader  # noqa: E402

KEYS = PoolKeys("ns", "mirror")
HASHES = hash_prompt_blocks(list(range(48 * 16)), 16, root_hash(ModelFingerprint("demo", "float32", 16)))
NODES = ("a", "b", "c")
PROMPTS = [HASHES[:n] for n in (1, 5, 12, 30, 48)] + [HASHES[7:20], HASHES[40:]]


class Publisher:
    """One node's ``NodeIndex`` (a new one per incarnation), as a node process drives it."""

    def __init__(self, server, node_id: str, maxlen: int = 10_000) -> None:
        self.server = server
        self.node_id = node_id
        self.maxlen = maxlen
        self.generation = 0
        self.index: NodeIndex | None = None
        self.restart()

    def restart(self) -> None:
        if self.index is not None:
            self.index.flush()
        self.generation += 1
        self.incarnation = f"{self.node_id}-{self.generation}"
        self.index = NodeIndex(connect(self.server.url, self.server.password), KEYS, self.node_id, self.incarnation,
                               events_maxlen=self.maxlen, backoff_initial=0.01, backoff_max=0.05)
        self.index.resync([])   # a new incarnation starts empty, as node.py does
        self.heartbeat()

    def heartbeat(self) -> bool:
        return self.index.heartbeat(NodeInfo(self.node_id, "both", f"http://{self.node_id}", self.incarnation))


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


async def converged(mirror, sync: IndexReader, incarnations: dict, timeout: float = 10.0) -> None:
    """Wait until the mirror answers every prompt as the Lua lookup does."""
    deadline = time.monotonic() + timeout
    while True:
        want = [sync.lookup(p) for p in PROMPTS]
        got = [mirror.lookup(p, incarnations) for p in PROMPTS]
        if all(g is not None and g == {n: w.get(n, 0) for n in incarnations} for g, w in zip(got, want)):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"mirror {got} != lua {want}")
        await asyncio.sleep(0.02)


def redis_sets(server) -> dict:
    client = server.client()
    return {n: client.smembers(KEYS.blocks(n)) for n in NODES}


steps = st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from(NODES), st.integers(0, 47), st.integers(1, 20)),
    st.tuples(st.just("remove"), st.sampled_from(NODES), st.integers(0, 47), st.integers(1, 20)),
    st.tuples(st.just("resync"), st.sampled_from(NODES), st.just(0), st.just(0)),
    st.tuples(st.just("restart"), st.sampled_from(NODES), st.just(0), st.just(0)),
    st.tuples(st.just("check"), st.just("a"), st.just(0), st.just(0)),
), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=steps, maxlen=st.sampled_from([3, 10_000]), redis_restart=st.booleans())
def test_the_mirror_answers_as_the_lua_lookup_on_random_histories(redis_server, history, maxlen, redis_restart):
    """Stores, removes, resyncs and restarts in any order, the mirror reading while they happen (a stream trimmed
    to about 3 entries loses entries the mirror has not read), and optionally a Redis restart in the middle."""
    redis_server.client().flushall()
    redis_server.client().config_set("stream-node-max-entries", 2)   # so that MAXLEN ~ 3 trims at 3-4 entries
    sync = IndexReader(connect(redis_server.url, redis_server.password), KEYS)
    pubs = {n: Publisher(redis_server, n, maxlen) for n in NODES}

    async def run():
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS)
        mirror = reader.start_mirror(block_ms=50, backoff_initial=0.01, backoff_max=0.1)
        try:
            await wait_until(lambda: mirror.live)
            for i, (op, node, start, length) in enumerate(history):
                pub = pubs[node]
                if op == "store":
                    pub.index.publish(stored=HASHES[start:start + length])
                elif op == "remove":
                    pub.index.publish(removed=HASHES[start:start + length])
                elif op == "resync":
                    pub.index.flush()
                    pub.index.resync()
                elif op == "restart":
                    pub.restart()
                else:
                    for p in pubs.values():
                        p.index.flush()
                    await converged(mirror, sync, {n: p.incarnation for n, p in pubs.items()})
                if redis_restart and i == len(history) // 2:
                    redis_server.stop()
                    redis_server.start()
                    for p in pubs.values():   # the heartbeat notices the lost keys and rewrites them
                        p.index.flush()
                        await wait_until(lambda p=p: p.heartbeat())
                await asyncio.sleep(0)
            for p in pubs.values():
                assert p.index.flush()
            incarnations = {n: p.incarnation for n, p in pubs.items()}
            await converged(mirror, sync, incarnations)
            held = {n: set(map(bytes, p.index._held)) for n, p in pubs.items()}
            assert {n: set(m) for n, m in redis_sets(redis_server).items()} == held
            await wait_until(lambda: {n: mirror.nodes[n].blocks for n in NODES if n in mirror.nodes} == held)
        finally:
            await reader.close()
    asyncio.run(run())


def test_a_stale_incarnation_counts_nothing_until_its_reset_is_read(redis_server):
    redis_server.client().flushall()
    pub = Publisher(redis_server, "a")

    async def run():
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS)
        mirror = reader.start_mirror(block_ms=50)
        try:
            pub.index.publish(stored=HASHES[:10])
            assert pub.index.flush()
            old = pub.incarnation
            await wait_until(lambda: (mirror.lookup(HASHES, {"a": old}) or {}).get("a") == 10)
            assert mirror.lookup(HASHES, {"a": "some-newer-one"}) == {"a": 0}
            assert mirror.lookup(HASHES, {"a": None}) == {"a": 10}    # no incarnation known (static, k8s)
            pub.restart()
            pub.index.publish(stored=HASHES[:4])
            assert pub.index.flush()
            await wait_until(lambda: mirror.lookup(HASHES, {"a": pub.incarnation}) == {"a": 4})
            assert mirror.lookup(HASHES, {"a": old}) == {"a": 0}
        finally:
            await reader.close()
    asyncio.run(run())


def test_unknown_and_deregistered_nodes(redis_server):
    """A node the mirror has not read sends that lookup to Redis (None) and is read in the background; a node
    without a heartbeat counts 0 (and leaves ``nodes`` once its set is gone too); a deregistered node's set is
    dropped."""
    client = redis_server.client()
    client.flushall()
    client.sadd(KEYS.nodes, "dead")   # registered once, its heartbeat and set expired since

    async def run():
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS)
        mirror = reader.start_mirror(block_ms=50)
        try:
            await wait_until(lambda: mirror.live)
            assert client.smembers(KEYS.nodes) == set() and "dead" in mirror._absent
            assert mirror.lookup(HASHES, {"ghost": None}) is None
            await wait_until(lambda: mirror.lookup(HASHES, {"ghost": None}) == {"ghost": 0})
            pub = Publisher(redis_server, "a")
            pub.index.publish(stored=HASHES[:6])
            assert pub.index.flush()
            await wait_until(lambda: mirror.lookup(HASHES, {"a": pub.incarnation}) == {"a": 6})
            assert pub.index.deregister()
            await wait_until(lambda: "a" not in mirror.nodes)
            assert mirror.lookup(HASHES, {"a": pub.incarnation}) == {"a": 0}
        finally:
            await reader.close()
    asyncio.run(run())


def test_outage_goes_to_redis_then_the_mirror_converges_after_the_reconnect(redis_server):
    redis_server.client().flushall()
    pub = Publisher(redis_server, "a")

    async def run():
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS, timeout=0.2)
        mirror = reader.start_mirror(block_ms=50, backoff_initial=0.05, backoff_max=0.2)
        try:
            pub.index.publish(stored=HASHES[:8])
            assert pub.index.flush()
            await wait_until(lambda: mirror.lookup(HASHES, {"a": pub.incarnation}) == {"a": 8})
            redis_server.stop()
            await wait_until(lambda: not mirror.live)
            assert mirror.lookup(HASHES, {"a": pub.incarnation}) is None   # the caller asks Redis, which fails
            pub.index.publish(stored=HASHES[8:20])     # the node keeps serving; Redis is down
            pub.index.flush(0.5)
            redis_server.start()
            await wait_until(lambda: pub.heartbeat())  # the node rewrites its whole state (a reset entry)
            assert pub.index.flush()
            await wait_until(lambda: mirror.lookup(HASHES, {"a": pub.incarnation}) == {"a": 20})
            assert mirror.num_resyncs >= 1
        finally:
            await reader.close()
    asyncio.run(run())


def test_two_mirrors_share_the_precise_view(redis_server):
    """Active-active: two routers' mirrors tail one stream and answer alike, also for a node that joined later."""
    redis_server.client().flushall()
    a = Publisher(redis_server, "a")
    a.index.publish(stored=HASHES[:16])
    assert a.index.flush()

    async def run():
        readers = [AsyncIndexReader(redis_server.url, redis_server.password, KEYS) for _ in range(2)]
        mirrors = [r.start_mirror(block_ms=50) for r in readers]
        try:
            b = Publisher(redis_server, "b")
            b.index.publish(stored=HASHES[:30])
            a.index.publish(removed=HASHES[10:16])
            assert a.index.flush() and b.index.flush()
            want = {"a": 10, "b": 30}
            inc = {"a": a.incarnation, "b": b.incarnation}
            for m in mirrors:
                await wait_until(lambda m=m: m.lookup(HASHES, inc) == want)
        finally:
            for r in readers:
                await r.close()
    asyncio.run(run())


def test_node_events_carry_node_incarnation_sequence_and_hashes(redis_server):
    """The stream's entries: a reset for the rewrite, then one delta per MULTI with consecutive sequence numbers."""
    client = redis_server.client()
    client.flushall()
    pub = Publisher(redis_server, "a")
    pub.index.publish(stored=HASHES[:3], removed=HASHES[5:6])
    assert pub.index.flush()
    entries = client.xrange(KEYS.events)
    kinds = [e[1][b"k"] for e in entries]
    assert kinds[0] == b"r" and kinds[-1] == b"d"
    seqs = [int(e[1][b"s"]) for e in entries]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    last = entries[-1][1]
    assert last[b"n"] == b"a" and last[b"i"] == pub.incarnation.encode()
    assert set(last[b"+"][i:i + 16] for i in range(0, 48, 16)) == set(HASHES[:3]) and last[b"-"] == HASHES[5]


@pytest.mark.parametrize("lookup", ["mirror", "redis"])
def test_prefix_index_in_either_lookup_mode_and_redis_down(redis_server, lookup):
    """PrefixIndex with ``--index-lookup mirror`` or ``redis``: the same counts; with Redis down, approximate mode in
    both (the mirror's stream connection is down too), precise again once Redis is back."""
    from pdpool.router.endpoints import Endpoint
    from pdpool.router.prefix_index import ApproxIndex, PrefixIndex

    redis_server.client().flushall()
    pub = Publisher(redis_server, "a")
    pub.index.publish(stored=HASHES[:9])
    assert pub.index.flush()
    endpoints = [Endpoint("a", "http://a", "decode", incarnation=pub.incarnation),
                 Endpoint("b", "http://b", "decode", incarnation="nope")]

    async def run():
        async def run_sync(fn, *args):
            return fn(*args)

        index = PrefixIndex(IndexReader(connect(redis_server.url, redis_server.password), KEYS), ApproxIndex(100),
                            run_sync, backoff_initial=0.05, backoff_max=0.1, recent_seconds=0, lookup=lookup)
        index.async_reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS, timeout=0.2)
        mirror = index.async_reader.mirror
        assert (mirror is not None) == (lookup == "mirror")
        try:
            assert await index.lookup(HASHES, endpoints) == {"a": 9, "b": 0}   # Lua while the mirror starts
            if mirror is not None:
                await wait_until(lambda: mirror.live)
                pub.index.publish(stored=HASHES[9:12])
                assert pub.index.flush()
                # "b" has never published: the first lookup naming it goes to Redis, then it counts 0 locally
                await wait_until(lambda: mirror.lookup(HASHES, {"a": pub.incarnation, "b": "nope"}) == {"a": 12, "b": 0})
                index.async_reader.lookup = None   # the Lua path is not taken while the mirror answers
                assert await index.lookup(HASHES, endpoints) == {"a": 12, "b": 0}
                del index.async_reader.lookup
            redis_server.stop()
            await wait_until(lambda: mirror is None or not mirror.live)
            await index.lookup(HASHES, endpoints)
            assert index.mode == "approximate"
            redis_server.start()
            await wait_until(lambda: pub.heartbeat())
            assert pub.index.flush()   # past the backoff
            want = 12 if mirror is not None else 9
            deadline = time.monotonic() + 5
            while (got := await index.lookup(HASHES, endpoints)) != {"a": want, "b": 0} or index.mode != "precise":
                assert time.monotonic() < deadline, (got, index.mode)
                await asyncio.sleep(0.02)
        finally:
            await index.async_reader.close()
    asyncio.run(run())


def test_a_stream_trimmed_past_the_mirror_makes_it_read_every_node_again(redis_server):
    """Node a's only entry is trimmed away (by node b's entries) while the mirror waits between reads: a sequence
    check could not see it (a sends nothing more), the check on the mirror's last entry does."""
    redis_server.client().flushall()
    redis_server.client().config_set("stream-node-max-entries", 2)   # so that MAXLEN ~ 3 trims at 3-4 entries
    a, b = Publisher(redis_server, "a", maxlen=3), Publisher(redis_server, "b", maxlen=3)

    async def run():
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS)
        mirror = reader.start_mirror(block_ms=50)
        try:
            await wait_until(lambda: mirror.live)
            mirror.min_interval = 0.5
            b.index.publish(stored=HASHES[:1])
            assert b.index.flush()
            await wait_until(lambda: len(mirror.nodes["b"].blocks) == 1)   # now sleeping 0.5 s
            a.index.publish(stored=HASHES[:5])
            assert a.index.flush()
            for i in range(1, 12):
                b.index.publish(stored=HASHES[i:i + 1])
                assert b.index.flush()
            want = {"a": 5, "b": 12}
            inc = {"a": a.incarnation, "b": b.incarnation}
            await wait_until(lambda: mirror.lookup(HASHES, inc) == want)
            assert mirror.num_resyncs >= 1
        finally:
            await reader.close()
    asyncio.run(run())
