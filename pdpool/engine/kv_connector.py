"""The engine's KV-connector seam: a scheduler side that decides what to load, a worker side that moves bytes.

As in vLLM's ``KVConnectorBase_V1``, deciding is kept apart from moving::

    scheduler side (pure, engine thread)           worker side (NIXL, event loop; pdpool.kv_transfer.worker)
    ------------------------------------           ---------------------------------------------------------
    plan_load(handle, num_hit_tokens, block_ids)   KVWorker.pull(peer, remote_ids, local_ids)
      -> LoadPlan(local_ids, remote_ids)           KVWorker.push(peer, remote_ids, local_ids)

Role protocols (leases and handles of a prefill node, pull/push orchestration of a decode node) live in
``pdpool.prefill_node`` and ``pdpool.decode_node``; ``KVConnector`` composes them for the engine, which
calls it at five points (``on_add``, ``on_schedule``, ``before_step``, ``after_step``, ``on_abort``): the
engine is built with it (``LLMEngine(config, connector_factory=...)``), nothing is patched. The worker side,
``pdpool.kv_transfer.worker.KVWorker``, moves the bytes.

A decode request's blocks::

    | <- local prefix-cache hit -> | <------- pulled from the prefill node -------> |
      block_ids[:h]                  block_ids[h:]  <-  handle.remote_block_ids[h:]
      h = num_hit_tokens // block_size (never pulled)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from pdpool.engine.llm_engine import EngineOutput, InvalidRequestError, LLMEngine
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
    """The engine's block-hash fingerprint (``engine.fingerprint``) extended by its KV cache's shape."""
    info = engine.runner.model_config
    return KVFingerprint.of(engine.fingerprint, info.num_layers, info.num_kv_heads, info.head_dim)


# ---- the seam the engine calls -------------------------------------------------------------------

class RoleSide(Protocol):
    """What a role protocol (prefill_node, decode_node) plugs into the connector; all on the engine thread."""

    def wants(self, kv_transfer_params: dict) -> bool: ...
    def on_add(self, request: Request, kv_transfer_params: dict) -> dict | None: ...
    def on_schedule(self, scheduler_output: SchedulerOutput) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self, outputs: list[EngineOutput]) -> None: ...
    def on_abort(self, request_ids: list[str]) -> set[str]: ...
    def on_refused(self, kv_transfer_params: dict) -> None: ...  # any thread: the engine refused the request


class KVConnector:
    """The engine's KV connector (``LLMEngine(connector_factory=...)``): routes the engine's calls to the role
    sides this node runs, and hands the step's block events to the index publisher (a queue, never Redis itself).

    ``supports_overlap``: the sides start transfers from ``on_schedule`` for blocks the step in flight does not
    touch, and read tokens only from finished outputs, so the overlapped CUDA step loop may run.
    """
    supports_overlap = True

    def __init__(self, kv_cache_manager, sides: Sequence[RoleSide] = (), index: Any = None,
                 release: Callable[[dict], None] | None = None) -> None:
        """``release(kv_transfer_params)``: ends the lease of refused params that no side takes (a prefill node's KV
        handle sent to a node with no decode side); from any thread."""
        self.kv_cache_manager = kv_cache_manager
        self.sides = list(sides)
        self.index = index  # pdpool.kv_index NodeIndex or None
        self.release = release

    def on_add(self, request: Request, kv_transfer_params: dict | None) -> dict | None:
        """May set the request's ``kv_load``/``hold_blocks_on_finish``; returns the params to keep on it."""
        if not kv_transfer_params:
            return None
        for side in self.sides:
            if side.wants(kv_transfer_params):
                return side.on_add(request, kv_transfer_params)
        if kv_transfer_params.get("do_remote_decode") or kv_transfer_params.get("do_remote_prefill"):
            self.on_refused(kv_transfer_params)
            raise InvalidRequestError("this node's role does not take these kv_transfer_params "
                                      "(do_remote_decode goes to a prefill node, do_remote_prefill to a decode node)",
                                      param="kv_transfer_params")
        return None   # fields no side takes are ignored, not echoed back (as vLLM's connectors do)

    def on_schedule(self, scheduler_output: SchedulerOutput) -> None:
        for side in self.sides:
            side.on_schedule(scheduler_output)

    def before_step(self) -> None:
        for side in self.sides:
            side.before_step()

    def after_step(self, outputs: list[EngineOutput]) -> None:
        for side in self.sides:
            side.after_step(outputs)
        stored, removed = self.kv_cache_manager.take_events()
        if self.index is not None and (stored or removed):
            self.index.publish(stored, removed)

    def on_refused(self, kv_transfer_params: dict) -> None:
        for side in self.sides:
            if side.wants(kv_transfer_params):
                side.on_refused(kv_transfer_params)
                return
        if self.release is not None:
            self.release(kv_transfer_params)

    def on_abort(self, request_ids: list[str]) -> set[str]:
        """Ids whose abort must wait: a transfer still writes into their blocks."""
        deferred: set[str] = set()
        for side in self.sides:
            deferred |= side.on_abort(request_ids)
        return deferred
