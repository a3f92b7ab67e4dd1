"""Drop every Redis key of a pool (the operator's finalizer): SCAN by the pool's prefix, UNLINK in batches.

Never KEYS, which blocks Redis, so it is safe on a shared external Redis. The prefix ends with the pool's hash tag
and a colon (``pdpool.kv_index.keys``), so pool ``a`` never matches pool ``ab``. Imports only ``redis.asyncio``, when
called: the operator loads this without pdpool's index client or torch.
"""

from __future__ import annotations

from pdpool.kv_index.keys import PoolKeys


async def delete_pool_keys(url: str, password: str | None, namespace: str, pool: str,
                           batch: int = 500, timeout: float = 5.0) -> int:
    """Delete the pool's keys; returns how many were deleted."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, password=password, socket_timeout=timeout, socket_connect_timeout=timeout)
    deleted = 0
    try:
        pending: list = []
        async for key in client.scan_iter(match=PoolKeys(namespace, pool).scan_pattern, count=batch):
            pending.append(key)
            if len(pending) >= batch:
                deleted += await client.unlink(*pending)
                pending = []
        if pending:
            deleted += await client.unlink(*pending)
    finally:
        await client.aclose()
    return deleted
