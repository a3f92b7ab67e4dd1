"""vLLM's beam search (``use_beam_search``), on the engine's async generate API, for completions and chat alike.

One prompt's search, ``n`` beams wide, runs ``max_tokens`` steps. Each step adds one engine request per live beam
(the prompt and the beam's tokens as a token-id prompt; the prefix cache holds the shared part) that generates one
greedy token with ``2 * n`` logprobs, read from the raw logits::

    candidates  = for each beam, for each of its 2n best next tokens: (beam's cum_logprob + logprob, beam + token)
    EOS         -> a finished beam ("stop", stop_reason the EOS id), kept aside (unless ignore_eos)
    other       -> the n best candidates are the next step's beams

After the last step the live beams join the finished ones ("length"), and the ``n`` best by
``cum_logprob / len(prompt + output) ** length_penalty`` (an EOS at the end not counted) are the answer's choices,
best first: vLLM 0.32's algorithm (``entrypoints/generate/beam_search/online.py``), so the same texts in float32.
Temperature, seed and sampling options change nothing here; the front end refuses the ones vLLM silently drops.

Each choice is a ``BeamStream``: the server reads it as it reads an engine request's stream (one final output).
Aborting any of them (a client gone) cancels the search and aborts its step's engine requests: no KV is kept.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace

from pdpool.engine.async_llm import RequestFailedError
from pdpool.engine.output_processor import RequestOutput
from pdpool.engine.sampling_params import SamplingParams


@dataclass
class Beam:
    tokens: list[int]            # the prompt's and the beam's
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None


def score(beam: Beam, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's (and transformers') beam score: the sequence's log probability over its length (prompt included, a
    final EOS not) to the power ``length_penalty``."""
    length = max(len(beam.tokens) - (eos_token_id is not None and beam.tokens[-1] == eos_token_id), 1)
    try:
        return beam.cum_logprob / length ** length_penalty
    except (OverflowError, ZeroDivisionError):   # a huge penalty (any finite JSON number is taken): the same order
        return beam.cum_logprob / math.exp(min(max(length_penalty * math.log(length), -700.0), 700.0))


