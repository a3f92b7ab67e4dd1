"""What a node says about itself every ``heartbeat_seconds``, and the thread that says it.

The heartbeat is the node's liveness: the router treats a node as live exactly while its ``hb:`` key exists
(TTL = 3 heartbeat periods). The payload is small JSON, read by the router's scorers (load) and by peers
(url, incarnation, agent name for KV transfer).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from pdpool.config import ROLES
from pdpool.kv_index.keys import PROTOCOL_VERSION

logger = logging.getLogger(__name__)



@dataclass
class NodeLoad:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0      # fraction of KV blocks in use, 0..1
    num_free_blocks: int = 0


@dataclass
class NodeInfo:
    """The heartbeat payload."""
    node_id: str
    role: str
    url: str
    incarnation: str
    agent_name: str | None = None
    draining: bool = False
    load: NodeLoad = field(default_factory=NodeLoad)
    protocol_version: int = PROTOCOL_VERSION
    # The block-hash fingerprint ({"model_id", "dtype", "block_size"}: pdpool.block_hash.ModelFingerprint), so a
    # router hashes prompts as this node does, and refuses a node whose hashes could never match its own.
    fingerprint: dict | None = None
    # Prefix-cache counters since the node started (tokens looked up, tokens found), for `pdpool status`.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    max_model_len: int | None = None   # the node's context limit, for the router's /v1/models card

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> "NodeInfo":
        d: dict[str, Any] = json.loads(data)
        d["load"] = NodeLoad(**d.get("load", {}))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


class HeartbeatThread:
    """Calls ``index.heartbeat(info_fn())`` every ``period`` seconds on a daemon thread.

    ``info_fn`` reads the engine's current load; it must be cheap and thread-safe (plain attribute reads).
    ``resync_every`` heartbeats the index is also fully resynced from its local mirror, so an update lost
    in any way heals within that many periods.
    """

    def __init__(self, index, info_fn: Callable[[], NodeInfo], period: float, resync_every: int = 30) -> None:
        self.index = index
        self.info_fn = info_fn
        self.period = period
        self.resync_every = resync_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdpool-heartbeat", daemon=True)

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        beats = 0
        while not self._stop.is_set():
            try:
                self.index.heartbeat(self.info_fn())
                beats += 1
                if self.resync_every and beats % self.resync_every == 0:
                    self.index.resync()
            except Exception:  # the index never raises for Redis errors; this guards info_fn
                logger.exception("heartbeat failed")
            self._stop.wait(self.period)
