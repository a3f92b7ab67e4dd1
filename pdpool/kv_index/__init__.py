"""The pool's Redis index: which node holds which KV blocks, who is alive, how to reach its KV agent.

Names load lazily, so ``pdpool.kv_index.keys`` and ``pdpool.kv_index.cleanup`` (the operator's) import without the
index client.
"""

import importlib

_LAZY = {
    "HeartbeatThread": "heartbeat", "NodeInfo": "heartbeat", "NodeLoad": "heartbeat",
    "KEY_SCHEMA": "keys", "PROTOCOL_VERSION": "keys", "PoolKeys": "keys", "key_prefix": "keys",
    "IndexReader": "redis_index", "IndexUnavailableError": "redis_index", "NodeIndex": "redis_index",
    "connect": "redis_index", "new_incarnation": "redis_index", "delete_pool_keys": "cleanup",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
