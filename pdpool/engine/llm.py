"""Offline API: ``LLM("demo").generate(prompts, SamplingParams(...))``, results in input order, shaped as vLLM's::

    for out in llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16)):
        print(out.prompt, out.outputs[0].text, out.outputs[0].token_ids, out.prompt_token_ids)

The same pieces as a server, in one thread: the front end tokenizes, the engine steps, the output processor
detokenizes and applies stop strings.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from pdpool import config
from pdpool.engine.llm_engine import LLMEngine, TokenLogprobs
from pdpool.engine.output_processor import OutputProcessor, RequestOutput
from pdpool.engine.sampling_params import SamplingParams, generation_defaults
from pdpool.engine.structured import Grammars
from pdpool.frontend import Frontend, ModelFiles, Tokenizer

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's ``CompletionOutput``)."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class GenerationResult:
    """What ``generate`` returns per prompt (vLLM's offline ``RequestOutput``); ``text``, ``output_token_ids``,
    ``finish_reason``, ``stop_reason`` and ``logprobs`` read its first (only) sequence."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # with the params' prompt_logprobs; first None

    @classmethod
    def from_final(cls, out: RequestOutput) -> "GenerationResult":
        seq = CompletionOutput(0, out.text or "", out.output_token_ids or [], out.logprobs, out.finish_reason,
                               out.stop_reason)
        return cls(out.request_id, out.prompt, out.prompt_token_ids, [seq], out.finished, out.num_cached_tokens,
                   out.prompt_logprobs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


class LLM:
    """``LLM(model, dtype=..., **settings)``: settings are any names of the config schema (``max_num_seqs``,
    ``block_size``, ``num_threads``, ...)."""

    def __init__(self, model: str = "demo", *, dtype: str = "auto", **settings: Any) -> None:
        self.config = config.build(model=model, dtype=dtype, **settings)
        self.engine = LLMEngine(self.config)
        path = self.engine.model_path
        self.frontend = Frontend(ModelFiles.read(path), Tokenizer(path, self.config.model.chat_template))
        Grammars.of(self.frontend)
        self.generation_defaults = generation_defaults(path, self.config.model)
        self.output_processor = OutputProcessor(self.frontend.tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, *, use_tqdm: bool = True) -> list[GenerationResult]:
        """Run every prompt to completion; one result per prompt, in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        return self._run([(prompt, p, True) for prompt, p in zip(prompts, params_list)], use_tqdm)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *,
             use_tqdm: bool = False) -> GenerationResult:
        prompt = self.frontend.render_chat(messages, True)
        return self._run([(prompt, params or self.get_default_sampling_params(), False)], use_tqdm)[0]

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without params, as vLLM's: the model's generation defaults
        (``--generation-config``; max_tokens 16 unless they give max_new_tokens)."""
        d = self.generation_defaults
        max_tokens = d.max_tokens or 16
        if d.max_tokens_cap is not None:
            max_tokens = min(max_tokens, d.max_tokens_cap)
        return SamplingParams(**d.sampling, max_tokens=max_tokens)

    def _run(self, requests: list[tuple[Prompt, SamplingParams, bool]], use_tqdm: bool) -> list[GenerationResult]:
        ids: list[str] = []
        try:
            for prompt, params, add_special_tokens in requests:
                rid = f"offline-{next(self._ids)}"
                token_ids = self.frontend.encode_prompt(prompt, add_special_tokens)
                kept = self.frontend.apply_prompt_options(token_ids, params, self.engine.max_model_len)
                if len(kept) < len(token_ids):
                    token_ids, prompt = kept, kept
                # only the finished outputs are read here: no per-step outputs or text (see OutputProcessor)
                self.engine.add_request(rid, token_ids, params, final_only=True)
                ids.append(rid)
                self.output_processor.add(rid, prompt if isinstance(prompt, str) else None, token_ids, params,
                                          final_only=True)
            return self._drain(ids, use_tqdm)
        except BaseException:
            for rid in ids:
                self.output_processor.forget(rid)
            self.engine.abort_request(ids)
            raise

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[GenerationResult]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while len(final) < len(ids):
                results, stopped = self.output_processor.process(self.engine.step())
                if stopped:
                    self.engine.abort_request(stopped)
                for out in results:
                    if out.finish_reason == "error":
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(final) < len(ids):
                    missing = [i for i in ids if i not in final]
                    raise RuntimeError(f"the engine dropped requests {missing}")
        finally:
            if bar is not None:
                bar.close()
        return [GenerationResult.from_final(final[i]) for i in ids]
