"""A router-local copy of the nodes' block sets, so the precise prefix lookup needs no network I/O per request.

The nodes append every change of their ``blocks:<node>`` sets to the pool's ``events`` stream, in the MULTI that
makes it (``pdpool.kv_index.redis_index``: node, incarnation, sequence number, delta or reset). The mirror keeps
``{node: (incarnation, last sequence, set of hashes)}`` and runs one background task on its own connection::

    bootstrap:  last = the stream's last entry id (0-0 if none)
                for each node in ``nodes`` with a heartbeat: GET hb (incarnation), SSCAN blocks:<node>
    tail:       READ_AFTER (one Lua call: the entries after ``last``, but only if the entry ``last`` is still
                there; trimming cuts from the oldest end, so then nothing after it was cut; else bootstrap
                again); when it finds nothing new, XREAD BLOCK from ``last`` (an entry added while the mirror
                waits is handed over right after the command that added it, so none is trimmed unread)
    per entry:  delta of the known incarnation, next sequence -> SREM/SADD locally
                reset, unknown node or incarnation, sequence gap -> re-snapshot that node after the batch

Why a snapshot and a replay agree: the snapshot starts after ``last`` was read, and everything that changed a
set while it ran is an entry after ``last``, replayed next; replaying a delta that the snapshot already holds
leaves the same set (each hash ends as the last entry that touched it says). A hash no entry touched since
``last`` was in (or out of) the set for the whole scan, and SSCAN reports exactly those.

``lookup(hashes, incarnations)`` walks each node's set from the first block (count the leading hashes held) and
returns ``None`` when it cannot answer truthfully: not live yet (bootstrapping, or the connection is down, then
the caller asks Redis with the Lua script, which fails fast when Redis is down: approximate mode as before), or a
node it has never looked up (asked for in the background; a node found without a heartbeat counts 0 and is
looked at again every ``recheck_seconds``). A node whose incarnation differs from the caller's counts 0 until its
new incarnation's reset has been read (the stale-incarnation rule of ``router/prefix_index.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from itertools import takewhile
from typing import Sequence

from pdpool.block_hash import HASH_BYTES
from pdpool.kv_index.keys import PoolKeys
from pdpool.kv_index.redis_index import EVENT_RESET
from pdpool.router.resp import RespConnection, RespError, RespUnavailable

logger = logging.getLogger("pdpool.router")

_NO_ID = b"0-0"
# KEYS[1] = the stream; ARGV = last id read, count. -1 when the entry ``last`` was trimmed (entries after it may
# have been too); else up to ``count`` entries after it.
READ_AFTER_LUA = b"""
local last = ARGV[1]
if last ~= '0-0' and #redis.call('XRANGE', KEYS[1], last, last) == 0 then return -1 end
return redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', ARGV[2])
"""
_READ_AFTER_SHA = hashlib.sha1(READ_AFTER_LUA).hexdigest().encode()
# KEYS = hb, blocks, nodes; ARGV[1] = node id. A node whose heartbeat and set are both gone leaves ``nodes`` (what
# the Lua lookup does on its way; with the mirror that lookup rarely runs).
PRUNE_LUA = b"""
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[2]) == 0 then
  return redis.call('SREM', KEYS[3], ARGV[1])
