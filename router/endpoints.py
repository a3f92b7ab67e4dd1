"""A node as the router sees it, and the pool snapshot that discovery keeps current.

Discovery sources replace the whole list of endpoints they know (``Pool.replace``); the router's own
observations (a failed connection, a 429) live here too, as a cooldown, so every source gets them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pdpool.block_hash import ModelFingerprint
from pdpool.kv_index.heartbeat import NodeLoad as Load

logger = logging.getLogger("pdpool.router")

DECODE_ROLES = ("decode", "both")


@dataclass
class Endpoint:
    node_id: str
    url: str                               # http://host:port, no trailing slash
    role: str                              # prefill | decode | both
    source: str = "static"                 # static | redis | kubernetes
    pdpool: bool | None = None             # speaks pdpool's extensions (token ids, kv_transfer_params)
    incarnation: str | None = None
    fingerprint: ModelFingerprint | None = None
    ready: bool = True
    draining: bool = False
    load: Load = field(default_factory=Load)  # the nodes' heartbeat load (pdpool.kv_index.heartbeat.NodeLoad)
    max_model_len: int | None = None

    @property
    def can_decode(self) -> bool:
        return self.role in DECODE_ROLES

    @property
    def can_prefill(self) -> bool:
        return self.role == "prefill" and self.pdpool is not False


class Pool:
    """The endpoints of every source, plus the router's cooldowns (node id -> monotonic time it ends)."""

    def __init__(self, cooldown_seconds: float = 2.0) -> None:
        self.cooldown_seconds = cooldown_seconds
        self._by_source: dict[str, dict[str, Endpoint]] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self._cooldown_until: dict[str, float] = {}
        self._busy: set[str] = set()        # nodes whose cooldown is for a 429: up, at capacity
        self.listeners: list = []           # fn(old: Endpoint | None, new: Endpoint | None) on every change

    def replace(self, source: str, endpoints: list[Endpoint]) -> None:
        new = {e.node_id: e for e in endpoints}
        self._by_source[source] = new
        merged: dict[str, Endpoint] = {}
        for eps in self._by_source.values():
            merged.update(eps)
        for node_id in set(self.endpoints) | set(merged):
            old, cur = self.endpoints.get(node_id), merged.get(node_id)
            if old is None or cur is None or old.incarnation != cur.incarnation:
                for fn in self.listeners:
                    fn(old, cur)
            if cur is None:   # gone (node ids change at every rollout): its cooldown goes with it
                self._cooldown_until.pop(node_id, None)
                self._busy.discard(node_id)
        self.endpoints = merged

    def usable(self, e: Endpoint, now: float | None = None) -> bool:
        if not e.ready or e.draining:
            return False
        until = self._cooldown_until.get(e.node_id)
        return until is None or (now or time.monotonic()) >= until

    def cool_down(self, node_id: str, seconds: float | None = None, busy: bool = False) -> None:
        """Leave a node out for a while: it refused a connection, timed out, or answered 5xx, or 429 (``busy``)."""
        self._cooldown_until[node_id] = time.monotonic() + (self.cooldown_seconds if seconds is None else seconds)
        if busy:
            self._busy.add(node_id)
        else:
            self._busy.discard(node_id)

    def busy_seconds(self) -> float | None:
        """How long until the first node left out for its 429 (up, at capacity) may be tried again; None when no
        such cooldown runs. An entry of ``_busy`` whose cooldown ended (``recovered``) counts for nothing."""
        now = time.monotonic()
        waits = [self._cooldown_until.get(n, now) - now for n in self._busy
                 if n in self.endpoints and self.endpoints[n].ready and not self.endpoints[n].draining]
        waits = [w for w in waits if w > 0]
        return min(waits) if waits else None

    def recovered(self, node_id: str) -> None:
        self._cooldown_until.pop(node_id, None)

    def decode_candidates(self) -> list[Endpoint]:
        now = time.monotonic()
        eps = [e for e in self.endpoints.values() if e.can_decode and self.usable(e, now)]
        return eps or self.whole_request_prefill_nodes(now)

    def whole_request_prefill_nodes(self, now: float | None = None) -> list[Endpoint]:
        """Usable prefill nodes, for a request no decode node can take: a prefill node serves whole requests
        too, better than a 503."""
        now = now or time.monotonic()
        return [e for e in self.endpoints.values() if e.role == "prefill" and self.usable(e, now)]

    def prefill_candidates(self) -> list[Endpoint]:
        now = time.monotonic()
        return [e for e in self.endpoints.values() if e.can_prefill and self.usable(e, now)]

    def any_ready(self) -> bool:
        return bool(self.decode_candidates())
