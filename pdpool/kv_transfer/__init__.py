"""KV transfer between nodes: the NIXL agent, the KV handle schema and the block layout math."""

from pdpool.kv_transfer.agent import KVAgent, KVTransferError, PendingTransfer
from pdpool.kv_transfer.handle import (HANDLE_VERSION, IncompatibleKVError, KVFingerprint, KVHandle,
                                       KVHandleError)
from pdpool.kv_transfer.layout import KV_LAYOUT, KVRegion, block_runs, descriptors, region_of

__all__ = [
    "KVAgent", "KVTransferError", "PendingTransfer",
    "HANDLE_VERSION", "IncompatibleKVError", "KVFingerprint", "KVHandle", "KVHandleError",
    "KV_LAYOUT", "KVRegion", "block_runs", "descriptors", "region_of",
]
