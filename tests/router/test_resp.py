"""The router's lean Redis client (``router/resp.py``) and the lookup on it (``router/index_reader.py``): the
reply parser over any chunking, and the lookup against a real redis-server, the same answers as redis-py's
``IndexReader``, under concurrency, a flushed script cache, a wrong password, an outage and a stall."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import RedisServer, redis_server  # noqa: E402,F401

from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash  # noqa: E402
from pdpool.kv_index import IndexReader, IndexUnavailableError, NodeIndex, NodeInfo, PoolKeys, connect  # noqa: E402
from pdpool.router.index_reader import AsyncIndexReader  # noqa: E402
from pdpool.router.resp import RespError, _Protocol, encode_command  # noqa: E402

KEYS = PoolKeys("ns", "p")
HASHES = hash_prompt_blocks(list(range(100 * 16)), 16, root_hash(ModelFingerprint("demo", "float32", 16)))

replies = st.recursive(
    st.integers(-2**63, 2**63 - 1) | st.binary(max_size=40) | st.none()
    | st.text(alphabet="abcXYZ _-", min_size=1, max_size=10).map(lambda s: ("+", s))
    | st.text(alphabet="abcXYZ _-", min_size=1, max_size=10).map(lambda s: ("-", s)),
    lambda inner: st.lists(inner, max_size=5), max_leaves=20)


def encode_reply(value) -> bytes:
    if isinstance(value, tuple):
        return f"{value[0]}{value[1]}\r\n".encode()
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    return b"*%d\r\n" % len(value) + b"".join(encode_reply(v) for v in value)


def expected(value):
    if isinstance(value, tuple):
        return value[1].encode() if value[0] == "+" else ("error", value[1])
    if isinstance(value, list):
        return [expected(v) for v in value]
    return value


@given(st.lists(replies, min_size=1, max_size=6), st.lists(st.integers(1, 64), max_size=30))
def test_replies_parse_whatever_the_chunking(values, cuts):
    """Each waiting call gets its own reply, in order, however the bytes arrive."""
    loop = asyncio.new_event_loop()
    try:
        proto = _Protocol()
        futures = [loop.create_future() for _ in values]
        proto.waiting.extend(futures)
        stream = b"".join(encode_reply(v) for v in values)
        pos = 0
        for cut in cuts + [len(stream)]:
            proto.data_received(stream[pos:pos + cut])
            pos += cut
            if pos >= len(stream):
                break
        def plain(reply):   # an error inside an array (as in EXEC's) stays a RespError value
            if isinstance(reply, RespError):
                return ("error", str(reply))
            return [plain(r) for r in reply] if isinstance(reply, list) else reply

        got = [plain(fut.exception() or fut.result()) for fut in futures]
        assert got == [expected(v) for v in values] and not proto.buf
    finally:
        loop.close()


def test_command_encoding():
    assert encode_command([b"GET", b"k"]) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"


def publish(server, node_id: str, hashes) -> None:
    index = NodeIndex(connect(server.url, server.password), KEYS, node_id, "i1")
    assert index.heartbeat(NodeInfo(node_id, "both", f"http://{node_id}", "i1"))
    index.publish(stored=hashes)
    assert index.flush()


def test_lookup_matches_redis_py_under_concurrency_and_a_flushed_script_cache(redis_server):
    publish(redis_server, "a", HASHES[:70])
    publish(redis_server, "b", HASHES[:12])
    sync = IndexReader(connect(redis_server.url, redis_server.password), KEYS)
    prompts = [HASHES[:n] for n in (0, 1, 12, 13, 40, 70, 71, 100)] * 25

    async def run():
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS)
        assert reader.conn is not None   # redis:// goes through the lean client
        try:
            got = await asyncio.gather(*(reader.lookup(p) for p in prompts))
            assert got == [sync.lookup(p) for p in prompts]
            redis_server.client().script_flush()   # NOSCRIPT: the script is sent again, once
            assert await reader.lookup(HASHES) == {"a": 70, "b": 12}
        finally:
            await reader.close()
    asyncio.run(run())


def test_a_wrong_password_and_an_outage_are_index_unavailable_then_it_recovers(redis_server):
    publish(redis_server, "a", HASHES[:5])

    async def run():
        wrong = AsyncIndexReader(redis_server.url, "not-the-password", KEYS)
        with pytest.raises(IndexUnavailableError):
            await wrong.lookup(HASHES)
        await wrong.close()
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS, timeout=0.25)
        assert await reader.lookup(HASHES) == {"a": 5}
        redis_server.stop()
        t0 = time.monotonic()
        with pytest.raises(IndexUnavailableError):
            await reader.lookup(HASHES)
        with pytest.raises(IndexUnavailableError):   # no server: the reconnect fails fast too
            await reader.lookup(HASHES)
        assert time.monotonic() - t0 < 2
        redis_server.start()
        publish(redis_server, "a", HASHES[:3])
        assert await reader.lookup(HASHES) == {"a": 3}
        await reader.close()
    asyncio.run(run())


def test_a_stalled_redis_times_out_and_later_replies_are_not_misattributed(redis_server):
    publish(redis_server, "a", HASHES[:9])

    async def run():
        reader = AsyncIndexReader(redis_server.url, redis_server.password, KEYS, timeout=0.2)
        assert await reader.lookup(HASHES) == {"a": 9}
        redis_server.client().client_pause(600)   # every client's commands wait 0.6 s
        t0 = time.monotonic()
        results = await asyncio.gather(*(reader.lookup(HASHES[:n]) for n in (9, 4)), return_exceptions=True)
        assert all(isinstance(r, IndexUnavailableError) for r in results) and time.monotonic() - t0 < 0.5
        await asyncio.sleep(0.6)
        assert await reader.lookup(HASHES[:4]) == {"a": 4}
        assert await reader.lookup(HASHES) == {"a": 9}
        await reader.close()
    asyncio.run(run())
