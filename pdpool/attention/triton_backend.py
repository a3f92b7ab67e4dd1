"""The "triton" attention backend on the paged Triton kernels (``get_backend("triton")``).

A step's requests split by query length: query_len 1 goes to the split-KV decode kernel, longer queries (prefill,
extend, chunks) to the paged prefill kernel; a mixed step launches both into one output. The split is planned once
per step on the host lists (no device sync) and kept in ``meta.plan["triton"]`` for the other layers. The decode
split count depends on the number of decode rows only (not on context lengths), so a decode CUDA graph planned
for a batch bucket computes exactly what the eager step computes.

Decode rows are listed longest context first (``longest_first``), so the launch ends on its shortest programs
instead of idling most multiprocessors behind a long one that started late. The order moves work between
programs, never a value. A decode CUDA graph takes the order of each replay's batch (``prepare_replay``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdpool.attention.backend import AttentionBackend
from pdpool.attention.metadata import AttentionMetadata
from pdpool.kernels.decode_attention import (MIN_SPLIT_TOKENS, choose_num_splits, decode_workspace,
                                             num_multiprocessors, paged_decode)
from pdpool.kernels.prefill_attention import paged_prefill
from pdpool.kernels.store_kvcache import store_kvcache


@dataclass
class StepPlan:
    decode_rows: torch.Tensor | None  # [Rd] int32 request indices with query_len 1
    prefill_rows: torch.Tensor | None  # [Rp] int32 the others
    max_prefill_len: int
    num_splits: int
    workspace: tuple | None = None  # decode partials, shared by the layers of the step
    replay_seq_lens: list | None = None  # a graph bucket's plan: the lengths its decode_rows were last ordered by


ORDER_MIN_ROWS = 16  # smaller graph buckets keep their planned order: all their programs run in one wave


def longest_first(rows: list[int], seq_lens: list[int]) -> list[int]:
    """``rows`` ordered by context length, longest first (ties in row order)."""
    return sorted(rows, key=lambda r: -seq_lens[r])


def plan_step(meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> StepPlan:
    decode = longest_first([r for r, n in enumerate(meta.query_lens_cpu) if n == 1], meta.seq_lens_cpu)
    prefill = [r for r, n in enumerate(meta.query_lens_cpu) if n > 1]
    rows = lambda idx: _to_device(idx, device) if idx else None  # noqa: E731
    return StepPlan(decode_rows=rows(decode), prefill_rows=rows(prefill),
                    max_prefill_len=max((meta.query_lens_cpu[r] for r in prefill), default=0),
                    num_splits=choose_num_splits(len(decode), num_kv_heads, _num_sms(device)))


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """[len] int32 without a stream sync: through pinned memory on CUDA (the step may be queued behind the
    previous one, which a pageable copy would wait for)."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


_SMS: dict[torch.device, int] = {}


def _num_sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = num_multiprocessors(device)
    return _SMS[device]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def prepare_replay(self, graph_meta: AttentionMetadata, seq_lens_cpu: list[int]) -> None:
        """Before a decode graph replays for a batch of ``len(seq_lens_cpu)`` requests: its planned decode rows
        (every row of the bucket, padding included) in the batch's longest-first order. One pinned copy, queued."""
        plan = graph_meta.plan.get("triton")
        if plan is None or plan.decode_rows is None or plan.decode_rows.numel() < ORDER_MIN_ROWS:
            return
        last, plan.replay_seq_lens = plan.replay_seq_lens, seq_lens_cpu
        if last is not None and len(last) == len(seq_lens_cpu) and seq_lens_cpu == [n + 1 for n in last]:
            return  # every row one token longer: the same order (it depends on the lengths only), on the device
        bucket = plan.decode_rows.numel()
        order = longest_first(list(range(len(seq_lens_cpu))), seq_lens_cpu) + list(range(len(seq_lens_cpu), bucket))
        host = torch.tensor(order, dtype=torch.int32)
        plan.decode_rows.copy_(host.pin_memory() if plan.decode_rows.is_cuda else host, non_blocking=True)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale):
        # q: [T, Hq, D] -> [T, Hq, D]; tokens past query_start_loc[R] (padding) are left unwritten
        plan = meta.plan.get("triton")
        if plan is None:
            plan = meta.plan["triton"] = plan_step(meta, k_cache.shape[2], q.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.decode_rows is not None:
            if plan.workspace is None:
                plan.workspace = decode_workspace(plan.decode_rows.numel(), q.shape[1], k_cache.shape[2],
                                                  q.shape[2], plan.num_splits, q.device)
            paged_decode(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                         plan.decode_rows, scale, plan.num_splits, plan.workspace, MIN_SPLIT_TOKENS)
        if plan.prefill_rows is not None:
            paged_prefill(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                          plan.prefill_rows, plan.max_prefill_len, scale)
        return out
