"""The model runner: loads the model, owns the KV cache, runs one scheduled step.

``execute`` = pack (host) -> launch (one upload, forward, logits and the sampler, all queued; nothing waits for
the GPU) -> collect (waits for the sampled ids only). The engine may call them apart to overlap its host work
with the GPU (``LLMEngine``'s overlapped loop). A packed step may hold placeholder ids (< 0) for tokens sampled
by the step still running: when ``pack`` is given that step, each placeholder is gathered on the device from its
sampled ids (``PendingSample.token_ids``), so step N+1 is queued before the host has read step N's tokens;
without it, ``upload`` reads the ids again from the requests. ``compute_logits_for`` stops after the logits, so
tests can compare them with a reference. Only this file (and ``cuda_graphs``, its helper) creates device tensors.

On CUDA: the KV cache takes what ``--gpu-memory-utilization`` leaves after a profiling forward over a full token
budget; pure-decode steps replay CUDA graphs (``cuda_graphs.DecodeGraphs``) unless ``--enforce-eager`` or the
attention backend is not graph-safe. A step's host metadata goes to the device in one pinned copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdpool.attention import AttentionMetadata, pick_backend, reset_context, set_context
from pdpool.config import NodeConfig
from pdpool.engine.block_tables import BlockTableRows
from pdpool.engine.cuda_graphs import DecodeGraphs, graph_safe
from pdpool.engine.pinned import PinnedRing
from pdpool.engine.sampler import PendingSample, Sampler, make_generator
from pdpool.engine.sampling_ops import SamplingPlan
from pdpool.frontend import ModelFiles
from pdpool.kernels.cpu_features import default_cpu_dtype
from pdpool.models.demo import resolve_model
from pdpool.models.loader import load_hf_config, load_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelInfo:
    """What the rest of the engine needs to know about the model."""
    path: Path
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    dtype: torch.dtype


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None  # when the request asked for logprobs
    error: str | None = None  # this request's own sampling failed (its batch-mates' did not)
    rank: int | None = None  # in the vocabulary (1: the model's first choice), when some request asked for logprobs


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [R_s] int64, last token of each sampling request
    sampling: list  # ScheduledRequest of each sampling row, in scheduled order
    prompt_rows: list | None = None  # (request, offset in the step, first position, count): prompt logprobs


@dataclass
class PackedStep:
    """A step's inputs on the host, one int64 buffer::

        | ids T | positions T | slots T | samples S | gather_to G | gather_from G | starts R+1 | seq_lens R |
        | tables R*width |

    ``gather_to``/``gather_from``: token offsets whose id is a placeholder, and the row of the previous step's
    samples (``prev``) that holds it; the ids are gathered on the device at upload.
    """
    host: np.ndarray
    T: int
    R: int
    S: int
    G: int
    width: int
    query_lens: list[int]
    seq_lens: list[int]
    sampling: list  # ScheduledRequest of each sampling row
    holes: list  # (offset in host, request, token index): placeholders with no device source, read at upload
    prev: "LaunchedStep | None" = None  # the step whose samples fill gather_from
    ids_are_prev: bool = False  # every id is the previous step's sample of the same row: its samples are the ids
    pinned: torch.Tensor | None = None  # on CUDA: ``host``'s memory, a buffer of the runner's ``PinnedRing``
    slot: int = -1  # that buffer's slot in the ring
    prompt_rows: list | None = None  # rows whose prompt logprobs this step computes (``_prompt_rows``)


@dataclass
class LaunchedStep:
    inputs: StepInputs
    pending: PendingSample | None  # the sampled ids on the device; None when no row samples
    rows: dict  # request id -> its row in the samples (shared by the steps of one batch: read only)
    sampling_rows: "SamplingRows | None" = None


@dataclass
class SamplingRows:
    """One batch's sampling rows as the sampler takes them, kept while the batch keeps its rows."""
    requests: list
    params: list
    prompts: list
    outputs: list
    generators: list
    index: dict  # request id -> row
    matchers: list | None = None  # each row's grammar matcher (None for rows without one); None when no row has one
    plan: SamplingPlan | None = None


