"""The pool's block-ownership index in Redis: nodes publish, the router looks up.

Node side (``NodeIndex``), called from the engine loop and the heartbeat thread, **never raises for Redis
errors**: it keeps a local mirror of the block hashes it holds, and when Redis is unreachable it marks itself
dirty and retries with exponential backoff (calls inside the backoff window return at once, without touching
the network); the first call that reaches Redis again rewrites the node's whole state from the mirror. A
Redis that restarted empty is noticed by the heartbeat (``SADD nodes`` answers 1 for a node already
registered), and so is one that lost only the node's ``blocks:`` or ``nixl:`` key (its ``PEXPIRE`` answers 0), and
healed the same way.

* ``publish(stored, removed)``: one engine step's block events. It only queues them and returns (the engine thread
  never waits on Redis); the publisher thread drains the queue in order, coalescing what piled up into one
  pipelined MULTI (SREM + SADD + PEXPIRE), and retries a dirty index on its own. ``flush(timeout)`` waits for it.
* ``resync(all_hashes=None)``: full replace (DEL + SADD in chunks) in one MULTI, at start and periodically.
* ``heartbeat(info)``: SET ``hb:`` with TTL, refresh the TTLs of ``blocks:`` and ``nixl:``, SADD ``nodes``.
* ``set_agent_metadata(md)``: the KV agent's metadata under ``nixl:<node>:<incarnation>``.
* ``deregister()``: stop the publisher (queued events are dropped, with a log, after a short flush), DEL all the
  node's keys, SREM from ``nodes``.

Change stream (``events``, for the routers' mirrors, ``router/index_mirror.py``): every MULTI that changes
``blocks:<node>`` also appends one entry (``XADD ... MAXLEN ~ events_maxlen``), so the set and its event land
atomically and in the same order for every reader. An entry's fields (see ``EVENT_FIELDS``): ``n`` node id,
``i`` incarnation, ``s`` the node's sequence number (one per entry, per ``NodeIndex``), ``k`` the kind, ``+`` the
stored and ``-`` the removed hashes (raw 16-byte hashes, concatenated). Kind ``d`` is a delta (SREM ``-`` then
SADD ``+``, as the set got it); kind ``r`` is a reset: the set was rewritten whole (a resync, a dirty rewrite
after an outage or a new incarnation, a deregistration), and a reader re-reads ``blocks:<node>`` instead of
getting the whole set inline. Nothing about the stream can make a node method raise.

Router side (``IndexReader``): ``lookup(block_hashes) -> {node_id: leading blocks held}`` over live nodes and
``live_nodes()``, each **one round trip** (a Lua script; the lookup's block hashes travel concatenated, as one
argument). Lookup cost, run atomically inside Redis:
``O(nodes + sum over live nodes of the blocks checked)``, where a node's check stops at the first chunk
holding a miss (chunks of 32, 64, ... 1024 hashes, one SMISMEMBER each), so it is about the node's matched
prefix, not the prompt length. The script builds key names from the hash-tagged prefix; all are in the
pool's one cluster slot.

Keys, types and TTLs: ``pdpool.kv_index.keys``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from typing import Iterable, Sequence

import redis

from pdpool.block_hash import HASH_BYTES
from pdpool.kv_index.heartbeat import NodeInfo
from pdpool.kv_index.keys import PoolKeys

logger = logging.getLogger(__name__)

_SADD_CHUNK = 10_000
EVENTS_MAXLEN = 10_000      # about; entries of a few hundred bytes to a few kB each
EVENT_DELTA, EVENT_RESET = b"d", b"r"
EVENT_FIELDS = (b"n", b"i", b"s", b"k", b"+", b"-")   # node, incarnation, sequence, kind, stored, removed
_REDIS_ERRORS = (redis.RedisError, OSError)


class IndexUnavailableError(RuntimeError):
    """The router side could not reach Redis."""


def new_incarnation() -> str:
    """A fresh id for this process's life: peers tell a restarted node from its previous self by it."""
    return secrets.token_hex(6)


