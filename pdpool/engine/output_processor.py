"""Engine outputs (token ids) -> request outputs (text), off the engine thread.

The engine thread schedules, runs the model and samples; this runs where the server's event loop (or the offline
``LLM``'s caller) is, as vLLM v1's ``OutputProcessor`` does. Per request it keeps an incremental detokenizer and,
when asked for, the logprobs; it finds stop strings and returns the ids the engine must abort because of them.

Every ``RequestOutput`` is a delta (this step's tokens, text and logprobs), so a slow streaming client costs
O(its tokens), never a copy of everything so far per step. The final output also carries the totals.

A request added with ``final_only`` (the offline ``LLM``'s) gets one output, when it finishes: its delta is then
everything (all ids, text and logprobs). Its ids are appended as they come and, unless it has stop strings (which
need the text as it grows), its text is decoded once at the end (``detokenize_once``): the same text, without a
tokenizer call and an output object per token. Streaming requests are processed exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdpool.engine.detokenizer import IncrementalDetokenizer, decodes_locally, detokenize_once
from pdpool.engine.llm_engine import EngineOutput, TokenLogprobs
from pdpool.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    new_token_ids: list[int]                  # this step's
    new_text: str                             # this step's text that is safe to stream (stop-string hold-back)
    new_logprobs: list[TokenLogprobs] | None
    num_output_tokens: int                    # all so far
    finished: bool
    finish_reason: str | None                 # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None             # the stop string or stop token id that ended it
    num_cached_tokens: int
    kv_transfer_params: dict | None = None
    # The totals, on the final output only:
    output_token_ids: list[int] | None = None
    text: str | None = None                   # cut at a stop string
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None                  # finish_reason "error": why
    # ``prompt_logprobs``: on the output that first carries tokens (and on a final-only output), one per prompt
    # token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class _State:
    __slots__ = ("prompt", "prompt_token_ids", "params", "detokenizer", "output_token_ids", "logprobs", "final_only",
                 "prompt_logprobs")

    def __init__(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 token_texts: dict[int, str], final_only: bool = False) -> None:
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.final_only = final_only
        # None: the text is decoded once, at the end (final only, no stop strings)
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params, token_texts)
                            if not final_only or params.stop else None)
        self.output_token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    def take(self, out: EngineOutput) -> list[int]:
        """Append one engine output's ids (and logprobs); return those of its ids that go into the text. A stop
        token (EOS or stop_token_ids) stays in the token ids but not in the text, as in vLLM."""
        new_ids = out.new_token_ids
        self.output_token_ids += new_ids
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs += out.new_logprobs
        if out.finish_reason == "stop" and new_ids and not self.params.include_stop_str_in_output:
            return new_ids[:-1]
        return new_ids

    def cut_at_stop_string(self, num_kept: int) -> int:
        """Keep the first ``num_kept`` output ids (those up to the one that completed a stop string) and their
        logprobs; return how many were dropped. An output may carry several ids (a decode node's first one holds
        the prefill node's token too): ids after the stop string were never the answer's, as one id per step
        would have shown."""
        dropped = len(self.output_token_ids) - num_kept
        if dropped <= 0:
            return 0
        del self.output_token_ids[num_kept:]
        if self.logprobs is not None:
            del self.logprobs[num_kept:]
        return dropped


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}
        # one id's text decoded alone, by skip_special_tokens: the detokenizers' context decode of the id they
        # emitted last, a dict lookup instead of a tokenizer call per request per step
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}
        self._decodes_locally = decodes_locally(tokenizer)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, *,
            final_only: bool = False) -> None:
        """``final_only``: the consumer reads only the finished output (no deltas before it)."""
        texts = self._token_texts[bool(params.skip_special_tokens)]
        self._states[request_id] = _State(prompt, prompt_token_ids, params, self.tokenizer, texts, final_only)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of a request aborted here, not by the engine (vLLM's final abort output): no new
        token, ``finish_reason`` "abort", the totals so far; None for an unknown or finished request."""
        if request_id not in self._states:
            return None
        results, _ = self.process([EngineOutput(request_id, [], None, True, "abort")])
        return results[0] if results else None

    def __len__(self) -> int:
        return len(self._states)

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The request outputs of one engine step, and the ids a stop string finished (abort them in the engine)."""
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:  # finished here already (a stop string), or aborted
                continue
            result = self._process_final_only(state, out) if state.final_only else self._process_one(state, out)
            if result is None:  # final only, not finished
                continue
            if result.finished:
                del self._states[out.request_id]
                if not out.finished:
                    stopped.append(out.request_id)
            results.append(result)
        return results, stopped

    def _process_one(self, state: _State, out: EngineOutput) -> RequestOutput:
        detok = state.detokenizer
        new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
        new_text = detok.add_tokens(state.take(out))
        finished, finish_reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        if detok.stop_reason is not None:  # a stop string: the text is cut, the request ends
            finished, finish_reason, stop_reason = True, "stop", detok.stop_reason
            dropped = state.cut_at_stop_string(len(detok.token_ids))
            if dropped:
                new_ids = new_ids[:len(new_ids) - dropped]
                new_logprobs = new_logprobs[:len(new_ids)] if new_logprobs is not None else None
        result = RequestOutput(
            request_id=out.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            new_token_ids=new_ids, new_text=new_text, new_logprobs=new_logprobs,
            num_output_tokens=len(state.output_token_ids), finished=finished,
            finish_reason=finish_reason if finished else None, stop_reason=stop_reason if finished else None,
            num_cached_tokens=out.num_cached_tokens, kv_transfer_params=out.kv_transfer_params if finished else None,
            error=out.error, prompt_logprobs=out.prompt_logprobs)
        if finished:
            result.new_text += detok.flush()
            result.output_token_ids = state.output_token_ids
            result.text = detok.output_text
            result.logprobs = state.logprobs
        return result

    def _process_final_only(self, state: _State, out: EngineOutput) -> RequestOutput | None:
        """``_process_one`` for a consumer of the finished output only: None until the request finishes, then one
        output whose delta is everything (what the concatenated deltas of ``_process_one`` would be)."""
        params, detok = state.params, state.detokenizer
        to_text = state.take(out)
        finished, finish_reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        if detok is not None:  # stop strings: the text as it grows
            detok.add_tokens(to_text)
            if detok.stop_reason is not None:
                finished, finish_reason, stop_reason = True, "stop", detok.stop_reason
                state.cut_at_stop_string(len(detok.token_ids))
        if not finished:
            return None
        ids = state.output_token_ids
        if detok is not None:
            detok.flush()
            text = detok.output_text
        else:
            # the stop token is the last id of the output that finished it (as _process_one leaves it out)
            dropped = len(out.new_token_ids) - len(to_text)
            text = detokenize_once(self.tokenizer, state.prompt_token_ids, ids[:len(ids) - dropped], params,
                                   self._token_texts[bool(params.skip_special_tokens)], self._decodes_locally)
        return RequestOutput(
            request_id=out.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            new_token_ids=list(ids), new_text=text,
            new_logprobs=list(state.logprobs) if state.logprobs is not None else None, num_output_tokens=len(ids),
            finished=True, finish_reason=finish_reason, stop_reason=stop_reason,
            num_cached_tokens=out.num_cached_tokens, kv_transfer_params=out.kv_transfer_params, error=out.error,
            output_token_ids=ids, text=text, logprobs=state.logprobs, prompt_logprobs=state.prompt_logprobs)