class ModelRunner:
    def __init__(self, node_config: NodeConfig):
        self.config = node_config
        dev = node_config.device
        self.device = torch.device(dev.device)
        if dev.num_threads:
            torch.set_num_threads(dev.num_threads)
        dtype_name = node_config.model.dtype
        if dtype_name == "auto":
            if self.device.type == "cuda":
                dtype_name = "bfloat16"
            else:  # bf16 only where the cores multiply it natively; elsewhere torch emulates it, slower than fp32
                dtype_name, reason = default_cpu_dtype()
                log.info("dtype auto on the CPU: %s (%s)", dtype_name, reason)
        self.dtype = DTYPES[dtype_name]
        self.dtype_name = dtype_name
        path = resolve_model(node_config.model.model)
        hf_config = load_hf_config(path)
        self.model = load_model(path, hf_config, dtype=self.dtype, device=self.device,
                                load_format=node_config.model.load_format, seed=node_config.model.seed)
        self.model_config = _model_info(path, hf_config, self.model, self.dtype)
        self.max_model_len = node_config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.block_size = node_config.cache.block_size
        info = self.model_config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.block_bytes = info.num_layers * 2 * self.block_size * info.num_kv_heads * info.head_dim * itemsize
        self.backend = pick_backend(dev.attention_backend, self.device)
        self.num_blocks = self._num_blocks()
        # kv_cache: [num_blocks, num_layers, 2, block_size, Hkv, D]; one block = one contiguous region
        self.kv_cache = torch.zeros(self.num_blocks, info.num_layers, 2, self.block_size, info.num_kv_heads,
                                    info.head_dim, dtype=self.dtype, device=self.device)
        self.model.bind_kv_cache(self.kv_cache, self.backend)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not dev.enforce_eager:
            if graph_safe(self.backend):
                longest = min(self.max_model_len, self.num_blocks * self.block_size)
                self.graphs = DecodeGraphs(self.model, node_config.scheduler.max_num_seqs, longest,
                                           self.block_size, self.device, self.backend, self.num_blocks)
                self.graphs.capture()
            else:
                log.warning("attention backend %s is not CUDA-graph safe; decode runs eagerly", self.backend.name)
        self.generators: dict[str, torch.Generator] = {}
        self.matchers: dict = {}  # request id -> its grammar's RowMatcher (pdpool.engine.structured)
        self._rows: SamplingRows | None = None  # the last launched step's sampling rows
        self.block_tables = BlockTableRows(node_config.scheduler.max_num_seqs)
        self._staging = PinnedRing() if self.device.type == "cuda" else None  # the packed steps' host buffers
        self.sampler = Sampler(eos_token_ids=info.eos_token_ids, seed=node_config.model.seed)
        if self.device.type == "cuda":  # compile the sampler's kernels now, not in the first request's step
            from pdpool.engine.sampling_params import SamplingParams

            warm = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
            # in the dtype the runner hands the sampler (the model's: see ``run``), so no step compiles it again
            self.sampler.sample(torch.randn(2, info.vocab_size, device=self.device, dtype=self.dtype), warm,
                                [[0], [0]], [[], []], [None, None])
        log.info("model %s (%s, %s) on %s: %d KV blocks of %d tokens, %d bytes each, attention %s, decode %s",
                 path, info.architecture, dtype_name, self.device, self.num_blocks, self.block_size,
                 self.block_bytes, self.backend.name, "CUDA graphs" if self.graphs else "eager")

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks:
            return cache.num_kv_blocks
        if self.device.type != "cuda":
            return max(1, int(cache.kv_cache_memory_gb * 2**30) // self.block_bytes)
        _, total = torch.cuda.mem_get_info(self.device)
        peak = self._profile_peak_bytes()
        budget = total * cache.gpu_memory_utilization - peak
        if budget < self.block_bytes:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB, utilization {cache.gpu_memory_utilization})")
        return int(budget // self.block_bytes)

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak GPU memory of a forward over a full token budget (weights + activations), with a scratch cache."""
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        info = self.model_config
        scratch = torch.zeros(blocks, info.num_layers, 2, self.block_size, info.num_kv_heads, info.head_dim,
                              dtype=self.dtype, device=self.device)
        self.model.bind_kv_cache(scratch, self.backend)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata.build([n], [n], [list(range(blocks))], self.block_size, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        set_context(meta)
        try:
            self.model.compute_logits(self.model(ids, torch.arange(n, device=self.device))[-1:])
        finally:
            reset_context()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        return peak

    def pack(self, scheduler_output, prev: LaunchedStep | None = None) -> PackedStep:
        """The step's tokens packed request after request, with their attention metadata (see attention.py).
        ``prev``: the step in flight, whose device samples fill this step's placeholder ids."""
        prev_rows = prev.rows if prev is not None and prev.pending is not None else {}
        scheduled = scheduler_output.scheduled
        width = max(1, max(len(sr.block_ids) for sr in scheduled))
        rows = self.block_tables.rows_for(scheduled)  # kept rows: only the ids that changed are written
        tables = self.block_tables.table[rows, :width]  # [R, max_blocks], padded with 0
        if all(sr.num_new_tokens == 1 for sr in scheduled):
            return self._pack_decode(scheduled, tables, prev, prev_rows)
        return self._pack_rows(scheduled, tables, prev, prev_rows)

    def _pack_rows(self, scheduled, tables: np.ndarray, prev: LaunchedStep | None, prev_rows: dict
                   ) -> PackedStep:
        """``pack`` of any step, request by request."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, sample_rows, sampling, holes = [], [], [], [], []
        gather_to, gather_from = [], []
        prompt_rows = None
        for r, sr in enumerate(scheduled):
            request = sr.request
            start, n = request.num_computed_tokens, sr.num_new_tokens
            tokens, blocks = request.all_token_ids, sr.block_ids
            if request.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                prompt_rows = _prompt_rows(prompt_rows, request, len(ids), start, n)
            ids += tokens[start:start + n]
            if tokens[start + n - 1] < 0:  # sampled by the step in flight: only ever a request's last token
                row = prev_rows.get(request.request_id)
                if row is None:
                    holes.append((len(ids) - 1, request, start + n - 1))
                else:
                    gather_to.append(len(ids) - 1)
                    gather_from.append(row)
                    ids[-1] = 0
            if n == 1:  # decode: skip numpy's per-call cost
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, start + n)
                positions += pos.tolist()
                slots += (tables[r, pos // bs] * bs + pos % bs).tolist()
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == len(tokens):
                sample_rows.append(len(ids) - 1)
                sampling.append(sr)
        T, R = len(ids), len(scheduled)
        starts = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        host, pinned, slot = self._host_buffer([np.asarray(ids + positions + slots + sample_rows + gather_to +
                                                           gather_from, dtype=np.int64), starts,
                                                np.asarray(seq_lens, dtype=np.int64), tables.ravel()])
        return PackedStep(host, T, R, len(sample_rows), len(gather_to), tables.shape[1], query_lens, seq_lens,
                          sampling, holes, prev if gather_to else None, pinned=pinned, slot=slot,
                          prompt_rows=prompt_rows)

    def _pack_decode(self, scheduled, tables: np.ndarray, prev: LaunchedStep | None, prev_rows: dict
                     ) -> PackedStep:
        """``pack`` of a step whose every row computes one token (the same buffer, column by column instead of
        request by request). Row r's token sits at offset r; its id is a placeholder when the step in flight
        samples it, gathered from that step's row of the same request."""
        bs, R = self.block_size, len(scheduled)
        requests = [sr.request for sr in scheduled]
        start_list = [r.num_computed_tokens for r in requests]
        starts = np.array(start_list, dtype=np.int64)  # [R] each row's position
        token_lists = [r.all_token_ids for r in requests]
        ids = np.array([t[s] for t, s in zip(token_lists, start_list)], dtype=np.int64)
        samples = np.flatnonzero(starts + 1 == np.array([len(t) for t in token_lists], dtype=np.int64))
        slots = tables[np.arange(R), starts // bs] * bs + starts % bs
        gather_to = np.flatnonzero(ids < 0)  # sampled by the step in flight
        holes, ids_are_prev = [], False
        if gather_to.size:
            kept = prev.sampling_rows if prev is not None and prev.pending is not None else None
            if kept is not None and gather_to.size == R and kept.requests == requests:
                gather_from, ids_are_prev = gather_to, True  # the same rows in the same order
            else:
                found = [prev_rows.get(requests[r].request_id) for r in gather_to.tolist()]
                holes = [(r, requests[r], start_list[r]) for r, row in zip(gather_to.tolist(), found) if row is None]
                gather_to = np.array([r for r, row in zip(gather_to.tolist(), found) if row is not None],
                                     dtype=np.int64)
                gather_from = np.array([row for row in found if row is not None], dtype=np.int64)
            ids[gather_to] = 0
        else:
            gather_from = gather_to
        G = len(gather_to)
        seq_lens = starts + 1
        host, pinned, slot = self._host_buffer([ids, starts, slots, samples, gather_to, gather_from,
                                                np.arange(R + 1, dtype=np.int64), seq_lens, tables.ravel()])
        sample_list = samples.tolist()
        prompt_rows = None
        if len(sample_list) != R:     # a row in its prompt (a one-token chunk): maybe one that wants logprobs
            for r in sorted(set(range(R)) - set(sample_list)):
                request = requests[r]
                if request.prompt_logprobs is not None and start_list[r] < request.num_prompt_tokens - 1:
                    prompt_rows = _prompt_rows(prompt_rows, request, r, start_list[r], 1)
        return PackedStep(host, R, R, len(sample_list), G, tables.shape[1], [1] * R, seq_lens.tolist(),
                          [scheduled[r] for r in sample_list], holes, prev if G else None, ids_are_prev, pinned,
                          slot, prompt_rows)

    def _host_buffer(self, parts: list) -> tuple[np.ndarray, torch.Tensor | None, int]:
        """The packed step's one int64 buffer: on CUDA written straight into a pinned buffer of the ring (copied
        from there at upload, no per-step pinning), else a numpy array."""
        if self._staging is None:
            return np.concatenate(parts), None, -1
        return self._staging.concatenate(parts)

    def upload(self, packed: PackedStep) -> StepInputs:
        """One pinned host-to-device copy of the packed step; placeholder ids gathered on the device from the
        previous step's samples (or, without them, filled from the requests first)."""
        host = packed.host
        for offset, request, index in packed.holes:
            host[offset] = request.all_token_ids[index]
        if packed.holes:
            assert host[:packed.T].min() >= 0, "a placeholder id was not filled before upload"
        T, R, S, G, width = packed.T, packed.R, packed.S, packed.G, packed.width
        if packed.pinned is not None:  # host is this pinned buffer's memory
            dev = packed.pinned.to(self.device, non_blocking=True)
            self._staging.copied(packed.slot)
        else:
            tensor = torch.from_numpy(host)
            dev = tensor.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else tensor
        at = 3 * T + S + 2 * G
        small = dev[at:].to(torch.int32)  # starts, seq_lens, tables
        input_ids = dev[:T]
        if packed.ids_are_prev:  # the gather below would copy them in order: read them where they are
            input_ids = packed.prev.pending.token_ids
        elif G:
            to, frm = dev[3 * T + S:3 * T + S + G], dev[3 * T + S + G:at]
            input_ids = input_ids.clone() if self.device.type != "cuda" else input_ids  # the CPU view is `host`
            input_ids.index_copy_(0, to, packed.prev.pending.token_ids.index_select(0, frm))
        meta = AttentionMetadata(query_start_loc=small[:R + 1], seq_lens=small[R + 1:2 * R + 1],
                                 block_tables=small[2 * R + 1:].view(R, width), slot_mapping=dev[2 * T:3 * T],
                                 max_query_len=max(packed.query_lens), max_seq_len=max(packed.seq_lens),
                                 query_lens_cpu=packed.query_lens, seq_lens_cpu=packed.seq_lens,
                                 block_size=self.block_size)
        return StepInputs(input_ids, dev[T:2 * T], meta, dev[3 * T:3 * T + S], packed.sampling, packed.prompt_rows)

    def prepare_inputs(self, scheduler_output) -> StepInputs:
        return self.upload(self.pack(scheduler_output))

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Forward the step (writing its KV) -> logits [R_s, V] of the sampling requests: float32, or on CUDA in
        the model dtype (the sampler reads them as float32; a float32 copy of [R_s, V] was one more kernel)."""
        float32 = self.device.type != "cuda"
        if self.graphs is not None and self.graphs.fits(inputs.meta):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)  # [R, H], R = T
        else:
            set_context(inputs.meta)
            try:
                hidden = self.model(inputs.input_ids, inputs.positions)  # [T, H]
            finally:
                reset_context()
        # On CUDA, when every token samples (each row one token, all sampling: a steady decode step), they are the
        # rows in order (sample offsets are increasing and distinct, so S == T means arange(T)): no gather. The CPU
        # path keeps its gathered copy (one A/B there had the run 0.7 ms/step slower without it; not settled).
        if inputs.prompt_rows:
            self._prompt_logprobs(hidden, inputs.prompt_rows)
        if float32 or inputs.sample_indices.shape[0] != hidden.shape[0]:
            hidden = hidden[inputs.sample_indices]
        return self.model.compute_logits(hidden, float32=float32)

    PROMPT_LOGPROBS_SLICE = 256   # positions per logits slice: [256, V] float32 is 50 MB at a 49k vocab

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list) -> None:
        """The prompt logprobs of this step's ``rows``, into each request's ``prompt_logprobs``: position p's
        logits (float32, log-softmaxed: the model's own distribution, before any sampling parameter) give token
        p + 1's logprob and, with ``prompt_logprobs`` N > 0, the N best. Only requests that ask pay: the logits of
        every such position, a slice at a time, read back at once (the step waits for it). Each entry is (token id,
        logprob, top N or None, rank of the token in the vocabulary, 1 for the model's first choice)."""
        for request, offset, start, count in rows:
            top_n = request.sampling_params.prompt_logprobs
            tokens = request.prompt_token_ids
            for first in range(0, count, self.PROMPT_LOGPROBS_SLICE):
                m = min(self.PROMPT_LOGPROBS_SLICE, count - first)
                logp = torch.log_softmax(self.model.compute_logits(
                    hidden[offset + first:offset + first + m], float32=True), dim=-1)
                at = start + first + 1            # the first predicted token
                targets = torch.tensor(tokens[at:at + m], dtype=torch.long, device=logp.device)
                chosen_t = logp.gather(1, targets[:, None])
                ranks = ((logp > chosen_t).sum(-1) + 1).tolist()   # 1: the model's first choice
                chosen = chosen_t[:, 0].tolist()
                if top_n:
                    values, ids = logp.topk(top_n, dim=-1)
                    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
                else:
                    tops = [None] * m
                for j in range(m):
                    request.prompt_logprobs[at + j] = (tokens[at + j], chosen[j], tops[j], ranks[j])

    def compute_logits_for(self, scheduler_output) -> torch.Tensor:
        """Logits [R_s, V] float32, one row per sampling request in scheduled order; the step's KV is written."""
        return self.run(self.prepare_inputs(scheduler_output)).float()

    def execute(self, scheduler_output) -> dict[str, SampledToken]:
        if not scheduler_output.scheduled:
            return {}
        return self.collect(self.launch(self.pack(scheduler_output)))

    def launch(self, packed: PackedStep) -> LaunchedStep:
        """Upload, forward, logits and the sampler, queued on the device; returns without waiting for it. The
        sampler reads the requests' params now, and their token lists where a row has penalties or unmet
        ``min_tokens`` (the engine launches such a step only once those lists hold real ids)."""
        inputs = self.upload(packed)
        logits = self.run(inputs)
        if not inputs.sampling:
            return LaunchedStep(inputs, None, {})
        rows = self._sampling_rows([sr.request for sr in inputs.sampling])
        # The sampler reads the token lists (penalties, min_tokens) and does not keep them: no copies.
        pending = self.sampler.sample_async(logits, rows.params, rows.prompts, rows.outputs, rows.generators,
                                            rows.plan, rows.matchers)
        return LaunchedStep(inputs, pending, rows.index, rows)

    def _sampling_rows(self, requests: list) -> "SamplingRows":
        """The sampler's per-row lists of these requests: the last step's, when its sampling rows were the same
        requests in the same order (a request's lists are its own, appended to in place; its params and
        generator do not change), else built anew. So a steady decode batch pays one list compare per step
        instead of five per-row passes and the sampler's plan."""
        kept = self._rows
        if kept is not None and kept.requests == requests:  # identity per element: Request has no __eq__
            return kept
        self._rows = SamplingRows(requests, [r.sampling_params for r in requests],
                                  [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
                                  [self._generator(r) for r in requests],
                                  {r.request_id: i for i, r in enumerate(requests)})
        self._rows.plan = SamplingPlan(self._rows.params)
        if self._rows.plan.grammar_rows:
            self._rows.matchers = [self._matcher(r) for r in requests]
        return self._rows

    def wait(self, step: LaunchedStep) -> None:
        """Until the step's sampled ids are on the host (not for any step queued after it)."""
        if step.pending is not None:
            step.pending.wait()

    def collect(self, step: LaunchedStep) -> dict[str, SampledToken]:
        """The sampled token of each sampling request (waits for the step's samples)."""
        if step.pending is None:
            return {}
        self.wait(step)
        out = step.pending.result()
        nones = [None] * len(out.token_ids)
        tops, ranks = out.top_logprobs or nones, out.ranks or nones
        failed = out.failed
        return {rid: SampledToken(token, logprob, top, failed.get(i) if failed else None, rank)
                for (rid, i), token, logprob, top, rank in zip(step.rows.items(), out.token_ids, out.logprobs, tops,
                                                               ranks)}

    sample = collect  # the name before the split

    def _generator(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = self.generators[request.request_id] = make_generator(seed, self.device)
            if request.output_token_ids and not request.sampling_params.is_greedy:
                # Tokens sampled elsewhere (a prefill node's first token) took the generator's first draws: skip
                # them, so the request's tokens are those of one node. One draw: one Exp(1) per vocab entry in
                # float32 (the sampler's ``_exponentials``).
                skipped = torch.empty(self.model_config.vocab_size, dtype=torch.float32, device=self.device)
                for _ in request.output_token_ids:
                    skipped.exponential_(generator=gen)
        return gen

    def _matcher(self, request):
        """The request's grammar matcher (structured output), made on its first sampling step and kept until it
        finishes: it has consumed the request's output so far."""
        grammar = request.sampling_params.grammar
        if grammar is None:
            return None
        matcher = self.matchers.get(request.request_id)
        if matcher is None:
            matcher = self.matchers[request.request_id] = grammar.matcher()
        return matcher

    def forget(self, request_id: str) -> None:
        """Drop per-request state (the seeded generator, the grammar matcher) of a finished or aborted request."""
        self.generators.pop(request_id, None)
        self.matchers.pop(request_id, None)
        if self._rows is not None and request_id in self._rows.index:  # no kept rows hold a finished request
            self._rows = None


def _prompt_rows(rows: list | None, request, offset: int, start: int, n: int) -> list:
    """``rows`` plus this request's chunk: positions ``start``.. at ``offset`` of the step, up to the one before
    the prompt's last token (whose logits predict the first output token, which the sampler takes)."""
    count = min(n, request.num_prompt_tokens - 1 - start)
    return (rows or []) + [(request, offset, start, count)]


def _model_info(path: Path, hf_config, model, dtype: torch.dtype) -> ModelInfo:
    attn = model.model.layers[0].self_attn
    eos = list(ModelFiles.read(path).eos_token_ids)
    max_positions = getattr(hf_config, "max_position_embeddings", 4096)
    window = _sliding_window(hf_config, model.arch)
    if window is not None and window < max_positions:
        log.warning("%s: sliding-window attention (%d) is not implemented; serving up to %d positions, where "
                    "full attention is exact", path, window, window)
        max_positions = window
    return ModelInfo(path=path, architecture=model.arch, num_layers=len(model.model.layers),
                     num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                     hidden_size=hf_config.hidden_size, vocab_size=hf_config.vocab_size,
                     max_position_embeddings=max_positions, eos_token_ids=eos,
                     dtype=dtype)


def _sliding_window(hf_config, arch: str) -> int | None:
    """The attention window where the config turns one on (Mistral always, Qwen only with use_sliding_window)."""
    window = getattr(hf_config, "sliding_window", None)
    if arch.startswith("Qwen") and not getattr(hf_config, "use_sliding_window", False):
        return None
    return window or None
