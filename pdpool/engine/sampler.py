"""Batched sampling: penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

Order (vLLM's): min-tokens stop masking, repetition penalty, presence/frequency penalties, then (random rows only)
temperature, top-k, top-p, min-p, and the draw. Greedy rows take the argmax of the penalized logits.

Logprobs (sampled token and top-n) come from the raw model logits, log_softmax before any processing: vLLM's
default `raw_logprobs`, so a token's reported logprob does not depend on the request's sampling settings.
"""

from __future__ import annotations

from typing import Sequence

from dataclasses import dataclass

import torch

from pdpool.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token; NaN for every row when no request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # None when no request asked; [] for those that did not


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] | int | None = (), seed: int | None = None):
        # Every EOS id is masked, with stop_token_ids, until min_tokens are out.
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or ())
        self.seed = seed
        self._shared: torch.Generator | None = None  # for unseeded requests, made on the logits' device

    def sample(
        self,
        logits: torch.Tensor,  # [R, V] float32, left untouched
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        logits = logits.float()
        processed = self._mask_min_tokens(logits, params, output_token_ids)
        if any(p.has_penalties for p in params):
            processed = apply_penalties(processed.clone() if processed is logits else processed,
                                        params, prompt_token_ids, output_token_ids)
        token_ids = processed.argmax(dim=-1)  # [R]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            probs = filtered_probs(processed[random_rows], [params[i] for i in random_rows])
            q = self._exponentials(probs, [generators[i] for i in random_rows])
            token_ids[random_rows] = (probs / q).argmax(dim=-1)  # exponential race = sampling from probs
        token_ids = token_ids.tolist()  # the step's one sync
        if all(p.logprobs is None for p in params):  # a full pass over [R, V] saved: nobody reads them
            return SamplerOutput(token_ids, [float("nan")] * len(token_ids), None)

        lse = torch.logsumexp(logits, dim=-1)  # [R], raw logprob normalizer
        chosen = torch.tensor(token_ids, device=logits.device)[:, None]
        sampled_logprobs = (logits.gather(1, chosen)[:, 0] - lse).tolist()
        top_logprobs = None
        max_n = max((p.logprobs or 0) for p in params)
        if max_n:
            values, indices = logits.topk(max_n, dim=-1)  # [R, max_n]
            values, indices = (values - lse[:, None]).tolist(), indices.tolist()
            top_logprobs = [list(zip(indices[i][: p.logprobs or 0], values[i][: p.logprobs or 0]))
                            for i, p in enumerate(params)]
        return SamplerOutput(token_ids, sampled_logprobs, top_logprobs)

    def _mask_min_tokens(self, logits, params, output_token_ids) -> torch.Tensor:
        masked = logits
        for i, p in enumerate(params):
            if len(output_token_ids[i]) >= p.min_tokens:
                continue
            stop_ids = list(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids += self.eos_token_ids
            if stop_ids:
                masked = logits.clone() if masked is logits else masked
                masked[i, stop_ids] = float("-inf")
        return masked

    def _exponentials(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        # One Exp(1) draw per vocab entry; a seeded row draws only from its own generator, so its tokens do not
        # depend on the rest of the batch.
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            if self._shared is None or self._shared.device != probs.device:
                self._shared = make_generator(self.seed, probs.device)
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self._shared)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """In place. Repetition: HF semantics over prompt + output tokens (positive logits divided, negative multiplied).
    Presence/frequency: OpenAI semantics over output tokens, logit -= frequency * count + presence * (count > 0)."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    vocab, device = logits.shape[1], logits.device
    # output_counts: [r, V]; seen: [r, V] token in prompt or output. Column `vocab` takes the padding.
    outputs = _padded([output_token_ids[i] for i in rows], vocab, device)
    output_counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(
        1, outputs, torch.ones_like(outputs, dtype=torch.float32))[:, :vocab]
    prompts = _padded([prompt_token_ids[i] for i in rows], vocab, device)
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device).scatter_(1, prompts, True)[:, :vocab]
    seen |= output_counts > 0

    def column(name):
        return torch.tensor([getattr(params[i], name) for i in rows], dtype=logits.dtype, device=device)[:, None]

    x = logits[rows]  # [r, V]
    rep = column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= column("frequency_penalty") * output_counts + column("presence_penalty") * (output_counts > 0)
    logits[rows] = x
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on [r, V] logits of non-greedy rows; returns probabilities [r, V]."""
    device = logits.device
    x = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        x = apply_top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
    if any(p.min_p > 0 for p in params):
        x = apply_min_p(x, [p.min_p for p in params])
    return x.softmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """One ascending sort serves both. Top-k keeps ties with the k-th value; top-p drops the lowest tokens whose
    cumulative probability is <= 1 - p, always keeping the top one (as HF's warpers)."""
    vocab, device = logits.shape[1], logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # [r, V] ascending
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=device)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])  # [r, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # 1 - p taken in float64 then rounded, as HF's python-float threshold is
    drop_below = torch.tensor([1 - p for p in top_p], device=device)[:, None]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = (cum <= drop_below) & torch.tensor([p < 1 for p in top_p], device=device)[:, None]
    remove[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = torch.tensor(min_p, device=logits.device)[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
