"""How many leading blocks of a prompt each node holds: precise from Redis, approximate from a local LRU.

Precise: the nodes publish their block hashes to Redis, and every change to the pool's event stream. By default
(``--index-lookup mirror``) a router-local mirror of the nodes' sets, fed by that stream
(``router/index_mirror.py``), answers with no network I/O; when it cannot (starting, re-reading after an outage),
or with ``--index-lookup redis``, one Lua round trip (``IndexReader.lookup``) answers for every live node. Both
read what the nodes wrote, so two routers share one truthful view (active-active). Approximate: the router remembers, in
an LRU of block hashes, where it sent recent prompts. It is filled on every routed request, so it is warm when
Redis goes away; while Redis is unreachable the router uses it (logged once, ``pdpool_router_index_mode``) and
retries Redis after a backoff, without touching the network inside the backoff window.

Stale state: the approximate entries are tagged with the node's incarnation and ignored after a restart. A
node's Redis set is rewritten in the same transaction as its first heartbeat of a new incarnation; until the
router has seen that heartbeat, a node it failed to reach is *distrusted*: its entries count for nothing until
its incarnation changes or it answers again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Sequence

from pdpool.block_hash import BlockHash
from pdpool.kv_index import IndexUnavailableError

logger = logging.getLogger("pdpool.router")

# A prefix this router sent to a node counts as held there for this long, even before the node has computed
# it and published it to Redis (one prefill, seconds on a loaded CPU): otherwise a group's next request, routed
# meanwhile, sees no holder anywhere and goes to the least-loaded node, which computes the prefix again.
RECENT_SECONDS = 5.0


class ApproxIndex:
    """The approximate index: ``ApproxIndex(capacity)`` returns the C table (``ApproxTable`` of
    ``pdpool/csrc/pieces.c``, built by ``pdpool.native_text``) where the native module loads, else a
    ``PyApproxIndex``; this is the one place the implementation is chosen (``PDPOOL_ROUTER_NATIVE=0``: Python).
    Both give the same answers, LRU order included (``tests/router/test_approx_index_native.py``). The C table
    takes only what the router passes: block hashes as ``bytes`` of ``HASH_BYTES`` (16) bytes (else TypeError or
    ValueError), node ids and incarnations that are hashable (compared as dict keys), times as floats (``owner``
    gives a float), a capacity from 0 to 2**30; the Python class takes any hashable block hash."""

    def __new__(cls, capacity: int):
        table = _native_table()
        return table(capacity) if table is not None else PyApproxIndex(capacity)


def _native_table():
    from pdpool import native_text

    return getattr(native_text.load(), "ApproxTable", None)


class PyApproxIndex:
    """block hash -> {node_id: (incarnation, time recorded)}, LRU-bounded to ``capacity`` hashes.

    Stored compactly: a hash that one node holds (the common case) maps to the recording call's one
    ``(node_id, incarnation, time)`` tuple, shared by every hash of that call, so a routed prompt adds no object
    per block; a hash that several nodes hold maps to the dict. ``owner(h, node_id)`` reads either form.

    Recording a hash already held moves it to the most recent end of the LRU; a new hash is appended, and the
    least recently recorded one is dropped when that makes more than ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[bytes, tuple | dict[str, tuple[str | None, float]]] = OrderedDict()

    def record(self, hashes: Sequence[BlockHash], node_id: str, incarnation: str | None,
               now: float | None = None) -> None:
        lru = self._lru
        get, move_to_end, capacity = lru.get, lru.move_to_end, self.capacity
        recorded = time.monotonic() if now is None else now
        single = (node_id, incarnation, recorded)
        entry = (incarnation, recorded)
        for h in hashes:
            owners = get(h)
            if owners is None:
                lru[h] = single
                if len(lru) > capacity:
                    lru.popitem(last=False)
                continue
            if type(owners) is tuple:
                lru[h] = single if owners[0] == node_id else {owners[0]: owners[1:], node_id: entry}
            else:
                owners[node_id] = entry
            move_to_end(h)

    def owner(self, h: BlockHash, node_id: str) -> tuple[str | None, float] | None:
        """(incarnation, time recorded) of ``node_id``'s entry for ``h``, or None."""
        owners = self._lru.get(h)
        if owners is None:
            return None
        if type(owners) is tuple:
            return owners[1:] if owners[0] == node_id else None
        return owners.get(node_id)

    def lookup(self, hashes: Sequence[BlockHash], incarnations: dict[str, str | None],
               since: float | None = None) -> dict[str, int]:
        """Leading blocks per node, counting only entries made under the node's current incarnation (and, with
        ``since``, recorded at or after that time).

        Scans from the last block back: hashes are chained, so a block recorded for a node (one ``record`` call
        per routed prompt) means its whole prefix was sent there at that time, and the first valid entry from the
        end is the node's match. A request's fresh tail costs one dict miss per block, and the shared prefix
        one hit, instead of a walk over every block of it."""
        matched = {n: 0 for n in incarnations}
        pending = len(matched)
        get = self._lru.get
        for i in range(len(hashes) - 1, -1, -1):
            owners = get(hashes[i])
            if not owners:
                continue
            if type(owners) is tuple:
                n, incarnation, recorded = owners
                if matched.get(n) == 0 and incarnation == incarnations[n] and (since is None or recorded >= since):
                    matched[n] = i + 1
                    pending -= 1
            else:
                for n, (incarnation, recorded) in owners.items():
                    if matched.get(n) == 0 and incarnation == incarnations[n] and (since is None or recorded >= since):
                        matched[n] = i + 1
                        pending -= 1
            if not pending:
                break
        return matched

    def keys(self) -> list[BlockHash]:
        """The block hashes, least recently recorded first (the next to be dropped)."""
        return list(self._lru)

    def __len__(self) -> int:
        return len(self._lru)