def connect(url: str, password: str | None = None, timeout: float = 0.5) -> redis.Redis:
    """A client with short timeouts: a slow or dead Redis must cost an engine step milliseconds, not seconds."""
    return redis.Redis.from_url(url, password=password, socket_timeout=timeout, socket_connect_timeout=timeout,
                                health_check_interval=0)


def _raw(h: bytes | str) -> bytes:
    """A block hash as its 16 raw bytes (``BlockHash`` or its hex)."""
    raw = bytes.fromhex(h) if isinstance(h, str) else bytes(h)
    if len(raw) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(raw)}")
    return raw


def _raw_all(hashes: Iterable[bytes | str]) -> list[bytes]:
    """``[_raw(h) for h in hashes]``, with the common case (16 plain bytes, what the engine hands over) checked
    inline: ``publish`` runs on the engine's step thread, and a call per hash was most of its cost."""
    return [h if type(h) is bytes and len(h) == HASH_BYTES else _raw(h) for h in hashes]


def _chunks(items: Sequence[bytes], n: int) -> Iterable[Sequence[bytes]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class NodeIndex:
    """One node's writes to the index. Thread-safe (engine thread + heartbeat thread + its publisher thread)."""

    def __init__(self, client: redis.Redis, keys: PoolKeys, node_id: str, incarnation: str, *,
                 heartbeat_ttl: float = 6.0, state_ttl: float | None = None,
                 backoff_initial: float = 0.2, backoff_max: float = 10.0,
                 events_maxlen: int = EVENTS_MAXLEN) -> None:
        self.client = client
        self.keys = keys
        self.node_id = node_id
        self.incarnation = incarnation
        self.heartbeat_ttl_ms = max(1, int(heartbeat_ttl * 1000))
        # A dead node's blocks/metadata linger this long after its last heartbeat (ignored once hb is gone).
        self.state_ttl_ms = int((state_ttl if state_ttl is not None else max(60.0, 10 * heartbeat_ttl)) * 1000)
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.events_maxlen = events_maxlen
        self._seq = 0                            # of this node's last stream entry (under _lock)
        self._rewriting = False                  # the MULTI being built rewrites the whole set (a reset entry)
        self._lock = threading.Lock()
        self._held: set[bytes] = set()           # mirror of blocks:<node>
        self._agent_md: bytes | None = None
        self._last_info: NodeInfo | None = None
        self._registered = False                 # a heartbeat reached Redis at least once
        self._dirty = True                       # Redis may differ from the mirror: rewrite it all
        self._failures = 0
        self._retry_at = 0.0
        self.num_errors = 0
        # publish() -> publisher thread. Only this condition's lock is taken on the engine thread, never _lock
        # (held across Redis calls).
        self._events: deque[tuple[list[bytes], list[bytes]]] = deque()
        self._events_cv = threading.Condition()
        self._num_queued = 0
        self._num_done = 0
        self._publisher: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def from_config(cls, disagg, node_id: str, incarnation: str) -> "NodeIndex":
        """From ``DisaggConfig``: its Redis URL and password, pool, namespace and heartbeat period."""
        if not disagg.redis:
            raise ValueError("--redis is not set")
        return cls(connect(disagg.redis, disagg.redis_password), PoolKeys(disagg.namespace, disagg.pool),
                   node_id, incarnation, heartbeat_ttl=3 * disagg.heartbeat_seconds)

    @property
    def dirty(self) -> bool:
        return self._dirty

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- public API: never raises for Redis errors; returns whether Redis now matches the mirror ----

    def publish(self, stored: Iterable[bytes | str] = (), removed: Iterable[bytes | str] = ()) -> None:
        """Queue one engine step's events and return at once. A hash in both is removed, then stored (net: held)."""
        event = (_raw_all(stored), _raw_all(removed))
        with self._events_cv:
            if self._stopping:
                return
            if self._publisher is None:
                self._publisher = threading.Thread(target=self._publish_loop, name="pdpool-index-publisher",
                                                   daemon=True)
                self._publisher.start()
            self._events.append(event)
            self._num_queued += 1
            self._events_cv.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event published so far was handled; True if Redis now matches the mirror."""
        deadline = time.monotonic() + timeout
        with self._events_cv:
            target = self._num_queued
            while self._num_done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._events_cv.wait(left):
                    return False
        return not self._dirty

    def resync(self, all_hashes: Iterable[bytes | str] | None = None) -> bool:
        """Replace the node's set with ``all_hashes`` (default: the mirror, to heal lost updates)."""
        with self._lock:
            if all_hashes is not None:
                self._held = set(_raw_all(all_hashes))
            self._dirty = True
            return self._attempt(lambda pipe: None)

    def set_agent_metadata(self, metadata: bytes) -> bool:
        with self._lock:
            self._agent_md = metadata
            return self._attempt(lambda pipe: self._queue_agent_md(pipe))

    def heartbeat(self, info: NodeInfo) -> bool:
        if info.node_id != self.node_id or info.incarnation != self.incarnation:
            raise ValueError(f"heartbeat for {info.node_id}/{info.incarnation} sent through the index of "
                             f"{self.node_id}/{self.incarnation}")
        with self._lock:
            self._last_info = info
            return self._attempt(lambda pipe: self._queue_heartbeat(pipe), check_registration=True)

    def deregister(self, flush_timeout: float = 1.0) -> bool:
        """Remove every key of this node (clean shutdown); events still queued after ``flush_timeout`` are
        dropped (their keys are deleted anyway)."""
        self.flush(flush_timeout)
        with self._events_cv:
            self._stopping = True
            if self._events:
                logger.info("dropping %d queued block events of %s at deregistration", len(self._events),
                            self.node_id)
                self._num_done += len(self._events)
                self._events.clear()
            self._events_cv.notify_all()
        with self._lock:
            self._registered = False
            k = self.keys
            try:
                pipe = self.client.pipeline(transaction=True)
                pipe.delete(k.heartbeat(self.node_id), k.blocks(self.node_id),
                            k.nixl(self.node_id, self.incarnation))
                pipe.srem(k.nodes, self.node_id)
                self._queue_event(pipe, EVENT_RESET)
                pipe.execute()
                return True
            except _REDIS_ERRORS as exc:
                logger.warning("deregister of %s from Redis failed (its keys expire on their own): %s",
                               self.node_id, exc)
                return False

    # ---- internals ----------------------------------------------------------------------------

    def _publish_loop(self) -> None:
        """Drain the queue in order; what piled up (a slow Redis) goes out as one net delta."""
        while True:
            with self._events_cv:
                while not self._events and not self._stopping:
                    retry_in = self._retry_at - time.monotonic() if self._dirty else None
                    if retry_in is not None and retry_in <= 0:
                        break  # a dirty index heals without waiting for the next event
                    self._events_cv.wait(retry_in)
                if self._stopping:
                    return
                events = list(self._events)
                self._events.clear()
            stored: set[bytes] = set()
            removed: set[bytes] = set()
            for step_stored, step_removed in events:
                stored.difference_update(step_removed)
                removed.update(step_removed)
                removed.difference_update(step_stored)
                stored.update(step_stored)
            try:
                with self._lock:
                    self._held.difference_update(removed)
                    self._held.update(stored)
                    if stored or removed or self._dirty:
                        self._attempt(lambda pipe: self._queue_delta(pipe, list(stored), list(removed)))
            except Exception:  # never let the thread die: the next event or retry rewrites the state
                logger.exception("publishing block events of %s failed", self.node_id)
                self._dirty = True
            with self._events_cv:
                self._num_done += len(events)
                self._events_cv.notify_all()

    def _attempt(self, queue_fn, check_registration: bool = False) -> bool:
        now = time.monotonic()
        if now < self._retry_at:
            self._dirty = True
            return False
        try:
            pipe = self.client.pipeline(transaction=True)
            was_dirty = self._dirty
            if was_dirty:
                self._queue_full_state(pipe)
            self._rewriting = was_dirty
            try:
                queue_fn(pipe)
            finally:
                self._rewriting = False
            results = pipe.execute()
        except _REDIS_ERRORS as exc:
            self._on_error(exc)
            return False
        if self._failures:
            logger.info("Redis reachable again; node %s state rewritten (%d blocks)", self.node_id, len(self._held))
        self._failures = 0
        self._dirty = False
        if check_registration:
            # The heartbeat's replies end [PEXPIRE blocks, PEXPIRE nixl, SADD nodes]: a PEXPIRE of 0 is a key that
            # is gone, and SADD adding the node means it was not registered.
            expire_blocks, expire_nixl, added = results[-3:]
            lost = added == 1 or (self._held and expire_blocks == 0) or (self._agent_md is not None
                                                                          and expire_nixl == 0)
            if self._registered and not was_dirty and lost:
                # Redis lost our keys (a restart, a flush, an eviction of keys with a TTL, a failover).
                logger.warning("Redis lost node %s's keys; rewriting them", self.node_id)
                self._dirty = True
                return self._attempt(lambda pipe: None)
            self._registered = True
        return True

    def _on_error(self, exc: BaseException) -> None:
        self._dirty = True
        self._failures += 1
        self.num_errors += 1
        delay = min(self.backoff_max, self.backoff_initial * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + delay
        log = logger.warning if self._failures == 1 else logger.debug
        log("Redis unavailable for node %s (%s: %s); retrying in %.2fs, then resyncing", self.node_id,
            type(exc).__name__, exc, delay)

    def _queue_delta(self, pipe, stored: list[bytes], removed: list[bytes]) -> None:
        key = self.keys.blocks(self.node_id)
        for chunk in _chunks(removed, _SADD_CHUNK):
            pipe.srem(key, *chunk)
        for chunk in _chunks(stored, _SADD_CHUNK):
            pipe.sadd(key, *chunk)
        pipe.pexpire(key, self.state_ttl_ms)
        if not self._rewriting and (stored or removed):  # a rewrite's reset entry covers it
            self._queue_event(pipe, EVENT_DELTA, stored, removed)

    def _queue_event(self, pipe, kind: bytes, stored: Sequence[bytes] = (), removed: Sequence[bytes] = ()) -> None:
        """One stream entry in the MULTI being built. A MULTI that fails leaves the index dirty, and the rewrite
        that heals it appends a reset, so a sequence number lost with a failed MULTI is never waited for."""
        self._seq += 1
        pipe.xadd(self.keys.events, {b"n": self.node_id, b"i": self.incarnation, b"s": self._seq, b"k": kind,
                                     b"+": b"".join(stored), b"-": b"".join(removed)},
                  maxlen=self.events_maxlen, approximate=True)

    def _queue_agent_md(self, pipe) -> None:
        if self._agent_md is not None:
            pipe.set(self.keys.nixl(self.node_id, self.incarnation), self._agent_md, px=self.state_ttl_ms)

    def _queue_heartbeat(self, pipe) -> None:
        """Ends with SADD nodes, whose reply tells whether Redis still knew this node."""
        k = self.keys
        if self._last_info is not None:
            pipe.set(k.heartbeat(self.node_id), self._last_info.to_json(), px=self.heartbeat_ttl_ms)
        pipe.pexpire(k.blocks(self.node_id), self.state_ttl_ms)
        pipe.pexpire(k.nixl(self.node_id, self.incarnation), self.state_ttl_ms)
        pipe.sadd(k.nodes, self.node_id)

    def _queue_full_state(self, pipe) -> None:
        key = self.keys.blocks(self.node_id)
        pipe.delete(key)
        for chunk in _chunks(list(self._held), _SADD_CHUNK):
            pipe.sadd(key, *chunk)
        pipe.pexpire(key, self.state_ttl_ms)
        self._queue_event(pipe, EVENT_RESET)
        self._queue_agent_md(pipe)
        self._queue_heartbeat(pipe)


# KEYS[1] = nodes set; ARGV[1] = key prefix; ARGV[2] = the block hashes in prompt order, concatenated (one
# argument: packing one 16-byte argument per block cost the router 0.1-0.2 ms of CPU per request). Every node's
# check walks the same chunks (32, 64, ... 1024 hashes), so each chunk is cut from the string once.
LOOKUP_LUA = """
local prefix = ARGV[1]
local packed = ARGV[2] or ''
local size = %(size)d
if #packed %% size ~= 0 then
  return redis.error_reply('block hashes must be ' .. size .. ' bytes each')
end
local last = #packed / size
local cut = {}
local function chunk(i, j)
  local t = cut[i]
  if t == nil then
    t = {}
    for k = i, j do t[#t + 1] = string.sub(packed, (k - 1) * size + 1, k * size) end
    cut[i] = t
  end
  return t
end
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', prefix .. 'hb:' .. node) == 1 then
    local key = prefix .. 'blocks:' .. node
    local held, i, step, full = 0, 1, 32, true
    while full and i <= last do
      local j = math.min(i + step - 1, last)
      local m = redis.call('SMISMEMBER', key, unpack(chunk(i, j)))
      for k = 1, #m do
        if m[k] == 1 then held = held + 1 else full = false; break end
      end
      i = j + 1
      step = math.min(step * 2, 1024)
    end
    out[#out + 1] = node
    out[#out + 1] = held
  elseif redis.call('EXISTS', prefix .. 'blocks:' .. node) == 0 then
    redis.call('SREM', KEYS[1], node)
  end
end
return out
""" % {"size": HASH_BYTES}


def lookup_args(prefix: str, block_hashes: Sequence[bytes | str]) -> list[bytes]:
    """``LOOKUP_LUA``'s ARGV: the key prefix, then every block hash (raw bytes or hex) in one string."""
    return [prefix.encode(), b"".join(_raw_all(block_hashes))]

# KEYS[1] = nodes set; ARGV[1] = key prefix. Returns [node, heartbeat JSON, ...] for live nodes.
_LIVE_LUA = """
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local hb = redis.call('GET', ARGV[1] .. 'hb:' .. node)
  if hb then
    out[#out + 1] = node
    out[#out + 1] = hb
  end
end
return out
"""


class IndexReader:
    """The router's (and peers') view of a pool. Raises ``IndexUnavailableError`` when Redis is down."""

    def __init__(self, client: redis.Redis, keys: PoolKeys) -> None:
        self.client = client
        self.keys = keys
        self._lookup = client.register_script(LOOKUP_LUA)   # EVALSHA, falls back to EVAL once
        self._live = client.register_script(_LIVE_LUA)

    def lookup(self, block_hashes: Sequence[bytes | str]) -> dict[str, int]:
        """``{node_id: number of leading blocks of block_hashes it holds}`` for every live node."""
        try:
            flat = self._lookup(keys=[self.keys.nodes], args=lookup_args(self.keys.prefix, block_hashes))
        except _REDIS_ERRORS as exc:
            raise IndexUnavailableError(f"block lookup failed: {exc}") from exc
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def live_nodes(self) -> dict[str, NodeInfo]:
        try:
            flat = self._live(keys=[self.keys.nodes], args=[self.keys.prefix])
        except _REDIS_ERRORS as exc:
            raise IndexUnavailableError(f"live node listing failed: {exc}") from exc
        return {flat[i].decode(): NodeInfo.from_json(flat[i + 1]) for i in range(0, len(flat), 2)}

    def server_run_id(self) -> str:
        """The Redis server's ``run_id``: it changes when the server restarts (its keys may be gone then)."""
        try:
            return str(self.client.info("server")["run_id"])
        except (*_REDIS_ERRORS, KeyError) as exc:
            raise IndexUnavailableError(f"server info failed: {exc}") from exc

    def heartbeat(self, node_id: str) -> NodeInfo | None:
        """A node's last heartbeat while it is live, else None."""
        try:
            data = self.client.get(self.keys.heartbeat(node_id))
        except _REDIS_ERRORS as exc:
            raise IndexUnavailableError(f"heartbeat fetch failed: {exc}") from exc
        return None if data is None else NodeInfo.from_json(data)

    def agent_metadata(self, node_id: str, incarnation: str) -> bytes | None:
        """A peer's KV agent metadata, or None (unknown node, or another incarnation of it)."""
        try:
            return self.client.get(self.keys.nixl(node_id, incarnation))
        except _REDIS_ERRORS as exc:
            raise IndexUnavailableError(f"agent metadata fetch failed: {exc}") from exc
