"""``LLMEngine``: the glue of one node's engine.

It owns the tokenizer, the scheduler (with its KV-cache manager), the model runner and one detokenizer per
request. One ``step()``::

    scheduler.schedule() -> runner.execute() -> scheduler.update_from_output()
        -> detokenize the new tokens -> stop strings (finish those requests) -> RequestOutputs

On CUDA the steps overlap (``overlap_steps``, vLLM v1's async scheduling): while the GPU runs step N, the host
books N's samples as placeholders, schedules and packs N+1, and after launching N+1 builds N's outputs::

    host: | update N (placeholders) | schedule N+1 | pack N+1 | sample N (waits) | fill | launch N+1 | outputs N |
    GPU:  | ...................... forward N ...................... | sample N |        | forward N+1 ...

The placeholders (``PLACEHOLDER``) are only counts to the scheduler (lengths, blocks); they are replaced by the
sampled ids before anything reads them as tokens (block hashes, the next step's input, detokenization). A stop
token sampled at N is seen after N+1 was scheduled: N+1's work for that request is dropped. A step whose
sampling reads earlier outputs (penalties, min_tokens masking) samples before booking, as the plain loop does.

The engine is not thread-safe: ``AsyncLLM`` calls it from a single worker thread. ``stats()`` only reads
counters and lengths, so it may be called from elsewhere while a step runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdpool.block_hash import ModelFingerprint
from pdpool.engine.detokenizer import IncrementalDetokenizer
from pdpool.engine.kv_cache_manager import KVCacheManager
from pdpool.engine.model_runner import LaunchedStep, ModelRunner
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # a token sampled by the step in flight, not read back yet (no real id is negative)


class InvalidRequestError(ValueError):
    """A request the engine refuses (too long, empty, token ids out of the vocabulary); ``param`` names the
    offending field for the API's 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # (token id, logprob), best first; None when not asked


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    new_token_ids: list[int]            # this step's
    new_text: str                       # this step's text that is safe to stream (stop-string hold-back)
    new_logprobs: list[TokenLogprobs] | None
    output_token_ids: list[int]         # all so far
    text: str                           # all so far (cut at a stop string)
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None           # "stop" | "length" | "abort"
    stop_reason: str | int | None       # the stop string or stop token id that ended it
    num_cached_tokens: int
    kv_transfer_params: dict | None = None


@dataclass
class _State:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    kv_transfer_params: dict | None
    logprobs: list[TokenLogprobs] | None
    num_emitted_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _InFlight:
    scheduled: SchedulerOutput
    launched: LaunchedStep