class PrefixIndex:
    """``lookup(hashes, endpoints) -> {node_id: matched leading blocks}`` in the current mode."""

    def __init__(self, reader, approx: ApproxIndex, run_sync, metrics=None, backoff_initial: float = 0.5,
                 backoff_max: float = 5.0, recent_seconds: float = RECENT_SECONDS, lookup: str = "mirror") -> None:
        self.reader = reader              # IndexReader or None (no Redis: approximate only)
        self.lookup_mode = lookup         # "mirror" (router-local copy, router/index_mirror.py) or "redis" (Lua)
        self._async_reader = None         # AsyncIndexReader, set once the event loop runs: lookups stay on it
        self.approx = approx
        self.run_sync = run_sync
        self.metrics = metrics
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.recent_seconds = recent_seconds
        self._failures = 0
        self._retry_at = 0.0
        self.distrusted: dict[str, str | None] = {}   # node_id -> incarnation it had when it failed
        self.mode = "precise" if reader is not None else "approximate"
        self._set_mode(self.mode)

    @property
    def async_reader(self):
        return self._async_reader

    @async_reader.setter
    def async_reader(self, reader) -> None:
        """Set on the running event loop; in mirror mode the reader starts tailing the nodes' event stream."""
        self._async_reader = reader
        if reader is not None and self.lookup_mode == "mirror" and hasattr(reader, "start_mirror"):
            mirror = reader.start_mirror()
            if mirror is not None:
                mirror.on_live = self._mirror_live

    def _mirror_live(self) -> None:
        """The mirror read Redis whole again: precise mode at once, without waiting for a request with a full
        block to try Redis (one of short prompts only never would)."""
        if self.mode != "precise" or self._failures:
            self._retry_at = 0.0
            self._on_success()

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        if self.metrics is not None:
            self.metrics.set_index_mode(mode)

    # ---- stale state ----------------------------------------------------------------------------------

    def distrust(self, node_id: str, incarnation: str | None) -> None:
        self.distrusted[node_id] = incarnation

    def trust(self, node_id: str) -> None:
        self.distrusted.pop(node_id, None)

    def on_change(self, old, new) -> None:
        """Pool listener: a node came, went, or restarted (new incarnation)."""
        if old is not None and new is not None and old.incarnation != new.incarnation:
            logger.info("node %s restarted (incarnation %s -> %s); its old index entries are ignored",
                        new.node_id, old.incarnation, new.incarnation)
        if new is not None and self.distrusted.get(new.node_id, new.incarnation) != new.incarnation:
            self.trust(new.node_id)

    # ---- lookup -----------------------------------------------------------------------------------------

    async def lookup(self, hashes: Sequence[BlockHash], endpoints) -> dict[str, int]:
        incarnations = {e.node_id: e.incarnation for e in endpoints}
        matched = None
        if hashes and self.reader is not None and time.monotonic() >= self._retry_at:
            try:
                reader = self._async_reader
                if reader is not None:
                    mirror = getattr(reader, "mirror", None)
                    found = mirror.lookup(hashes, incarnations) if mirror is not None else None
                    if found is None:
                        found = await reader.lookup(hashes)
                else:
                    found = await self.run_sync(self.reader.lookup, hashes)
                matched = {n: found.get(n, 0) for n in incarnations}
                self._on_success()
                if self.recent_seconds > 0:  # routed here just now: not in Redis until the node has prefilled
                    recent = self.approx.lookup(hashes, incarnations, since=time.monotonic() - self.recent_seconds)
                    matched = {n: max(m, recent[n]) for n, m in matched.items()}
            except IndexUnavailableError as exc:
                self._on_failure(exc)
        if matched is None:
            matched = self.approx.lookup(hashes, incarnations) if hashes else {n: 0 for n in incarnations}
        for n in self.distrusted:
            if n in matched:
                matched[n] = 0
        return matched

    def record(self, hashes: Sequence[BlockHash], endpoint) -> None:
        if hashes:
            self.approx.record(hashes, endpoint.node_id, endpoint.incarnation)

    def _on_success(self) -> None:
        if self._failures:
            logger.info("Redis reachable again: prefix index back to precise mode")
        self._failures = 0
        if self.mode != "precise":
            self._set_mode("precise")

    def _on_failure(self, exc: Exception) -> None:
        self._failures += 1
        delay = min(self.backoff_max, self.backoff_initial * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + delay
        if self.mode != "approximate":
            logger.warning("Redis unreachable (%s): prefix index degraded to approximate mode (router-local LRU); "
                           "retrying Redis with backoff", exc)
            if self.metrics is not None:
                self.metrics.index_degradations.inc()
            self._set_mode("approximate")
