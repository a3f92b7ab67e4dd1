"""One generation request as the scheduler and the KV-cache manager see it (pure Python)."""

from __future__ import annotations

import enum
import time
from typing import Any, Sequence

from pdpool.block_hash import BlockHash


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # blocks allocated, KV being pulled from a peer; no compute scheduled
    RUNNING = 2
    PREEMPTED = 3  # back in the waiting queue, blocks freed, to be recomputed
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}


class Request:
    """Token ids and progress of one sequence.

    ``all_token_ids`` is prompt + output, kept as one list. ``num_computed_tokens`` counts the tokens
    whose KV is in the cache; ``block_hashes`` (filled by the KV-cache manager) has one hash per full
    block of ``all_token_ids``. ``sampling_params`` is duck-typed: ``max_tokens``, ``ignore_eos``,
    ``stop_token_ids`` and, if present, ``min_tokens``.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any, *,
                 eos_token_ids: Sequence[int] = (), eos_token_id: int | None = None, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, output_token_ids: Sequence[int] = (), kv_load: Any = None,
                 hold_blocks_on_finish: bool = False) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Every id that ends generation (Llama-3-Instruct has three); ``eos_token_id`` adds one more.
        self.eos_token_ids = frozenset(eos_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.output_token_ids = list(output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first schedule
        self.block_hashes: list[BlockHash] = []
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.kv_load = kv_load  # opaque handle of KV to pull from a peer, or None
        self.kv_load_finished = False  # the remote load ran (either way); never started twice
        self.hold_blocks_on_finish = hold_blocks_on_finish
        # The prompt's own logprobs (``prompt_logprobs`` of the params: completions' echo with logprobs): slot i
        # holds token i's (id, logprob, top, rank) as the model predicted it from tokens 0..i-1; slot 0 stays None.
        # Such a request reads nothing from the prefix cache: every prompt position's logits are computed.
        self.prompt_logprobs: list | None = (
            [None] * len(self.prompt_token_ids)
            if getattr(sampling_params, "prompt_logprobs", None) is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def needs_remote_load(self) -> bool:
        return self.kv_load is not None and not self.kv_load_finished

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def min_tokens(self) -> int:
        return getattr(self.sampling_params, "min_tokens", 0) or 0

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
