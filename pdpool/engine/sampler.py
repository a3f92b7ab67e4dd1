"""Batched sampling: logit bias, penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

Order (vLLM v1's sampler): min-tokens stop masking, ``allowed_token_ids`` (every other id masked), ``bad_words``
(the next token of a banned word masked), a grammar's mask (structured output: ``pdpool.engine.structured``),
``logit_bias`` (its non-argmax-invariant logits processors, applied before penalties), repetition penalty,
presence/frequency penalties, then (random rows only) temperature, top-k, top-p, min-p, and the draw. Greedy rows
take the argmax of the masked, biased, penalized logits.

Logprobs (sampled token and top-n) come from the raw model logits, log_softmax before any processing (bias
included): vLLM's default `raw_logprobs`, so a token's reported logprob does not depend on the request's sampling
settings.

One request's failure is its own. ``SamplingParams.validate`` keeps bad values out, but should a request's own work
still raise (its stop-token masking, its penalties, its top-k/top-p/min-p, its seeded generator), that row fails
alone: ``SamplerOutput.failed`` maps its row to the error message, its ``token_ids`` entry is -1 and its logprobs
NaN, and every other row is sampled as if it had not been in the batch (a seeded row draws from its own generator
only, so its tokens do not change). The caller finishes the failed requests with an error and keeps the others.
The batched ops run inside one ``try``; only after one of them raises are they repeated row by row to find the
failing rows, so a step where nothing fails pays no per-request Python for it. Token ids given to the sampler
(stop ids, prompt and output ids) must be below V: the masking checks its ids first, because an out-of-range index
is a device-side assert on CUDA that no ``try`` can catch.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pdpool.engine import structured
from pdpool.engine.pinned import PinnedPool
from pdpool.engine.sampling_ops import SamplingPlan, apply_penalties, column, filtered_probs
from pdpool.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, SamplingParamsError


class RequestFault(str):
    """Why a row failed, when the cause is the request's own parameters rather than the engine: its masks
    (``min_tokens``, ``allowed_token_ids``, ``bad_words``, a grammar) left nothing to sample, or its grammar broke
    down (a regex too large for llguidance's lexer shows only as it is built, token by token). The server answers
    it as a 400 naming ``param``, not a 500."""

    param: str | None

    def __new__(cls, message: str, param: str | None = None) -> "RequestFault":
        fault = super().__new__(cls, message)
        fault.param = param
        return fault


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row; -1 for a failed row
    logprobs: list[float]  # of each sampled token; NaN for every row when no request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # None when no request asked; [] for those that did not
    # each sampled token's rank in the vocabulary (vLLM's: how many ids have a logprob at least its own, so 1 is
    # the model's first choice); None when no request asked for logprobs, and for a failed row
    ranks: list[int | None] | None = None
    failed: dict[int, str] = field(default_factory=dict)  # row -> why that request failed; {} when none did


class PendingSample:
    """A step's samples on the device, queued and not waited for (``Sampler.sample_async``).

    ``token_ids`` [R] int64 stays on the device: the next step gathers its input ids from it. A failed row holds
    0 there (a valid id, so a gather never indexes out of range) and -1 in ``result()``. On CUDA the host copies
    (tokens, and logprobs when asked) are queued at once into pinned buffers behind an event; ``result()`` waits
    for that event only, never for work queued after it."""

    def __init__(self, token_ids: torch.Tensor, logprob_parts: tuple | None, top_n: list[int] | None,
                 failed: dict[int, str], pool: "PinnedPool | None" = None):
        """``pool``: where the pinned host buffers come from and go back to once ``result()`` read them."""
        self.token_ids = token_ids
        self.failed = failed
        self._top_n = top_n
        parts = (token_ids,) + (logprob_parts or ())
        self._pool, self._pooled = None, None
        if token_ids.device.type == "cuda":
            if pool is not None:
                key, self._host, self._ready = pool.take(parts)
                self._pool, self._pooled = pool, (key, self._host, self._ready)
                for host, t in zip(self._host, parts):
                    host.copy_(t, non_blocking=True)
            else:
                self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                   for t in parts)
                self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = parts, None

    def wait(self) -> None:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None

    def result(self) -> SamplerOutput:
        """The samples on the host (waits for their copy). Read once: the pinned buffers then go back to the pool,
        and a second call returns the same output."""
        if self._pooled is None and self._pool is not None:
            return self._out
        self.wait()
        out = self._read()
        if self._pool is not None:
            self._pool.give_back(*self._pooled)
            self._pooled, self._host, self._out = None, None, out
        return out

    def _read(self) -> SamplerOutput:
        token_ids = self._host[0].tolist()
        if len(self._host) == 1:  # a full pass over [R, V] saved: nobody asked for logprobs
            out = SamplerOutput(token_ids, [float("nan")] * len(token_ids), None)
        else:
            sampled_logprobs, ranks = self._host[1].tolist(), self._host[2].tolist()
            top_logprobs = None
            if len(self._host) == 5:
                values, indices = self._host[3].tolist(), self._host[4].tolist()
                top_logprobs = [list(zip(indices[i][:n], values[i][:n])) for i, n in enumerate(self._top_n)]
            out = SamplerOutput(token_ids, sampled_logprobs, top_logprobs, ranks=ranks)
        if self.failed:
            out.failed = dict(self.failed)
            for row in self.failed:
                out.token_ids[row] = -1
                out.logprobs[row] = float("nan")
                if out.ranks is not None:
                    out.ranks[row] = None
                if out.top_logprobs is not None:
                    out.top_logprobs[row] = []
        return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request; ``SamplingParamsError`` for a seed outside ``[SEED_MIN, SEED_MAX]``."""
    if seed is not None and not (isinstance(seed, int) and SEED_MIN <= seed <= SEED_MAX):
        raise SamplingParamsError("seed", f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {seed!r}")
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _reason(exc: BaseException) -> str:
    return f"sampling failed: {type(exc).__name__}: {exc}"


def _isolated(run: Callable[[list[int]], object], rows: list[int], failed: dict[int, str]) -> list:
    """``[run(rows)]``; if that raises, ``run([row])`` for each row: the rows that raise go into ``failed``, the
    results of the others come back in row order (``run`` must leave nothing half done when it raises)."""
    try:
        return [run(rows)]
    except Exception:  # noqa: BLE001 - some row failed: find which, below
        pass
    results = []
    for row in rows:
        try:
            results.append(run([row]))
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            failed[row] = _reason(exc)
    return results


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] | int | None = (), seed: int | None = None):
        # Every EOS id is masked, with stop_token_ids, until min_tokens are out.
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or ())
        self.seed = seed
        self._shared: torch.Generator | None = None  # for unseeded requests, made on the logits' device
        # On CUDA, a batch of greedy or plain-temperature rows without seeds takes one fused pass
        # (``pdpool.kernels.sample``); PDPOOL_FUSED_SAMPLER=0 keeps the torch path.
        self.fused = os.environ.get("PDPOOL_FUSED_SAMPLER", "1") != "0"
        self._seeds = random.Random(seed)  # one Philox seed per fused call
        self._pinned = PinnedPool()  # the samples' host buffers on CUDA, reused once read

    def sample(
        self,
        logits: torch.Tensor,  # [R, V] float32 (or the model dtype; read as float32), left untouched
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        """One token per row. A row whose own work raises is reported in ``failed`` (see the module docstring)."""
        return self.sample_async(logits, params, prompt_token_ids, output_token_ids, generators).result()

    def sample_async(self, logits, params, prompt_token_ids, output_token_ids, generators,
                     plan: "SamplingPlan | None" = None, matchers: list | None = None) -> PendingSample:
        """``sample`` without waiting: queues the device work (no host sync on the common path: random or greedy
        rows, seeded or not, logprobs) and returns the samples on the device. Rows with penalties or unmet
        ``min_tokens`` read the token lists now, so the caller passes real ids for them. ``plan``: a
        ``SamplingPlan`` of these same ``params`` that the caller keeps while its batch keeps its rows. ``matchers``:
        each row's ``RowMatcher`` (None for rows without a grammar), kept by the caller across steps; without them a
        grammar row's matcher is made anew and reads the row's whole output."""
        failed: dict[int, str] = {}
        raw = logits  # on CUDA in the model dtype: the fused pass reads it as it is, without a float32 copy
        device = logits.device
        rows_all = len(params)
        if plan is None:
            plan = SamplingPlan(params)
        processed = self._mask_min_tokens(raw, params, output_token_ids, failed, plan.min_token_rows)
        # On the CPU a batch with random rows takes the native pass (``kernels/cpu_ops.py``: the torch path's
        # exponentials alone were 8.5 of its 12 ms at 8 x 49152); a greedy-only batch keeps torch.argmax.
        on_cpu = device.type == "cpu" and not all(p.is_greedy for p in params)
        if on_cpu:
            from pdpool.kernels import cpu_ops

            on_cpu = cpu_ops.sampler_available()  # the extension loaded (else the torch path)
        if self.fused and (device.type == "cuda" or on_cpu) and processed is raw and not failed and plan.fusable:
            if on_cpu:
                from pdpool.kernels.cpu_ops import gumbel_argmax
            else:
                from pdpool.kernels.sample import gumbel_argmax

            token_ids = gumbel_argmax(raw, plan.temperature(params, device), self._seeds.getrandbits(31))
            logprob_parts, top_n = None, None
            if plan.any_logprobs:
                logprob_parts, top_n = self._logprobs(raw.float(), params, token_ids)
            return PendingSample(token_ids, logprob_parts, top_n, failed, self._pinned)
        logits = raw.float()  # every other path works in float32 (exact from bf16/fp16), as before
        processed = logits if processed is raw else processed.float()
        if plan.allowed_rows:
            processed = processed.clone() if processed is logits else processed
            self._mask_disallowed(processed, params, plan, failed)
        if plan.bad_word_rows:
            processed = processed.clone() if processed is logits else processed
            self._mask_bad_words(processed, params, output_token_ids, plan.bad_word_rows, failed)
        if plan.grammar_rows:
            processed = processed.clone() if processed is logits else processed
            if matchers is None:
                matchers = [p.grammar.matcher() if p.grammar is not None else None for p in params]
            structured.mask_rows(processed, [i for i in plan.grammar_rows if i not in failed], matchers,
                                 output_token_ids, failed, params)
        if plan.masked_rows:
            _fail_rows_left_empty(processed, params, plan.masked_rows, failed)
        if plan.bias_rows:
            processed = processed.clone() if processed is logits else processed
            self._add_logit_bias(processed, params, plan, failed)
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            processed = processed.clone() if processed is logits else processed
            _isolated(lambda rows: apply_penalties(processed, params, prompt_token_ids, output_token_ids, rows),
                      [i for i in penalized if i not in failed] if failed else penalized, failed)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if failed:
            random_rows = [i for i in random_rows if i not in failed]
        all_random = len(random_rows) == rows_all
        token_ids = None if all_random else processed.argmax(dim=-1)  # [R]
        if random_rows:
            every = (lambda rows: len(rows) == rows_all)  # noqa: E731 - whole batch: no gather, no list index
            chunks = _isolated(lambda rows: (rows, filtered_probs(processed if every(rows) else
                                                                  processed[column(rows, torch.long, device)],
                                                                  [params[i] for i in rows])),
                               random_rows, failed)
            if len(chunks) == 1:
                random_rows, probs = chunks[0]
            else:  # row by row after a failure: the rows that passed
                random_rows = [i for rows, _ in chunks for i in rows]
                probs = torch.cat([p for _, p in chunks]) if chunks else None
            if random_rows:
                q = self._exponentials(probs, [generators[i] for i in random_rows], random_rows, failed)
                drawn = (probs / q).argmax(dim=-1)  # exponential race = sampling from probs
                if len(random_rows) == rows_all:
                    token_ids = drawn
                else:
                    if token_ids is None:
                        token_ids = processed.argmax(dim=-1)
                    token_ids[column(random_rows, torch.long, device)] = drawn
        if token_ids is None:  # every row random and some failed while filtering
            token_ids = processed.argmax(dim=-1)
        if failed:
            token_ids[column(sorted(failed), torch.long, device)] = 0
        logprob_parts, top_n = None, None
        if plan.any_logprobs:
            logprob_parts, top_n = self._logprobs(logits, params, token_ids)
        return PendingSample(token_ids, logprob_parts, top_n, failed, self._pinned)

    @staticmethod
    def _mask_disallowed(processed: torch.Tensor, params: list[SamplingParams], plan: SamplingPlan,
                         failed: dict[int, str]) -> None:
        """In place on [R, V] float32: ``allowed_token_ids``' rows keep only those ids' logits (the others -inf; the
        mask built once per plan). A row whose ids reach beyond V fails alone."""
        rows, keep, bad = plan.allowed_mask(params, processed.shape[1], processed.device)
        for i in bad:
            failed.setdefault(i, _outside("allowed_token_ids", processed.shape[1]))
        if rows is not None:
            processed[rows] = processed[rows].masked_fill(~keep, float("-inf"))

    @staticmethod
    def _mask_bad_words(processed: torch.Tensor, params: list[SamplingParams], output_token_ids: list[list[int]],
                        rows: list[int], failed: dict[int, str]) -> None:
        """vLLM's ``bad_words``, in place on [R, V] float32: a one-token word is never sampled; a longer one's last
        token is not, right after the output ends with its other tokens. One index_put over the batch's bans."""
        vocab = processed.shape[1]
        at_rows, at_ids = [], []
        for i in rows:
            out = output_token_ids[i]
            banned = [w[-1] for w in params[i].bad_words_token_ids
                      if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])]
            if any(not 0 <= t < vocab for t in banned):
                failed.setdefault(i, _outside("bad_words", vocab))
                continue
            at_rows += [i] * len(banned)
            at_ids += banned
        if not at_rows:
            return
        device = processed.device
        processed.index_put_((column(at_rows, torch.long, device), column(at_ids, torch.long, device)),
                             torch.tensor(float("-inf"), device=device))

    @staticmethod
    def _add_logit_bias(processed: torch.Tensor, params: list[SamplingParams], plan: SamplingPlan,
                        failed: dict[int, str]) -> None:
        """In place on [R, V] float32: each biased row's bias at its ids (one scatter-add over the batch, its
        columns uploaded once per plan). A row with an id beyond V fails alone (on CUDA it would be a device
        assert: checked on the host, once per plan and vocab size)."""
        rows, ids, values, bad = plan.logit_bias(params, processed.shape[1], processed.device)
        for i in bad:
            failed.setdefault(i, _outside("logit_bias", processed.shape[1]))
        if rows is not None:
            processed.index_put_((rows, ids), values, accumulate=True)

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor):
        """Raw logprobs on the device: the sampled token's [R], its rank [R] (vLLM's: the ids whose logit is at
        least its own, itself included), and the top-n values and ids [R, max_n]."""
        lse = torch.logsumexp(logits, dim=-1)  # [R], raw logprob normalizer
        sampled_logit = logits.gather(1, token_ids[:, None])  # [R, 1]
        ranks = (logits >= sampled_logit).sum(-1)  # [R] int64
        sampled = sampled_logit[:, 0] - lse
        max_n = min(max((p.logprobs or 0) for p in params), logits.shape[1])
        top_n = [min(p.logprobs or 0, max_n) for p in params]
        if not max_n:
            return (sampled, ranks), None
        values, indices = logits.topk(max_n, dim=-1)  # [R, max_n]
        return (sampled, ranks, values - lse[:, None], indices), top_n

    def _mask_min_tokens(self, logits, params, output_token_ids, failed: dict[int, str],
                         rows: list[int]) -> torch.Tensor:
        """``rows``: those whose ``min_tokens`` is above 0 (no other row can be short of it)."""
        masked = logits
        vocab = logits.shape[1]
        for i in rows:
            p = params[i]
            if len(output_token_ids[i]) >= p.min_tokens:
                continue
            stop_ids = list(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids += self.eos_token_ids
            if stop_ids:
                try:
                    bad = [t for t in stop_ids if not 0 <= t < vocab]  # checked here: on CUDA it would be a
                    if bad:                                              # device assert, fatal to the process
                        raise IndexError(f"stop token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
                    masked = logits.clone() if masked is logits else masked
                    masked[i, stop_ids] = float("-inf")
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed[i] = _reason(exc)
        return masked

    def _exponentials(self, probs: torch.Tensor, generators: list[torch.Generator | None], rows: list[int],
                      failed: dict[int, str]) -> torch.Tensor:
        # One Exp(1) draw per vocab entry; a seeded row draws only from its own generator, so its tokens do not
        # depend on the rest of the batch. A seeded row whose generator fails goes into `failed` (by `rows`).
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            if self._shared is None or self._shared.device != probs.device:
                self._shared = make_generator(self.seed, probs.device)
            if len(unseeded) == len(generators):  # the same draws as below, without a list index
                q.exponential_(generator=self._shared)
            else:
                q[column(unseeded, torch.long, probs.device)] = torch.empty(
                    len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=self._shared)
        for i, g in enumerate(generators):
            if g is not None:
                try:
                    q[i].exponential_(generator=g)
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed[rows[i]] = _reason(exc)
                    q[i] = 1.0
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _outside(name: str, vocab: int) -> str:
    """Why a row whose ``name`` ids reach beyond the logits fails (on CUDA they would be a device assert)."""
    return _reason(IndexError(f"{name} token ids are outside the vocabulary [0, {vocab})"))


def _fail_rows_left_empty(processed: torch.Tensor, params: list[SamplingParams], rows: list[int],
                          failed: dict[int, str]) -> None:
    """``rows`` (those with ``allowed_token_ids``, ``bad_words`` or a grammar) whose every logit is now -inf fail
    alone: the masks of ``min_tokens``, ``allowed_token_ids``, ``bad_words`` and the grammar together left nothing
    to sample. One host sync, only for batches with such rows."""
    empty = torch.isneginf(processed[column(rows, torch.long, processed.device)]).all(dim=-1).tolist()
    for i, gone in zip(rows, empty):
        if gone:
            p = params[i]
            param = (structured.param_of(p) if getattr(p, "grammar", None) is not None
                     else "allowed_token_ids" if getattr(p, "allowed_token_ids", None) else "bad_words")
            failed.setdefault(i, RequestFault("no token is left to sample: min_tokens' stop masking, "
                                              "allowed_token_ids, bad_words and the structured output's grammar "
                                              "together mask every id", param))
