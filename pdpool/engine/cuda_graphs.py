"""CUDA graphs of the model forward for pure-decode steps, one per batch-size bucket (nano-vllm's scheme).

A decode step of R requests (each query_len 1) replays the graph of the smallest bucket B >= R. The graph reads
its inputs from static buffers the runner fills before each replay; rows R..B-1 are padding::

    rows:         | 0 .. R-1: the step's requests | R .. B-1: padding                               |
    slot_mapping  | where each new K/V goes       | -1 (written nowhere)                            |
    seq_lens      | context after the step        | 1 (attend to one stale but finite cache entry)  |
    block_tables  | the requests' blocks          | stale rows of earlier steps (valid block ids)   |
    input_ids     | the last sampled tokens       | stale                                           |

query_start_loc is arange(B + 1) and never changes. Each bucket keeps one ``AttentionMetadata`` whose tensors are
slices of the static buffers; the backend plans on it once, during the eager warm-up before capture
(``meta.plan``), so the captured region has no host work: no syncs, no host-to-device copies, no data-dependent
shapes. The plan depends on the row count only (the triton backend's split-KV count follows the batch bucket, not
the context lengths), so one graph serves any length up to ``max_model_len`` and its attention reduces in the
eager step's order. Before each replay the backend may refresh what its plan holds on the device from the step's
host lists (``prepare_replay``: the triton backend's longest-first row order), never a shape or a split count. A batch that fills its bucket replays bit for bit what the eager step computes; a padded one
may still differ in the last bits where cuBLAS picks another GEMM kernel for the padded row count.

Only backends that declare ``decode_graph_safe`` (default: the triton backend) are captured; the torch backend
indexes with boolean masks and sizes its gathers from the host lengths, so it stays eager.
"""

from __future__ import annotations

import logging
import time

import torch

from pdpool.attention import AttentionBackend, AttentionMetadata, reset_context, set_context

log = logging.getLogger(__name__)

WARMUP_CONTEXT = 4096  # tokens per row in the capture warm-ups: a serving-like read, bounded for long max_model_len


def graph_safe(backend: AttentionBackend) -> bool:
    return bool(getattr(backend, "decode_graph_safe", backend.name == "triton"))


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, backend: AttentionBackend | None = None, num_blocks: int | None = None):
        self.model = model
        self.num_blocks = num_blocks  # of the KV cache: the warm-ups read distinct blocks of it
        # the backend's per-replay hook (the triton backend orders its decode rows by the batch's lengths)
        self.prepare_replay = getattr(backend, "prepare_replay", None)
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.block_size = block_size
        self.max_model_len = max_model_len
        B, W = self.max_batch, -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(B, **i64)
        self.positions = torch.zeros(B, **i64)
        self.slot_mapping = torch.full((B,), -1, **i64)
        self.seq_lens = torch.ones(B, **i32)
        self.block_tables = torch.zeros(B, W, **i32)
        self.query_start_loc = torch.arange(B + 1, **i32)
        self.metas: dict[int, AttentionMetadata] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.num_replays = 0
        self._dirty = 0  # rows >= this hold padding (slot -1, seq_len 1); rows below may hold a batch's values

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
                                 block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
                                 max_query_len=1, max_seq_len=self.max_model_len, query_lens_cpu=[1] * b,
                                 seq_lens_cpu=[self.max_model_len] * b, block_size=self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        if self.num_blocks:  # the warm-ups, where the kernels autotune, attend over full contexts of distinct
            B, W = self.block_tables.shape  # blocks as decode steps do, not over one token
            ids = torch.arange(B * W, device=self.block_tables.device) % self.num_blocks
            self.block_tables.copy_(ids.view(B, W))
            self.seq_lens.fill_(min(self.max_model_len, WARMUP_CONTEXT))
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            meta = self.metas[b] = self._meta(b)
            set_context(meta)
            try:
                self.model(self.input_ids[:b], self.positions[:b])  # warm-up: compiles, autotunes, plans
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[b] = self.model(self.input_ids[:b], self.positions[:b])
            finally:
                reset_context()
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        self.seq_lens.fill_(1)
        self._dirty = 0
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.graphs), self.buckets,
                 time.perf_counter() - t0)

    def fits(self, meta: AttentionMetadata) -> bool:
        return (meta.max_query_len == 1 and meta.num_requests <= self.max_batch
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """hidden [R, H] of a pure-decode step (R = meta.num_requests <= max_batch), by graph replay."""
        b = self.stage(input_ids, positions, meta)
        if self.prepare_replay is not None:
            self.prepare_replay(self.metas[b], meta.seq_lens_cpu)
        self.graphs[b].replay()
        self.num_replays += 1
        return self.outputs[b][:meta.num_requests]

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Fill the static buffers for a step of R rows (padding in rows R..B-1); returns its bucket B."""
        n = meta.num_requests
        b = next(size for size in self.buckets if size >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if self._dirty > n:  # rows an earlier, larger batch wrote: padding again (two launches saved otherwise)
            self.slot_mapping[n:self._dirty].fill_(-1)
            self.seq_lens[n:self._dirty].fill_(1)
        self._dirty = n
        return b
