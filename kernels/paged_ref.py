"""Torch reference for paged attention (prefill, extend, decode): gather each request's context by block table,
then dense causal attention in fp32. Slow and simple on purpose; the kernels' tests compare against it."""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D], block_table: [max_blocks] -> [length, Hkv, D]."""
    pos = torch.arange(length, device=cache.device)
    bs = cache.shape[1]
    return cache[block_table.long()[pos // bs], pos % bs]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, rows: list[int] | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> fp32 [T, Hq, D]; only the tokens of ``rows`` (default all requests) are computed,
    the others are left NaN. Query i of request r sits at context position seq_len - query_len + i."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for r in (range(len(lens)) if rows is None else rows):
        s, e, L = starts[r], starts[r + 1], lens[r]
        n = e - s
        k = gather_context(k_cache, block_tables[r], L).float().repeat_interleave(group, 1)  # [L, Hq, D]
        v = gather_context(v_cache, block_tables[r], L).float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale  # [Hq, n, L]
        allowed = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", p, v)
    return out
