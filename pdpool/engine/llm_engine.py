"""``LLMEngine``: the glue of one node's engine. Token ids in, token ids out: no text on its thread.

It owns the scheduler (with its KV-cache manager), the model runner and an optional KV connector. The request
front end (``pdpool.frontend``) tokenizes before ``add_request``; the output processor
(``pdpool.engine.output_processor``) detokenizes and applies stop strings after ``step``, off this thread, as
vLLM v1 splits its ``EngineCore`` from its front end. One ``step()``::

    connector.before_step -> scheduler.schedule() -> connector.on_schedule -> runner.execute()
        -> scheduler.update_from_output() -> EngineOutputs (new token ids, logprobs, finish) -> connector.after_step

On CUDA the steps overlap (``overlap_steps``, vLLM v1's async scheduling): while the GPU runs step N, the host
books N's samples as placeholders, schedules and packs N+1 and queues it (its input ids gathered on the device from
N's samples), and only then waits for N's sampled ids, fills them in and builds N's outputs::

    host: | update N (placeholders) | schedule N+1 | pack + launch N+1 | collect N (waits) | fill | outputs N |
    GPU:  | ......... forward N + sampler N ......... | forward N+1 + sampler N+1 ...........................

The placeholders (``PLACEHOLDER``) are only counts to the scheduler (lengths, blocks); they are replaced by the
sampled ids before anything on the host reads them as tokens (block hashes, outputs). A stop token sampled at N is
seen after N+1 was queued: N+1's work for that request is dropped. A step whose sampling reads earlier outputs
(penalties, min_tokens masking) samples before booking, as the plain loop does, and such a step is queued only
after the tokens it reads are real. A connector whose ``supports_overlap`` is false keeps the plain loop.

A request whose own sampling fails (the sampler reports it) finishes alone with ``finish_reason`` "error"; its
batch-mates go on.

The engine is not thread-safe: ``AsyncLLM`` calls it from a single worker thread. ``stats()`` only reads
counters and lengths, so it may be called from elsewhere while a step runs.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from pdpool.block_hash import ModelFingerprint
from pdpool.engine.kv_cache_manager import KVCacheManager
from pdpool.engine.model_runner import LaunchedStep, ModelRunner
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampler import RequestFault
from pdpool.engine.sampling_params import SamplingParams, SamplingParamsError
from pdpool.engine.scheduler import Scheduler, SchedulerOutput
from pdpool.frontend import InvalidRequestError, check_token_ids, resolve_max_tokens

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # a token sampled by the step in flight, not read back yet (no real id is negative)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``--max-waiting-requests`` requests already (the API answers 429)."""


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # (token id, logprob), best first; None when not asked
    rank: int | None = None              # the token's place in the vocabulary (1: the model's first choice)