end
return 0
"""


class _Resync(Exception):
    """Entries may be missing (the stream was trimmed past the mirror): bootstrap again."""


class _Node:
    __slots__ = ("incarnation", "seq", "blocks")

    def __init__(self, incarnation: str | None, blocks: set[bytes]) -> None:
        self.incarnation = incarnation
        self.seq: int | None = None      # unknown right after a snapshot: the next entry sets it
        self.blocks = blocks


def _split(packed: bytes) -> list[bytes]:
    return [packed[i:i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


class IndexMirror:
    def __init__(self, conn: RespConnection, keys: PoolKeys, *, block_ms: int = 500, count: int = 1000,
                 min_interval: float = 0.025, scan_count: int = 2000, recheck_seconds: float = 5.0,
                 backoff_initial: float = 0.1, backoff_max: float = 5.0) -> None:
        self.conn = conn                      # its own connection: XREAD BLOCK holds it
        self.keys = keys
        self.block_ms = block_ms
        self.count = count
        # Between reads: entries arriving meanwhile come in one batch. Every read costs the router a write that
        # wakes Redis, a parse and a task wake-up, whether it brings one entry or fifty: 25 ms instead of 10 read
        # 36 instead of 88 times a second while nodes publish every 10 ms, -31 us of router CPU per request at
        # 200 req/s (benchmarks/router_cpu_replay.py --rate 200), and a block is visible 14 ms after its publish
        # at p50, 26 ms at p99, instead of 6 and 11 (benchmarks/router_mirror_freshness.py; docs/performance.md).
        # The router's own decisions count at once anyway (PrefixIndex's ``recent_seconds`` record).
        self.min_interval = min_interval
        self.scan_count = scan_count
        self.recheck_seconds = recheck_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.nodes: dict[str, _Node] = {}
        self.live = False                     # bootstrapped and caught up with the stream
        self.last_id = _NO_ID
        self.num_resyncs = 0                  # full bootstraps after the first (trimmed stream, reconnects)
        self.num_snapshots = 0                # per-node re-reads (resets, gaps, unknown incarnations or nodes)
        self._stream = keys.events.encode()
        self._wanted: set[str] = set()        # nodes a lookup did not find: snapshot them
        self._absent: dict[str, float] = {}   # node -> when a snapshot found no heartbeat for it
        self._task: asyncio.Task | None = None
        self.on_live = None                   # called each time the mirror is live again (PrefixIndex's mode)

    # ---- the request path: no I/O ------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], incarnations: dict[str, str | None]) -> dict[str, int] | None:
        """``{node: leading blocks of hashes held}`` for the nodes of ``incarnations``, or None (ask Redis)."""
        if not self.live:
            return None
        nodes = self.nodes
        out = {}
        for n, incarnation in incarnations.items():
            node = nodes.get(n)
            if node is None:
                seen_absent = self._absent.get(n)
                if seen_absent is None:
                    self._wanted.add(n)
                    return None
                if time.monotonic() - seen_absent > self.recheck_seconds:
                    self._wanted.add(n)
                out[n] = 0
            elif incarnation is not None and node.incarnation != incarnation:
                out[n] = 0
            else:   # the leading hashes held: takewhile calls the set's own __contains__, no Python per hash
                out[n] = len(list(takewhile(node.blocks.__contains__, hashes)))
        return out

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="pdpool-index-mirror")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.live = False
        self.conn.close()

    async def run(self) -> None:
        failures = 0
        first = True
        while True:
            try:
                self.live = False
                await self._bootstrap()
                if not first:
                    self.num_resyncs += 1
                first = False
                if failures:
                    logger.info("index mirror: Redis stream reachable again; %d nodes re-read", len(self.nodes))
                failures = 0
                await self._tail()
            except _Resync as exc:
                logger.info("index mirror: %s; reading every node again", exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the mirror must keep trying
                self.live = False
                failures += 1
                delay = min(self.backoff_max, self.backoff_initial * 2 ** (failures - 1))
                if failures == 1:
                    level = logging.WARNING if isinstance(exc, (RespUnavailable, RespError, OSError)) else logging.ERROR
                    logger.log(level, "index mirror: the Redis stream is unreachable (%s: %s); lookups go to Redis "
                               "directly until it is back (approximate mode while Redis is down)",
                               type(exc).__name__, exc, exc_info=level == logging.ERROR)
                self.conn.close()
                await asyncio.sleep(delay)

    # ---- bootstrap and tail -------------------------------------------------------------------------------

    async def _bootstrap(self) -> None:
        call = self.conn.call
        newest = await call([b"XREVRANGE", self._stream, b"+", b"-", b"COUNT", b"1"])
        self.last_id = newest[0][0] if newest else _NO_ID
        members = await call([b"SMEMBERS", self.keys.nodes.encode()])
        self.nodes = {}
        self._absent.clear()
        self._wanted.clear()
        for raw in members:
            await self._snapshot(raw.decode())

    async def _read_after(self, count_arg: bytes):
        args = [b"1", self._stream, self.last_id, count_arg]
        try:
            return await self.conn.call([b"EVALSHA", _READ_AFTER_SHA, *args])
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.conn.call([b"EVAL", READ_AFTER_LUA, *args])   # caches it

    async def _snapshot(self, node_id: str) -> None:
        call = self.conn.call
        hb = await call([b"GET", self.keys.heartbeat(node_id).encode()])
        if hb is None:                       # not live: counts 0, looked at again later
            self.nodes.pop(node_id, None)
            self._absent[node_id] = time.monotonic()
            await call([b"EVAL", PRUNE_LUA, b"3", self.keys.heartbeat(node_id).encode(),
                        self.keys.blocks(node_id).encode(), self.keys.nodes.encode(), node_id.encode()])
            return
        try:
            incarnation = json.loads(hb).get("incarnation")
        except (ValueError, AttributeError):
            incarnation = None
        key = self.keys.blocks(node_id).encode()
        blocks: set[bytes] = set()
        cursor = b"0"
        count = str(self.scan_count).encode()
        while True:
            cursor, items = await call([b"SSCAN", key, cursor, b"COUNT", count])
            blocks.update(items)
            if cursor == b"0":
                break
        self.nodes[node_id] = _Node(incarnation, blocks)
        self._absent.pop(node_id, None)
        self.num_snapshots += 1

    async def _tail(self) -> None:
        call = self.conn.call
        count = self.count
        count_arg = str(count).encode()
        block_arg = str(self.block_ms).encode()
        while True:
            got = await self._read_after(count_arg)
            if got == -1:
                raise _Resync("the stream was trimmed past the mirror's last entry")
            if got and self.last_id == _NO_ID:   # the stream began after a bootstrap that found none
                raise _Resync("the stream started after the mirror's bootstrap")
            if not got and self.live:
                reply = await call([b"XREAD", b"COUNT", count_arg, b"BLOCK", block_arg, b"STREAMS", self._stream,
                                    self.last_id])
                got = reply[0][1] if reply else []
            pending = self._apply(got)
            pending.update(self._wanted)
            self._wanted.clear()
            for node_id in pending:
                await self._snapshot(node_id)
            if not self.live and len(got) < count:   # caught up since the bootstrap
                self.live = True
                logger.info("index mirror live: %d nodes, %d block hashes", len(self.nodes),
                            sum(len(n.blocks) for n in self.nodes.values()))
                if self.on_live is not None:
                    self.on_live()
            if got and self.min_interval:
                await asyncio.sleep(self.min_interval)

    def _apply(self, entries: list) -> set[str]:
        """Apply stream entries in order; returns the nodes to read again."""
        pending: set[str] = set()
        nodes = self.nodes
        for entry_id, fields in entries:
            self.last_id = entry_id
            f = dict(zip(fields[::2], fields[1::2]))
            try:
                node_id = f[b"n"].decode()
                incarnation = f[b"i"].decode()
                seq = int(f[b"s"])
                kind = f[b"k"]
                stored, removed = f[b"+"], f[b"-"]
            except (KeyError, ValueError, AttributeError):
                logger.warning("index mirror: unreadable stream entry %r skipped", entry_id)
                continue
            if node_id in pending:
                continue
            node = nodes.get(node_id)
            if (kind == EVENT_RESET or node is None or node.incarnation != incarnation
                    or (node.seq is not None and seq != node.seq + 1)):
                pending.add(node_id)
                continue
            node.seq = seq
            if removed:
                node.blocks.difference_update(_split(removed))
            if stored:
                node.blocks.update(_split(stored))
        return pending
