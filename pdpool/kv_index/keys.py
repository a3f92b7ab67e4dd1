"""Redis keys of one pool's block-ownership index, versioned and hash-tagged.

Every key starts with ``pdpool:v1:{<namespace>/<pool>}:``. The hash tag ``{<namespace>/<pool>}`` puts one
pool's keys in one Redis Cluster slot, so the lookup script may touch them all; ``v1`` is the key schema
version (bumped on an incompatible change, so old and new nodes never misread each other's keys).

=======================================  ======  ================================================  =====================
key (after the prefix)                   type    value                                             TTL
=======================================  ======  ================================================  =====================
``nodes``                                SET     node ids that ever registered (pruned lazily by   none
                                                 the Lua lookup and the routers' mirrors once a
                                                 node's hb and blocks are gone)
``hb:<node_id>``                         STRING  JSON heartbeat: role, url, incarnation, protocol,  ``heartbeat_ttl``
                                                 draining, load, agent name                        (3 x period), reset
                                                                                                   by every heartbeat
``blocks:<node_id>``                     SET     16-byte block hashes the node holds (raw bytes)    ``state_ttl``, reset
                                                                                                   by every heartbeat
``nixl:<node_id>:<incarnation>``         STRING  the node's KV agent metadata (bytes)               ``state_ttl``, reset
                                                                                                   by every heartbeat
``events``                               STREAM  every change of a ``blocks:`` set, appended in     none; ``MAXLEN ~``
                                                 the MULTI that makes it: node, incarnation,       (10,000 entries by
                                                 sequence, kind (delta or reset), stored and       default), trimmed
                                                 removed hashes (``redis_index``'s docstring); the  by every append
                                                 routers' index mirrors tail it
=======================================  ======  ================================================  =====================

A node is *live* while its ``hb:`` key exists. A dead node's ``blocks:`` and ``nixl:`` keys outlive its
heartbeat by at most ``state_ttl``; the lookup ignores them from the moment the heartbeat expires.
"""

from __future__ import annotations

from dataclasses import dataclass

KEY_SCHEMA = "v1"
PROTOCOL_VERSION = 1  # of the heartbeat payload and the KV handle exchange


def key_prefix(namespace: str, pool: str) -> str:
    for name, value in (("namespace", namespace), ("pool", pool)):
        if not value or any(c in value for c in "{}:"):
            raise ValueError(f"{name} {value!r} must be non-empty and free of '{{', '}}' and ':'")
    return f"pdpool:{KEY_SCHEMA}:{{{namespace}/{pool}}}:"


def glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


@dataclass(frozen=True)
class PoolKeys:
    namespace: str
    pool: str

    @property
    def prefix(self) -> str:
        return key_prefix(self.namespace, self.pool)

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes"

    def heartbeat(self, node_id: str) -> str:
        return f"{self.prefix}hb:{node_id}"

    def blocks(self, node_id: str) -> str:
        return f"{self.prefix}blocks:{node_id}"

    def nixl(self, node_id: str, incarnation: str) -> str:
        return f"{self.prefix}nixl:{node_id}:{incarnation}"

    @property
    def events(self) -> str:
        return self.prefix + "events"

    @property
    def scan_pattern(self) -> str:
        """MATCH pattern for SCAN: this pool's keys only (the glob characters of the names escaped)."""
        return glob_escape(self.prefix) + "*"