@dataclass
class EngineOutput:
    """What one step did for one request: the new tokens only (a delta), and how it finished."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # one per new token, when the request asked for logprobs
    finished: bool
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None      # the stop token id that ended it
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None    # set by a connector on the final output (a prefill node's handle)
    error: str | None = None                  # finish_reason "error": why
    # With the params' ``prompt_logprobs``: on the first output with a token, one entry per prompt token (the
    # first None: nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class KVConnectorHooks(Protocol):
    """What the engine calls on a KV connector (``pdpool.engine.kv_connector.KVConnector``), on its thread."""
    supports_overlap: bool

    def on_add(self, request: Request, kv_transfer_params: dict | None) -> dict | None: ...
    def on_schedule(self, scheduler_output: SchedulerOutput) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self, outputs: list[EngineOutput]) -> None: ...  # may append outputs it finished
    def on_abort(self, request_ids: list[str]) -> set[str]: ...
    def on_refused(self, kv_transfer_params: dict) -> None: ...  # from any thread (see ``refuse_kv_transfer``)


@dataclass
class _State:
    request: Request
    kv_transfer_params: dict | None
    num_emitted_tokens: int = 0
    final_only: bool = False  # one output, when it finishes (see ``add_request``)
    prompt_logprobs_sent: bool = False


@dataclass
class _InFlight:
    scheduled: SchedulerOutput
    launched: LaunchedStep


class LLMEngine:
    def __init__(self, node_config, *, connector_factory=None) -> None:
        """``connector_factory(engine) -> KVConnectorHooks`` composes a KV connector (a disaggregated node's)."""
        self.config = node_config
        self.runner = ModelRunner(node_config)
        info = self.runner.model_config
        self.model_path = info.path
        self.vocab_size = info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        cache = node_config.cache
        self.fingerprint = ModelFingerprint(node_config.served_model_name, self.runner.dtype_name, cache.block_size)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                               self.fingerprint)
        wanted = node_config.scheduler.max_model_len or info.max_position_embeddings
        if wanted > info.max_position_embeddings:
            logger.warning("--max-model-len %d exceeds the model's %d positions; using %d", wanted,
                           info.max_position_embeddings, info.max_position_embeddings)
            wanted = info.max_position_embeddings
        self.scheduler = Scheduler(node_config.scheduler, self.kv_cache_manager, max_model_len=wanted)
        # The scheduler also caps it at what the whole KV cache holds (vLLM refuses to start there instead).
        self.max_model_len = self.scheduler.max_model_len
        if self.max_model_len < wanted:
            logger.warning("max_model_len %d is more than the KV cache holds (%d blocks of %d tokens); using %d: "
                           "a longer request is refused. More KV blocks (--num-kv-blocks, --kv-cache-memory-gb, "
                           "--gpu-memory-utilization) or a lower --max-model-len", wanted,
                           self.kv_cache_manager.num_total_blocks, cache.block_size, self.max_model_len)
        self.max_waiting_requests = node_config.scheduler.max_waiting_requests
        self._states: dict[str, _State] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = 0
        self.num_request_errors = 0
        self.last_step_num_scheduled = 0  # requests the last step computed (0: idle or all waiting on remote KV)
        self._in_flight: _InFlight | None = None
        self.connector: KVConnectorHooks | None = connector_factory(self) if connector_factory else None
        self.overlap_steps = self.runner.device.type == "cuda" and (
            self.connector is None or self.connector.supports_overlap)
        if self.runner.device.type == "cuda" and os.environ.get("PDPOOL_GC_FREEZE", "1") != "0":
            freeze_startup_heap()

    # ---- requests in -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    kv_transfer_params: dict | None = None, final_only: bool = False) -> Request:
        """Validate and queue one request of token ids (``pdpool.frontend`` made them); raises
        ``InvalidRequestError``, ``SamplingParamsError`` or ``QueueFullError``.

        ``final_only``: the caller reads only the finished output (the offline ``LLM``). Where nothing else needs
        its steps (no stop strings, which the output processor finds in the growing text; no logprobs; no KV
        connector), the request then gets one ``EngineOutput``, when it finishes, holding all its ids, instead of
        one per step; ``generation_tokens`` in ``stats()`` counts its ids then."""
        try:
            prompt_ids, max_tokens = self._admit(request_id, prompt_token_ids, params)
        except Exception:
            self.refuse_kv_transfer(kv_transfer_params)
            raise
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        request = Request(request_id, prompt_ids, params, eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                          priority=priority, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        final_only = final_only and not params.stop and params.logprobs is None and self.connector is None
        state = _State(request, None, final_only=final_only)   # only a connector answers kv_transfer_params
        self._states[request_id] = state
        self.num_prompt_tokens += len(prompt_ids)
        if self.connector is not None:
            try:
                state.kv_transfer_params = self.connector.on_add(request, kv_transfer_params)
            except BaseException:
                self.abort_request(request_id)
                raise
        return request

    def _admit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
               ) -> tuple[list[int], int]:
        """``add_request``'s checks: the prompt's ids and the output budget, or the error that refuses it."""
        params.validate(self.vocab_size)
        if params.n != 1:   # one sequence a request: LLM.generate and the server make n requests (for_choice)
            raise SamplingParamsError("n", f"an engine request samples one sequence, got n={params.n} (n choices "
                                      "are n requests: SamplingParams.for_choice)")
        if params.allowed_token_ids:   # the client's own masks must leave a token to sample (else a 400, not a 500)
            blocked = {ids[0] for ids in params.bad_words_token_ids or () if len(ids) == 1}
            if params.min_tokens > 0:   # stop tokens are masked until min_tokens is met
                blocked |= set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if blocked.issuperset(params.allowed_token_ids):
                raise InvalidRequestError("every id of 'allowed_token_ids' is masked (a one-token bad word, or a stop "
                                          "token while 'min_tokens' is not met): nothing could be generated",
                                          param="allowed_token_ids")
        if request_id in self._states:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param=None)
        if self.max_waiting_requests is not None and self.scheduler.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are waiting already "
                                 f"(--max-waiting-requests {self.max_waiting_requests}); retry later")
        prompt_ids = list(prompt_token_ids)
        check_token_ids(prompt_ids, self.vocab_size, "prompt")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        max_tokens = resolve_max_tokens(len(prompt_ids), params.max_tokens, self.max_model_len)
        return prompt_ids, max_tokens

    def refuse_kv_transfer(self, kv_transfer_params: dict | None) -> None:
        """A request carrying ``kv_transfer_params`` was refused before the connector took it: the connector ends
        what they hold elsewhere (a decode node's KV handle: the prefill node's lease, freed now rather than at its
        expiry). Safe from any thread: the connector only schedules a release on the server's loop."""
        if self.connector is not None and kv_transfer_params:
            self.connector.on_refused(kv_transfer_params)

    def set_tokenizer_eos(self, token_id: int | None) -> None:
        """The tokenizer's EOS id (the front end knows it). vLLM stops on it with stop_reason None and makes the
        model's other EOS ids (its generation config's) stop_token_ids, so a stop on one of those gives the id."""
        self.scheduler.eos_stop_reasons = frozenset(self.eos_token_ids) - {token_id}

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests in any state; unknown ids are ignored. A request whose blocks a KV transfer still
        writes is aborted once the transfer ended (the connector defers it)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        deferred = self.connector.on_abort(ids) if self.connector is not None else set()
        for rid in ids:
            if self._states.pop(rid, None) is not None:
                self.num_finished += 1
        self.scheduler.finish_requests([rid for rid in ids if rid not in deferred], RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> EngineOutput | None:
        """Finish one unfinished request now (a connector's: its first token ended it); its final output, or None
        for an unknown id."""
        state = self._states.get(request_id)
        if state is None:
            return None
        self.scheduler.finish_requests([request_id], status)
        return self._make_output(state, None)

    def abort_all(self) -> list[str]:
        ids = list(self._states) + [rid for rid in self.scheduler.requests if rid not in self._states]
        self.abort_request(ids)
        self._in_flight = None  # its requests are gone; the device finishes its work in stream order
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        if self.connector is not None:
            self.connector.before_step()
        if self.overlap_steps or self._in_flight is not None:  # once started, the pipeline runs until idle
            try:
                outputs = self._step_overlapped()
            except BaseException:
                self._in_flight = None
                raise
        else:
            outputs = self._step_plain()
        if self.connector is not None:
            self.connector.after_step(outputs)
        return outputs

    def _step_plain(self) -> list[EngineOutput]:
        scheduler_output = self._schedule()
        self.last_step_num_scheduled = len(scheduler_output.scheduled)
        if not scheduler_output.scheduled:
            return []
        sampled = self.runner.execute(scheduler_output)
        failed = self._fail_sampling_errors(sampled)
        touched = self.scheduler.update_from_output(scheduler_output, sampled)
        return self._make_outputs(touched, sampled) + failed

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        for rid in scheduler_output.finished_ids:
            self.runner.forget(rid)
        if self.connector is not None:
            self.connector.on_schedule(scheduler_output)
        return scheduler_output

    def _launch(self, scheduler_output: SchedulerOutput, packed=None, prev: _InFlight | None = None
                ) -> _InFlight | None:
        if not scheduler_output.scheduled:
            return None
        if packed is None:
            packed = self.runner.pack(scheduler_output, prev.launched if prev is not None else None)
        return _InFlight(scheduler_output, self.runner.launch(packed))

    def _step_overlapped(self) -> list[EngineOutput]:
        current = self._in_flight or self._launch(self._schedule())
        if current is None:
            self.last_step_num_scheduled = 0
            return []
        sampling = current.launched.inputs.sampling
        failed: list[EngineOutput] = []
        if all(_samples_without_history(sr.request) for sr in sampling):
            touched = self.scheduler.update_from_output(
                current.scheduled, {sr.request.request_id: PLACEHOLDER for sr in sampling})
            holes = [(r, r.num_output_tokens - 1) for r in touched]  # each got exactly one placeholder, last
            following = self._schedule()
            if all(_samples_without_history(sr.request) for sr in following.scheduled if sr.samples):
                # N+1 gathers N's samples on the device: queued before the host reads N's tokens
                upcoming = self._launch(following, prev=current)
                sampled = self.runner.collect(current.launched)  # waits for step N's samples only
                failed = self._fail_sampling_errors(sampled)
                self._fill_placeholders(holes, sampled)
            else:  # N+1's sampler reads earlier outputs: they must hold N's real tokens when it is queued
                packed = self.runner.pack(following) if following.scheduled else None
                sampled = self.runner.collect(current.launched)
                failed = self._fail_sampling_errors(sampled)
                self._fill_placeholders(holes, sampled)
                upcoming = self._launch(following, packed)
        else:  # the sampler read these requests' earlier outputs: book real tokens, then schedule
            sampled = self.runner.collect(current.launched)
            failed = self._fail_sampling_errors(sampled)
            touched = self.scheduler.update_from_output(current.scheduled, sampled)
            following = self._schedule()
            upcoming = self._launch(following)
        self._in_flight = upcoming
        self.last_step_num_scheduled = len(following.scheduled)
        return self._make_outputs(touched, sampled) + failed

    def _fill_placeholders(self, holes: list[tuple[Request, int]], sampled: dict) -> None:
        """Put step N's sampled ids where its placeholders are, and finish the requests they stop."""
        for request, index in holes:
            token = sampled.get(request.request_id)
            if token is None:  # its sampling failed: the request is aborted already
                continue
            token = token.token_id
            request.output_token_ids[index] = token
            request.all_token_ids[request.num_prompt_tokens + index] = token
            if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED):
                continue
            if self.scheduler.check_stop(request) != RequestStatus.FINISHED_STOPPED:
                continue
            if request.is_finished:  # capped by length on the placeholder: a stop token wins, as in update
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _fail_sampling_errors(self, sampled: dict) -> list[EngineOutput]:
        """Requests whose own sampling failed (the sampler's ``SampledToken.error``): out of ``sampled``, aborted
        alone, each with an output that says why."""
        errors = {rid: tok.error for rid, tok in sampled.items() if getattr(tok, "error", None) is not None}
        outputs = []
        for rid, message in errors.items():
            del sampled[rid]
            logger.log(logging.WARNING if isinstance(message, RequestFault) else logging.ERROR,
                       "request %s: sampling failed (%s); finishing it alone", rid, message)
            state = self._states.get(rid)
            if state is not None:   # with what it had not sent yet (a final-only request: all its tokens so far)
                outputs.append(self._make_output(state, None, error=message))
            self.num_request_errors += 1
            self.abort_request(rid)
        return outputs

    def _make_outputs(self, touched: list[Request], sampled: dict) -> list[EngineOutput]:
        outputs = []
        states = self._states
        for request in touched:
            state = states.get(request.request_id)
            if state is None or (state.final_only and not request.status.is_finished):
                continue
            outputs.append(self._make_output(state, sampled.get(request.request_id)))
        return outputs

    def _make_output(self, state: _State, sampled, error: str | None = None) -> EngineOutput:
        """``error``: the request failed (finish_reason "error"); the caller aborts it in the scheduler."""
        request = state.request
        new_ids = request.output_token_ids[state.num_emitted_tokens:]
        state.num_emitted_tokens = len(request.output_token_ids)
        self.num_generation_tokens += len(new_ids)
        new_logprobs = None
        if request.sampling_params.logprobs is not None and sampled is not None:
            new_logprobs = [TokenLogprobs(sampled.token_id, sampled.logprob, sampled.top_logprobs, sampled.rank)]
        prompt_logprobs = None
        if request.prompt_logprobs is not None and new_ids and not state.prompt_logprobs_sent:
            state.prompt_logprobs_sent = True     # the whole prompt was computed before its first token
            prompt_logprobs = [None if e is None else TokenLogprobs(*e) for e in request.prompt_logprobs]
        finished = error is not None or request.is_finished
        if finished:
            del self._states[request.request_id]
            self.num_finished += 1
        return EngineOutput(
            request_id=request.request_id, new_token_ids=new_ids, new_logprobs=new_logprobs, finished=finished,
            finish_reason="error" if error is not None else request.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished and error is None else None,
            num_cached_tokens=request.num_cached_tokens or 0,
            kv_transfer_params=state.kv_transfer_params if finished else None, error=error,
            prompt_logprobs=prompt_logprobs)

    # ---- stats -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        queried = s.prefix_cache_queried_tokens
        return dict(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            block_size=self.kv_cache_manager.block_size, max_model_len=self.max_model_len,
            num_prefill_chunks=s.num_prefill_chunks, prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            prefix_cache_queried_tokens=queried,
            prefix_cache_hit_rate=s.prefix_cache_hit_tokens / queried if queried else 0.0,
            num_preemptions=s.num_preemptions, prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens, num_finished=self.num_finished,
            num_request_errors=self.num_request_errors, timestamp=time.time())


def freeze_startup_heap() -> None:
    """Take every object alive after start-up (imported modules, the model, the captured graphs) out of the
    collector's reach (``gc.freeze``), after collecting start-up's own garbage. A full collection walks the whole
    heap: in the Qwen3-0.6B e2e run on an H100 host one took 200-300 ms, two or three times a run, and the GPU sat
    idle behind the stopped engine thread (issue 13, sixth pass). Objects made later (requests, outputs) are still
    collected as before. On CUDA, where a step is a few ms; the CPU path's steps are far longer than a pass.
    ``PDPOOL_GC_FREEZE=0`` leaves the heap as it is (for A/B runs)."""
    gc.collect()
    gc.freeze()


def _samples_without_history(request: Request) -> bool:
    """Its sampling reads no earlier output token (no penalties, min_tokens met, no bad word of several tokens, no
    grammar), so the sampler may see the placeholder of the token being sampled at the end of its output list."""
    return not request.sampling_params.reads_output and request.num_output_tokens >= request.min_tokens
