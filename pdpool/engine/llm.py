"""Offline API: ``LLM("demo").generate(prompts, SamplingParams(...))``, outputs in input order."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from pdpool import config
from pdpool.engine.llm_engine import LLMEngine, RequestOutput
from pdpool.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM(model, dtype=..., **settings)``: settings are any names of the config schema (``max_num_seqs``,
    ``block_size``, ``num_threads``, ...)."""

    def __init__(self, model: str = "demo", *, dtype: str = "auto", **settings: Any) -> None:
        self.config = config.build(model=model, dtype=dtype, **settings)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; one final ``RequestOutput`` per prompt, in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.engine.add_request(rid, prompt, p)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *,
             use_tqdm: bool = False) -> RequestOutput:
        prompt = self.engine.apply_chat_template(messages, True)
        rid = f"offline-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params or SamplingParams(), add_special_tokens=False)
        return self._run([rid], use_tqdm)[0]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(final) < len(ids):
                    missing = [i for i in ids if i not in final]
                    raise RuntimeError(f"the engine dropped requests {missing}")
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in final])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]
