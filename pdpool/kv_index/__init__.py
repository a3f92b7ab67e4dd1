"""The pool's Redis index: which node holds which KV blocks, who is alive, how to reach its KV agent."""

from pdpool.kv_index.heartbeat import HeartbeatThread, NodeInfo, NodeLoad
from pdpool.kv_index.keys import KEY_SCHEMA, PROTOCOL_VERSION, PoolKeys, key_prefix
from pdpool.kv_index.redis_index import (IndexReader, IndexUnavailableError, NodeIndex, connect,
                                         delete_pool_keys, new_incarnation)

__all__ = [
    "HeartbeatThread", "NodeInfo", "NodeLoad", "KEY_SCHEMA", "PROTOCOL_VERSION", "PoolKeys", "key_prefix",
    "IndexReader", "IndexUnavailableError", "NodeIndex", "connect", "delete_pool_keys", "new_incarnation",
]