class BeamSearch:
    """One prompt's search; ``start`` adds its first step (the request's refusals come from there) and returns the
    ``n`` choices' streams, whose outputs come when the search ends."""

    def __init__(self, llm, request_id: str, prompt, params: SamplingParams, *, width: int, length_penalty: float,
                 priority: int = 0, cache_salt: str | None = None, add_special_tokens: bool = True,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.llm = llm
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.width = width
        self.length_penalty = length_penalty
        self._add = dict(priority=priority, cache_salt=cache_salt)
        self._add_special_tokens = add_special_tokens
        self._given_ids = prompt_token_ids
        self._step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width)
        self._in_flight: list = []      # the current step's engine streams
        self._task: asyncio.Task | None = None
        self._result: asyncio.Future | None = None
        self.streams: list[BeamStream] = []

    async def start(self) -> list["BeamStream"]:
        # step 0: the request's prompt, its options (truncate_prompt_tokens) and its refusals
        first = await self.llm.add_request(
            f"{self.request_id}-s0-0", self.prompt, replace(self._step_params,
                                                           truncate_prompt_tokens=self.params.truncate_prompt_tokens),
            add_special_tokens=self._add_special_tokens, prompt_token_ids=self._given_ids, **self._add)
        self._in_flight = [first]
        self.prompt_token_ids = list(first.prompt_token_ids)
        self.prompt_cut = first.prompt_cut
        self._result = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._run())
        self.streams = [BeamStream(self, j) for j in range(self.width)]
        return self.streams

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for stream in self._in_flight:
            stream.abort()

    async def _run(self) -> None:
        try:
            self._result.set_result(await self._search())
        except asyncio.CancelledError:
            self._result.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each choice's reader gets the failure
            self._result.set_exception(exc)
        finally:
            for stream in self._in_flight:
                stream.abort()

    def _max_tokens(self) -> int:
        left = self.llm.max_model_len - len(self.prompt_token_ids)
        return left if self.params.max_tokens is None else min(self.params.max_tokens, left)

    async def _search(self) -> list[RequestOutput]:
        eos = self.llm.tokenizer.eos_token_id
        ignore_eos = self.params.ignore_eos
        beams, finished = [Beam(self.prompt_token_ids)], []
        num_cached = 0
        for step in range(self._max_tokens()):
            if step:
                self._in_flight = []
                for i, beam in enumerate(beams):
                    self._in_flight.append(await self.llm.add_request(
                        f"{self.request_id}-s{step}-{i}", beam.tokens, self._step_params, add_special_tokens=False,
                        **self._add))
            finals = await asyncio.gather(*(_final(s) for s in self._in_flight))
            for out in finals:
                if out is None or out.finish_reason in ("abort", "error"):
                    raise RequestFailedError(f"a beam search step ended without its token "
                                             f"({getattr(out, 'error', None) or 'aborted'})")
            if step == 0:
                num_cached = finals[0].num_cached_tokens
            candidates = []
            for beam, out in zip(beams, finals):
                for token, logprob in _next_tokens(out):
                    cum = beam.cum_logprob + logprob
                    if token == eos and not ignore_eos:
                        kept = beam.tokens + [eos] if self.params.include_stop_str_in_output else beam.tokens
                        finished.append(Beam(kept, cum, "stop", eos))
                    else:
                        candidates.append((cum, token, beam))
            # the best first; ties keep the order of their beams and ranks (a stable sort)
            candidates.sort(key=lambda c: -c[0])
            beams = [Beam(beam.tokens + [token], cum) for cum, token, beam in candidates[:self.width]]
            if not beams:
                break
        finished.extend(beams)
        finished.sort(key=lambda b: score(b, eos, self.length_penalty), reverse=True)
        return [self._output(j, beam, eos, num_cached) for j, beam in enumerate(finished[:self.width])]

    def _output(self, index: int, beam: Beam, eos: int | None, num_cached: int) -> RequestOutput:
        ids = beam.tokens[len(self.prompt_token_ids):]
        shown = ids[:-1] if ids and ids[-1] == eos and not self.params.ignore_eos else ids
        text = self.llm.tokenizer.decode(shown, skip_special_tokens=self.params.skip_special_tokens)
        return RequestOutput(
            request_id=f"{self.request_id}-{index}", prompt=self.prompt if isinstance(self.prompt, str) else None,
            prompt_token_ids=self.prompt_token_ids, new_token_ids=ids, new_text=text, new_logprobs=None,
            num_output_tokens=len(ids), finished=True, finish_reason=beam.finish_reason or "length",
            stop_reason=beam.stop_reason, num_cached_tokens=num_cached, output_token_ids=ids, text=text)


async def _final(stream) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    return final


def _next_tokens(out: RequestOutput) -> list[tuple[int, float]]:
    """A step's candidates, as vLLM's logprobs dict holds them: the sampled (greedy) token, then the best others."""
    entry = (out.logprobs or [None])[0]
    if entry is None:
        return []
    found = {entry.token_id: entry.logprob}
    for token, logprob in entry.top or ():
        found.setdefault(token, logprob)
    return list(found.items())


class BeamStream:
    """Choice ``index`` of a search, read as an engine request's stream: one final output."""

    def __init__(self, search: BeamSearch, index: int) -> None:
        self.search = search
        self.index = index
        self.request_id = f"{search.request_id}-{index}"
        self.prompt_token_ids = search.prompt_token_ids
        self.prompt_cut = search.prompt_cut
        self.finished = False

    async def __aiter__(self):
        try:
            outputs = await asyncio.shield(self.search._result)
            self.finished = True
            yield outputs[self.index] if self.index < len(outputs) else _empty(self.search, self.index)
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.search.abort()


def _empty(search: BeamSearch, index: int) -> RequestOutput:
    """A choice past the beams the search found (a vocabulary smaller than the width): no tokens."""
    return RequestOutput(request_id=f"{search.request_id}-{index}", prompt=None,
                         prompt_token_ids=search.prompt_token_ids, new_token_ids=[], new_text="", new_logprobs=None,
                         num_output_tokens=0, finished=True, finish_reason="length", stop_reason=None,
                         num_cached_tokens=0, output_token_ids=[], text="")
