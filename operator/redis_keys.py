"""Finalizer side: drop every Redis key of a pool (``pdpool:v1:{<namespace>/<pool>}:…``).

The hash tag ``{<namespace>/<pool>}`` keeps one pool's keys in one Redis Cluster slot. Deletion is SCAN by prefix
in batches (never KEYS, which blocks Redis), so it is safe on a shared external Redis.
"""

from __future__ import annotations

import redis.asyncio as aioredis


def key_prefix(namespace: str, pool: str) -> str:
    return f"pdpool:v1:{{{namespace}/{pool}}}:"


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


async def delete_pool_keys(url: str, password: str | None, namespace: str, pool: str,
                           batch: int = 500, timeout: float = 5.0) -> int:
    """Delete the pool's keys; returns how many were deleted."""
    client = aioredis.from_url(url, password=password, socket_timeout=timeout, socket_connect_timeout=timeout)
    deleted = 0
    try:
        pending: list = []
        async for k in client.scan_iter(match=_glob_escape(key_prefix(namespace, pool)) + "*", count=batch):
            pending.append(k)
            if len(pending) >= batch:
                deleted += await client.unlink(*pending)
                pending = []
        if pending:
            deleted += await client.unlink(*pending)
    finally:
        await client.aclose()
    return deleted
