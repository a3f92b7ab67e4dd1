"""The engine's KV-connector seam: a scheduler side that decides what to load, a worker side that moves bytes.

As in vLLM's ``KVConnectorBase_V1``, deciding is kept apart from moving::

    scheduler side (pure, engine thread)           worker side (NIXL, event loop)
    ------------------------------------           ------------------------------
    plan_load(handle, num_hit_tokens, block_ids)   KVWorker.pull(peer, remote_ids, local_ids)
      -> LoadPlan(local_ids, remote_ids)           KVWorker.push(peer, remote_ids, local_ids)

Role protocols (leases and handles of a prefill node, pull/push orchestration of a decode node) live in
``pdpool.prefill_node`` and ``pdpool.decode_node``; ``KVConnector`` composes them for the engine, which
calls it at five points (``on_add``, ``on_schedule``, ``before_step``, ``after_step``, ``on_abort``).
``KVConnectorEngine`` is ``LLMEngine`` with those calls.

A decode request's blocks::

    | <- local prefix-cache hit -> | <------- pulled from the prefill node -------> |
      block_ids[:h]                  block_ids[h:]  <-  handle.remote_block_ids[h:]
      h = num_hit_tokens // block_size (never pulled)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from pdpool.engine.llm_engine import InvalidRequestError, LLMEngine, RequestOutput
from pdpool.engine.request import Request
from pdpool.engine.scheduler import SchedulerOutput
from pdpool.kv_transfer.handle import KVFingerprint, KVHandle

logger = logging.getLogger(__name__)

TEST_HOOKS_ENV = "PDPOOL_TEST_HOOKS"  # "1": garbage-fill destination blocks, honour pdpool_test_hold


def test_hooks_enabled() -> bool:
    return os.environ.get(TEST_HOOKS_ENV) == "1"


# ---- scheduler side ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadPlan:
    """Pairs of (local, remote) block ids to move; the local prefix-cache hit is left out."""
    local_ids: list[int]
    remote_ids: list[int]


def plan_load(handle: KVHandle, num_hit_tokens: int, block_ids: Sequence[int], block_size: int) -> LoadPlan:
    """The blocks of a decode request that the peer must fill: all but its leading local hit."""
    first = num_hit_tokens // block_size
    num_blocks = len(handle.remote_block_ids)
    if len(block_ids) < num_blocks:
        raise ValueError(f"{len(block_ids)} local blocks for {num_blocks} remote blocks")
    return LoadPlan(list(block_ids[first:num_blocks]), list(handle.remote_block_ids[first:]))


def kv_fingerprint(engine: LLMEngine) -> KVFingerprint:
    info = engine.runner.model_config
    return KVFingerprint(model=engine.config.served_model_name, dtype=str(engine.runner.dtype).removeprefix("torch."),
                         block_size=engine.kv_cache_manager.block_size, num_layers=info.num_layers,
                         num_kv_heads=info.num_kv_heads, head_dim=info.head_dim)


# ---- worker side ---------------------------------------------------------------------------------

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

    def remove_peer(self, name: str) -> None:
        self.agent.remove_peer(name)

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


# ---- the seam the engine calls -------------------------------------------------------------------

class RoleSide(Protocol):
    """What a role protocol (prefill_node, decode_node) plugs into the connector; all on the engine thread."""

    def wants(self, kv_transfer_params: dict) -> bool: ...
    def on_add(self, request: Request, kv_transfer_params: dict) -> dict | None: ...
    def on_schedule(self, scheduler_output: SchedulerOutput) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self, outputs: list[RequestOutput]) -> None: ...
    def on_abort(self, request_ids: list[str]) -> set[str]: ...


class KVConnector:
    """Routes the engine's calls to the role sides this node runs, and publishes block events to the index."""

    def __init__(self, sides: Sequence[RoleSide] = (), index: Any = None) -> None:
        self.sides = list(sides)
        self.index = index  # pdpool.kv_index NodeIndex or None

    def on_add(self, request: Request, kv_transfer_params: dict | None) -> dict | None:
        """May set the request's ``kv_load``/``hold_blocks_on_finish``; returns the params to keep on it."""
        if not kv_transfer_params:
            return kv_transfer_params
        for side in self.sides:
            if side.wants(kv_transfer_params):
                return side.on_add(request, kv_transfer_params)
        if kv_transfer_params.get("do_remote_decode") or kv_transfer_params.get("do_remote_prefill"):
            raise InvalidRequestError("this node's role does not take these kv_transfer_params "
                                      "(do_remote_decode goes to a prefill node, do_remote_prefill to a decode node)",
                                      param="kv_transfer_params")
        return kv_transfer_params

    def on_schedule(self, scheduler_output: SchedulerOutput) -> None:
        for side in self.sides:
            side.on_schedule(scheduler_output)

    def before_step(self) -> None:
        for side in self.sides:
            side.before_step()

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        for side in self.sides:
            side.after_step(outputs)
        stored, removed = engine.kv_cache_manager.take_events()
        if self.index is not None and (stored or removed or self.index.dirty):
            self.index.publish(stored, removed)

    def on_abort(self, request_ids: list[str]) -> set[str]:
        """Ids whose abort must wait: a transfer still writes into their blocks."""
        deferred: set[str] = set()
        for side in self.sides:
            deferred |= side.on_abort(request_ids)
        return deferred


class KVConnectorEngine(LLMEngine):
    """``LLMEngine`` calling a ``KVConnector`` (built by ``make_connector(engine)``) at its five points."""

    def __init__(self, node_config, make_connector) -> None:
        super().__init__(node_config)
        self.kv_connector: KVConnector = make_connector(self)
        schedule = self.scheduler.schedule

        def schedule_and_start_loads() -> SchedulerOutput:
            out = schedule()
            self.kv_connector.on_schedule(out)
            return out

        self.scheduler.schedule = schedule_and_start_loads

    def add_request(self, request_id: str, prompt, params, **kwargs) -> None:
        super().add_request(request_id, prompt, params, **kwargs)
        state = self._states[request_id]
        try:
            state.kv_transfer_params = self.kv_connector.on_add(state.request, state.kv_transfer_params)
        except BaseException:
            self.abort_request(request_id)
            raise

    def step(self) -> list[RequestOutput]:
        self.kv_connector.before_step()
        outputs = super().step()
        self.kv_connector.after_step(self, outputs)
        return outputs

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        deferred = self.kv_connector.on_abort(ids)
        for rid in deferred:
            if self._states.pop(rid, None) is not None:
                self.num_finished += 1
        super().abort_request([rid for rid in ids if rid not in deferred])
