"""The batched logits operations that ``pdpool.engine.sampler.Sampler`` composes, and what it works out once per
batch: ``SamplingPlan`` (the rows each step's masks, biases and fused pass need, and their device columns),
repetition/frequency/presence penalties, temperature with top-k, top-p and min-p, and ``column`` (a host list to
the device without a sync). Pure tensor functions of a batch's params: a row's failure is the sampler's to
isolate."""

from __future__ import annotations

import torch

from pdpool.engine.sampling_params import SamplingParams


def column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor [len] without a sync (``torch.tensor(..., device=cuda)`` copies from
    pageable memory and waits for the stream: the whole queued forward)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class SamplingPlan:
    """What sampling a batch needs from its params alone, worked out once per batch composition: the runner keeps
    one while its sampling rows are the same requests in the same order (every decode step between a request's
    arrival and the next one's finish), so a step pays no per-row Python for it. The params must not change
    while a plan of them is in use (the engine never changes a request's params)."""

    __slots__ = ("min_token_rows", "bias_rows", "allowed_rows", "bad_word_rows", "grammar_rows", "masked_rows",
                 "fusable", "any_logprobs", "_temperature", "_bias", "_allowed")

    def __init__(self, params: list[SamplingParams]):
        self.min_token_rows = [i for i, p in enumerate(params) if p.min_tokens > 0]
        self.bias_rows = [i for i, p in enumerate(params) if getattr(p, "logit_bias", None)]
        self.allowed_rows = [i for i, p in enumerate(params) if getattr(p, "allowed_token_ids", None)]
        self.bad_word_rows = [i for i, p in enumerate(params) if getattr(p, "bad_words_token_ids", None)]
        self.grammar_rows = [i for i, p in enumerate(params) if getattr(p, "grammar", None) is not None]
        self.masked_rows = sorted({*self.allowed_rows, *self.bad_word_rows, *self.grammar_rows})   # may be left
        self.fusable = (not self.bias_rows and not self.masked_rows and all(_fusable(p) for p in params))
        self.any_logprobs = any(p.logprobs is not None for p in params)
        self._temperature: torch.Tensor | None = None  # [R] float32 on the logits' device, 0 for greedy rows
        self._bias: tuple | None = None  # (vocab, device, rows [N], ids [N], values [N], bad rows) of logit_bias
        self._allowed: tuple | None = None  # (vocab, device, rows [A], keep [A, V] bool, bad rows)

    def allowed_mask(self, params: list[SamplingParams], vocab: int, device: torch.device) -> tuple:
        """``allowed_token_ids``' rows [A] int64 and their keep mask [A, V] bool (None, None when no row is left),
        and the rows whose ids reach beyond ``vocab``."""
        cached = self._allowed
        if cached is None or cached[0] != vocab or cached[1] != device:
            rows, bad = [], []
            keep = torch.zeros(len(self.allowed_rows), vocab, dtype=torch.bool)
            for i in self.allowed_rows:
                ids = params[i].allowed_token_ids
                if any(not 0 <= t < vocab for t in ids):
                    bad.append(i)
                    continue
                keep[len(rows), ids] = True
                rows.append(i)
            columns = ((column(rows, torch.long, device), keep[:len(rows)].to(device)) if rows else (None, None))
            cached = self._allowed = (vocab, device, *columns, bad)
        return cached[2:]

    def logit_bias(self, params: list[SamplingParams], vocab: int, device: torch.device) -> tuple:
        """The biased rows' entries as three flat columns, row [N] and id [N] int64 and bias [N] float32 (None
        when no row is left), and the rows whose ids reach beyond ``vocab`` (left out of the columns)."""
        cached = self._bias
        if cached is None or cached[0] != vocab or cached[1] != device:
            rows, ids, values, bad = [], [], [], []
            for i in self.bias_rows:
                bias = params[i].logit_bias
                if any(not 0 <= t < vocab for t in bias):
                    bad.append(i)
                    continue
                rows += [i] * len(bias)
                ids += bias.keys()
                values += bias.values()
            columns = ((column(rows, torch.long, device), column(ids, torch.long, device),
                        column(values, torch.float32, device)) if rows else (None, None, None))
            cached = self._bias = (vocab, device, *columns, bad)
        return cached[2:]

    def temperature(self, params: list[SamplingParams], device: torch.device) -> torch.Tensor:
        """The fused pass's temperature column, uploaded once (the pass only reads it)."""
        if self._temperature is None or self._temperature.device != device:
            self._temperature = column([0.0 if p.is_greedy else p.temperature for p in params], torch.float32,
                                       device)
        return self._temperature


def _fusable(p: SamplingParams) -> bool:
    """The fused pass does temperature or greedy only, and draws from its own stream: no seeded random row, no
    logit bias (``SamplingPlan`` checks that one for the batch)."""
    try:
        if p.has_penalties or p.top_k > 0 or p.top_p < 1 or p.min_p > 0:
            return False
    except TypeError:  # a value validation refuses, set behind its back: the torch path fails this row alone
        return False
    return p.is_greedy or p.seed is None


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], rows: list[int] | None = None) -> torch.Tensor:
    """In place, on ``rows`` (default: those with penalties); writes nothing when it raises.
    Repetition: HF semantics over prompt + output tokens (positive logits divided, negative multiplied).
    Presence/frequency: OpenAI semantics over output tokens, logit -= frequency * count + presence * (count > 0)."""
    if rows is None:
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
    # A penalty below float32's smallest normal (valid: > 0) would be 0 here: x / 0 and -inf * 0 (a masked id) are
    # inf and NaN, and a NaN row samples id 0 whatever its masks. Floored at it, and the quotient capped at the
    # largest float32, every logit stays a number and a masked one stays -inf.
    rep = column("repetition_penalty").clamp_(min=torch.finfo(logits.dtype).tiny)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x).clamp_(max=torch.finfo(logits.dtype).max)
    x -= column("frequency_penalty") * output_counts + column("presence_penalty") * (output_counts > 0)
    logits[rows] = x
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on [r, V] logits of non-greedy rows; returns probabilities [r, V]."""
    device = logits.device
    # capped: a huge logit (a penalty's quotient) over a small temperature is inf, and softmax of inf is NaN
    x = (logits / column([p.temperature for p in params], logits.dtype, device)[:, None]).clamp_(
        max=torch.finfo(logits.dtype).max)
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
    k = column([min(k, vocab) if k > 0 else vocab for k in top_k], torch.long, device)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])  # [r, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # 1 - p taken in float64 then rounded, as HF's python-float threshold is
    drop_below = column([1 - p for p in top_p], torch.float32, device)[:, None]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = (cum <= drop_below) & column([p < 1 for p in top_p], torch.bool, device)[:, None]
    remove[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = column(min_p, torch.float32, logits.device)[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
