"""The worker side of the KV connector: the node's NIXL agent over its KV cache, moving blocks.

The scheduler side (``pdpool.engine.kv_connector.plan_load``) decides which blocks move; this moves them. Every
call comes from the server's event loop (one thread); blocking agent calls (``add_peer``) are the caller's to
put on an executor.
"""

from __future__ import annotations

from typing import Sequence


class KVWorker:
    """The node's NIXL agent over its KV cache; every call from the server's event loop (one thread)."""

    def __init__(self, runner, agent_name: str, *, ucx_tls: str | None, ucx_net_devices: str | None,
                 timeout: float) -> None:
        from pdpool.kv_transfer.agent import KVAgent

        self.runner = runner
        self.timeout = timeout
        self.agent = KVAgent(agent_name, ucx_tls=ucx_tls, ucx_net_devices=ucx_net_devices)
        self.region = self.agent.register_kv_cache(runner.kv_cache)
        self.block_bytes = self.region.block_bytes
        self.bytes_pulled = 0
        self.bytes_pushed = 0

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    async def pull(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int]) -> float:
        """READ the peer's blocks into ours; seconds it took. Raises ``KVTransferError``."""
        t = self.agent.start_read(peer, remote_ids, local_ids, timeout=self.timeout)
        seconds = await t.wait_async(self.timeout)
        self.bytes_pulled += t.nbytes
        return seconds

    async def push(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int]) -> float:
        """WRITE our blocks into the peer's; seconds it took. Raises ``KVTransferError``."""
        t = self.agent.start_write(peer, remote_ids, local_ids, timeout=self.timeout)
        seconds = await t.wait_async(self.timeout)
        self.bytes_pushed += t.nbytes
        return seconds

    def fill_garbage(self, block_ids: Sequence[int]) -> None:
        """Test hook: fill destination blocks with large random values, so a block not transferred shows.

        Finite on purpose: a recompute rewrites only the slots up to the sequence's end, and attention multiplies
        the masked slots past it by a zero weight, which a NaN would survive."""
        import torch

        if block_ids:
            ids = list(block_ids)
            self.runner.kv_cache[ids] = torch.randn_like(self.runner.kv_cache[ids]) * 100.0

    def close(self) -> None:
        self.agent.close()
