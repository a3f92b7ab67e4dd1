"""Continuous batching: which requests compute which tokens in the next step.

Each ``schedule()`` spends a token budget (``max_num_batched_tokens``) over at most ``max_num_seqs``
requests: running requests first (a decode takes 1 token, an unfinished prefill its next chunk), then
waiting ones in policy order (FCFS, or priority: lower value first, then arrival). A prompt longer than
the remaining budget gets a chunk. While any running request decodes, the step's prompt tokens are also capped
(``max_prefill_tokens_with_decodes``; off by default), since every decode's next token waits for the step.
When a running request's slots do not fit, the latest (FCFS) or lowest-priority running request is
preempted by recompute: its blocks are freed and it goes back to the front of the waiting queue. Steps
with a preemption admit no waiting request.

Remote KV hooks (disaggregation): a request with ``kv_load`` gets blocks for its whole prompt, waits in
``WAITING_FOR_REMOTE_KVS`` (counted against ``max_num_seqs``) until ``finish_remote_load``; a request with
``hold_blocks_on_finish`` keeps its blocks after finishing (not after an abort) until ``release_held_blocks``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from pdpool.engine.kv_cache_manager import KVCacheManager
from pdpool.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """The step computes ``request.all_token_ids[start:start + num_new_tokens]`` into ``block_ids``."""
    request: Request
    num_new_tokens: int
    block_ids: list[int]
    start: int = field(init=False)  # request.num_computed_tokens when scheduled
    num_tokens: int = field(init=False)  # request.num_tokens when scheduled

    def __post_init__(self) -> None:
        self.start = self.request.num_computed_tokens
        self.num_tokens = self.request.num_tokens

    @property
    def samples(self) -> bool:
        """The step samples a token for it: its tokens up to the last one are computed by this step."""
        return self.start + self.num_new_tokens == self.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_loads_to_start: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    finished_held: list[Request] = field(default_factory=list)  # finished since the last step, blocks held
    finished_ids: list[str] = field(default_factory=list)  # finished since the last step (runner state to drop)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival_time, insertion order)."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.by_priority = policy == "priority"
        self.fcfs: deque[Request] = deque()
        self.heap: list[tuple[int, float, int, Request]] = []
        self.order: dict[str, int] = {}
        self.counter = itertools.count()

    def key(self, request: Request) -> tuple[int, float, int]:
        return request.priority, request.arrival_time, self.order[request.request_id]

    def add(self, request: Request, front: bool = False) -> None:
        self.order.setdefault(request.request_id, next(self.counter))
        if self.by_priority:
            heapq.heappush(self.heap, (*self.key(request), request))
        elif front:
            self.fcfs.appendleft(request)
        else:
            self.fcfs.append(request)

    def peek(self) -> Request:
        return self.heap[0][-1] if self.by_priority else self.fcfs[0]

    def pop(self) -> Request:
        return heapq.heappop(self.heap)[-1] if self.by_priority else self.fcfs.popleft()

    def remove(self, request: Request) -> None:
        if self.by_priority:
            self.heap = [e for e in self.heap if e[-1] is not request]
            heapq.heapify(self.heap)
        else:
            self.fcfs.remove(request)

    def forget(self, request_id: str) -> None:
        self.order.pop(request_id, None)

    def __len__(self) -> int:
        return len(self.heap) if self.by_priority else len(self.fcfs)


class Scheduler:
    """``scheduler_config`` needs ``max_num_seqs``, ``max_num_batched_tokens``, ``scheduling_policy`` and
    ``max_model_len``; ``max_model_len`` here overrides it (the engine passes the model's when it is None).
    The effective cap is also at most what the whole KV cache holds."""

    def __init__(self, scheduler_config: Any, kv_cache_manager: KVCacheManager,
                 max_model_len: int | None = None) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        # prompt tokens per step while requests decode (None or 0: the budget alone)
        self.max_prefill_tokens_with_decodes = getattr(scheduler_config, "max_prefill_tokens_with_decodes", None)
        self.kv = kv_cache_manager
        capacity = self.kv.num_total_blocks * self.kv.block_size
        self.max_model_len = min(max_model_len or scheduler_config.max_model_len or capacity, capacity)
        self.waiting = WaitingQueue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.held_blocks: dict[str, list[int]] = {}
        self._held_requests: dict[str, Request] = {}
        self._finished_held: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_prefill_chunks = 0
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.num_preemptions = 0
        # EOS ids whose stop gives stop_reason = the id (``LLMEngine.set_tokenizer_eos``); the others give None
        self.eos_stop_reasons: frozenset[int] = frozenset()

    # ---- stats
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting to be scheduled, including requests waiting for remote KV."""
        return len(self.waiting) + len(self.loading)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv.num_total_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- requests in
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.held_blocks:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens exceeds max_model_len "
                             f"{self.max_model_len}")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    # ---- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_held=self._finished_held, finished_ids=self._finished_ids)
        self._finished_held, self._finished_ids = [], []
        budget = self.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 1:  # an unfinished prompt's next chunk
                num_new = max(1, min(num_new, prefill_budget))
            while (block_ids := self.kv.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                self._preempt(victim)
                out.preempted.append(victim)
                for j, s in enumerate(out.scheduled):
                    if s.request is victim:  # priority policy may pick one scheduled earlier this step
                        del out.scheduled[j]
                        budget += s.num_new_tokens
                        i -= 1
                        break
                if victim is request:
                    break
            if block_ids is None:
                break
            out.scheduled.append(ScheduledRequest(request, num_new, block_ids))
            budget -= num_new
            if num_new > 1:
                prefill_budget -= num_new
            i += 1

        while (len(self.waiting) and budget > 0 and prefill_budget > 0 and not out.preempted
               and len(self.running) + len(self.loading) < self.max_num_seqs):
            request = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            if request.needs_remote_load:
                num_new = max(request.num_prompt_tokens - num_hit, 0)
            else:
                num_new = min(request.num_tokens - num_hit, budget, prefill_budget)
            block_ids = self.kv.allocate_slots(request, num_new, hit_blocks)
            if block_ids is None:
                break
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:  # first schedule, not a resume after preemption
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            self.prefix_cache_queried_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += num_hit
            if request.needs_remote_load:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading[request.request_id] = request
                out.kv_loads_to_start.append((request, num_hit, block_ids))
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, block_ids))
            budget -= num_new
            prefill_budget -= num_new
        self.num_prefill_chunks += sum(not s.samples for s in out.scheduled)
        return out

    def _prefill_budget(self) -> int | float:
        """Prompt tokens this step may compute: the cap while any running request decodes (its next token waits
        for the whole step, so a long prompt is chunked across steps beside it), else no limit beyond the budget."""
        cap = self.max_prefill_tokens_with_decodes
        if cap and any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
            return cap
        return float("inf")

    def _pick_victim(self) -> Request:
        if self.waiting.by_priority:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, self.waiting.order[r.request_id]))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    # ---- results in
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, Any]) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens (ints, or objects with ``token_id``).

        Returns the requests that got a token or finished. Requests finished or preempted since the
        schedule (an abort in between) are skipped.
        """
        touched: list[Request] = []
        finished: set[str] = set()
        for s in scheduler_output.scheduled:
            request = s.request
            if request.status != RequestStatus.RUNNING or request.num_computed_tokens != s.start:
                continue
            request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed_blocks(request)
            if not s.samples:
                continue
            token = sampled[request.request_id]
            request.append_output_token(getattr(token, "token_id", token))
            status = self.check_stop(request)
            if status is not None:
                finished.add(request.request_id)
                self._finish(request, status)
            touched.append(request)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return touched

    def check_stop(self, request: Request) -> RequestStatus | None:
        """Stop tokens win over the length cap when both hold (the answer ended on its own)."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= request.min_tokens:
            if last in request.eos_token_ids and not getattr(params, "ignore_eos", False):
                if last in self.eos_stop_reasons:
                    request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if last in (getattr(params, "stop_token_ids", None) or ()):
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        max_tokens = request.max_tokens
        if request.num_tokens >= self.max_model_len or (max_tokens is not None
                                                        and request.num_output_tokens >= max_tokens):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish unfinished requests in any state (abort, or a stop string); unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.loading[request_id]
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        del self.requests[request.request_id]
        self.waiting.forget(request.request_id)
        self._finished_ids.append(request.request_id)
        if (request.hold_blocks_on_finish and status != RequestStatus.FINISHED_ABORTED
                and request.request_id in self.kv.req_blocks):
            self.held_blocks[request.request_id] = self.kv.get_block_ids(request.request_id)
            self._held_requests[request.request_id] = request
            self._finished_held.append(request)
        else:
            self.kv.free(request)

    # ---- remote KV hooks
    def finish_remote_load(self, request_id: str, success: bool) -> bool:
        """The KV pull of a WAITING_FOR_REMOTE_KVS request ended; it becomes runnable. False if not loading.

        On success its prompt counts as computed (all but the last prompt token when no output token is
        known yet, so the next step still samples) and its full blocks are cached. On failure it keeps
        its blocks and resumes from its local prefix-cache hit (its ``num_computed_tokens`` since it was
        scheduled), recomputing the rest.
        """
        request = self.loading.pop(request_id, None)
        if request is None:
            return False
        request.kv_load_finished = True
        if success:
            request.num_computed_tokens = min(request.num_prompt_tokens, request.num_tokens - 1)
            self.kv.cache_computed_blocks(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def release_held_blocks(self, request_id: str) -> bool:
        """Free the blocks a finished ``hold_blocks_on_finish`` request kept; False if none are held."""
        request = self._held_requests.pop(request_id, None)
        if request is None:
            return False
        del self.held_blocks[request_id]
        self.kv.free(request)
        return True