class LLMEngine:
    def __init__(self, node_config) -> None:
        from transformers import AutoTokenizer

        self.config = node_config
        self.runner = ModelRunner(node_config)
        info = self.runner.model_config
        self.model_path = info.path
        self.vocab_size = info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        self.tokenizer = AutoTokenizer.from_pretrained(str(info.path))
        cache = node_config.cache
        dtype_name = str(self.runner.dtype).removeprefix("torch.")
        fingerprint = ModelFingerprint(node_config.served_model_name, dtype_name, cache.block_size)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                               fingerprint)
        wanted = node_config.scheduler.max_model_len or info.max_position_embeddings
        if wanted > info.max_position_embeddings:
            logger.warning("--max-model-len %d exceeds the model's %d positions; using %d", wanted,
                           info.max_position_embeddings, info.max_position_embeddings)
            wanted = info.max_position_embeddings
        self.scheduler = Scheduler(node_config.scheduler, self.kv_cache_manager, max_model_len=wanted)
        # The scheduler also caps it at what the whole KV cache holds.
        self.max_model_len = self.scheduler.max_model_len
        self._states: dict[str, _State] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = 0
        self.last_step_num_scheduled = 0  # requests the last step computed (0: idle or all waiting on remote KV)
        # Subclasses that hook the step (the KV connector moves blocks outside the CUDA stream) keep the plain loop.
        self.overlap_steps = self.runner.device.type == "cuda" and type(self).step is LLMEngine.step
        self._in_flight: _InFlight | None = None

    # ---- requests in -----------------------------------------------------------------------------

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    kv_transfer_params: dict | None = None, add_special_tokens: bool = True) -> None:
        """Validate and queue one request; raises ``InvalidRequestError`` or ``SamplingParamsError``."""
        params.validate()
        if request_id in self._states:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        if isinstance(prompt, str):
            text: str | None = prompt
            prompt_ids = self.encode(prompt, add_special_tokens)
        else:
            text = None
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size}) (the vocab size); "
                                          f"got {bad[:5]}", param="prompt")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        params = self._resolve_max_tokens(prompt_ids, params)
        request = Request(request_id, prompt_ids, params, eos_token_id=self.eos_token_ids[0] if self.eos_token_ids
                          else None, arrival_time=arrival_time, priority=priority, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        self._states[request_id] = _State(
            request=request, prompt=text, detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params),
            kv_transfer_params=kv_transfer_params, logprobs=[] if params.logprobs is not None else None)
        self.num_prompt_tokens += len(prompt_ids)

    def _resolve_max_tokens(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        n, limit = len(prompt_ids), self.max_model_len
        if params.max_tokens is None:
            if n >= limit:
                raise InvalidRequestError(
                    f"This model's maximum context length is {limit} tokens. However, your prompt has {n} "
                    f"tokens, which leaves no room for the completion.", param="prompt")
            return dataclasses.replace(params, max_tokens=limit - n)
        if n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                f"Please reduce the length of the prompt or max_tokens.",
                param="prompt" if n >= limit else "max_tokens")
        return params

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            if self._states.pop(rid, None) is not None:
                self.num_finished += 1

    def abort_all(self) -> list[str]:
        ids = list(self._states) + [rid for rid in self.scheduler.requests if rid not in self._states]
        self.abort_request(ids)
        self._in_flight = None  # its requests are gone; the device finishes its work in stream order
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.overlap_steps or self._in_flight is not None:  # once started, the pipeline runs until idle
            try:
                return self._step_overlapped()
            except BaseException:
                self._in_flight = None
                raise
        scheduler_output = self._schedule()
        self.last_step_num_scheduled = len(scheduler_output.scheduled)
        if not scheduler_output.scheduled:
            return []
        sampled = self.runner.execute(scheduler_output)
        touched = self.scheduler.update_from_output(scheduler_output, sampled)
        return self._make_outputs(touched, sampled)

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        for rid in scheduler_output.finished_ids:
            self.runner.forget(rid)
        return scheduler_output

    def _launch(self, scheduler_output: SchedulerOutput, packed=None) -> _InFlight | None:
        if not scheduler_output.scheduled:
            return None
        packed = packed if packed is not None else self.runner.pack(scheduler_output)
        return _InFlight(scheduler_output, self.runner.launch(packed))

    def _step_overlapped(self) -> list[RequestOutput]:
        current = self._in_flight or self._launch(self._schedule())
        if current is None:
            self.last_step_num_scheduled = 0
            return []
        sampling = current.launched.inputs.sampling
        if all(_samples_without_history(sr.request) for sr in sampling):
            touched = self.scheduler.update_from_output(
                current.scheduled, {sr.request.request_id: PLACEHOLDER for sr in sampling})
            holes = [(r, r.num_output_tokens - 1) for r in touched]  # each got exactly one placeholder, last
            following = self._schedule()
            packed = self.runner.pack(following) if following.scheduled else None
            sampled = self.runner.sample(current.launched)  # waits for step N
            self._fill_placeholders(holes, sampled)
        else:  # the sampler reads these requests' earlier outputs: book real tokens, then schedule
            sampled = self.runner.sample(current.launched)
            touched = self.scheduler.update_from_output(current.scheduled, sampled)
            following = self._schedule()
            packed = None
        self._in_flight = self._launch(following, packed)
        self.last_step_num_scheduled = len(following.scheduled)
        return self._make_outputs(touched, sampled)

    def _fill_placeholders(self, holes: list[tuple[Request, int]], sampled: dict) -> None:
        """Put step N's sampled ids where its placeholders are, and finish the requests they stop."""
        for request, index in holes:
            token = sampled[request.request_id].token_id
            request.output_token_ids[index] = token
            request.all_token_ids[request.num_prompt_tokens + index] = token
            if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED):
                continue
            if self.scheduler._check_stop(request) != RequestStatus.FINISHED_STOPPED:
                continue
            if request.is_finished:  # capped by length on the placeholder: a stop token wins, as in update
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _make_outputs(self, touched: list[Request], sampled: dict) -> list[RequestOutput]:
        outputs = []
        for request in touched:
            state = self._states.get(request.request_id)
            if state is None:
                continue
            outputs.append(self._make_output(state, sampled.get(request.request_id)))
        return outputs

    def _make_output(self, state: _State, sampled) -> RequestOutput:
        request = state.request
        params = request.sampling_params
        new_ids = request.output_token_ids[state.num_emitted_tokens:]
        state.num_emitted_tokens = len(request.output_token_ids)
        self.num_generation_tokens += len(new_ids)
        new_logprobs = None
        if state.logprobs is not None and sampled is not None:
            new_logprobs = [TokenLogprobs(sampled.token_id, sampled.logprob, sampled.top_logprobs)]
            state.logprobs.extend(new_logprobs)
        detok = state.detokenizer
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED
        # A stop token (EOS or stop_token_ids) stays in the token ids but not in the text, as in vLLM.
        to_text = new_ids[:-1] if stopped_by_token and not params.include_stop_str_in_output else new_ids
        new_text = detok.add_tokens(to_text)
        finish_reason, stop_reason = request.finish_reason, request.stop_reason
        if detok.stop_reason is not None:  # a stop string: the text is cut, the request ends
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            finish_reason, stop_reason = "stop", detok.stop_reason
        finished = request.is_finished
        if finished:
            new_text += detok.flush()
            del self._states[request.request_id]
            self.num_finished += 1
        return RequestOutput(
            request_id=request.request_id, prompt=state.prompt, prompt_token_ids=request.prompt_token_ids,
            new_token_ids=new_ids, new_text=new_text, new_logprobs=new_logprobs,
            output_token_ids=list(request.output_token_ids), text=detok.output_text,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finished=finished, finish_reason=finish_reason if finished else None,
            stop_reason=stop_reason if finished else None, num_cached_tokens=request.num_cached_tokens or 0,
            kv_transfer_params=state.kv_transfer_params if finished else None)

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
            timestamp=time.time())


def _samples_without_history(request: Request) -> bool:
    """Its sampling reads no earlier output token (no penalties, min_tokens met), so the sampler may see the
    placeholder of the token being sampled at the end of its output list."""
    params = request.sampling_params
    return not params.has_penalties and request.num_output_tokens >= request.min_tokens
