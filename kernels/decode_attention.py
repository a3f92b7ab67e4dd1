"""Paged decode (one query token per request) with split-KV (flash-decoding) and GQA head packing, in one launch.

Grid (Hkv, decode rows, num_splits): one program takes all GROUP = Hq / Hkv query heads of one KV head, so each
K/V tile is read once for the whole group, and attends over its split of the context::

    context of request r:  | split 0 | split 1 | ... | split used-1 | (empty splits up to S-1)
    split_len = max(cdiv(cdiv(seq_len, S), BLOCK_N) * BLOCK_N, min_split_len);  used = cdiv(seq_len, split_len)

A row whose context fits one split (used == 1) writes out[token, head] at once. Otherwise every non-empty split
writes its partial result, part_o [rows, Hq, S, D] fp32 (normalized) and part_lse [rows, Hq, S] fp32 (log2
domain), then counts itself in counts[row, kv head]; the split that arrives last combines the ``used`` partials
by their log-sum-exp, in split order, into out[token, head] and sets the count back to 0 for the next launch.
Empty splits exit at once. Which program combines changes nothing in the result: it reads every partial back
from memory, in the same order.

S comes from the number of decode rows alone (``choose_num_splits``), never from the context lengths: a row's
result then depends only on its own context, so a CUDA graph captured for a batch bucket and the eager step it
replaces reduce in the same order (bit-identical). The order of ``rows`` only moves work between programs:
the backend lists the longest contexts first, so the shortest programs end the launch (less idle tail).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import STEP_POINTERS, check_attention_args, configs, dot_precision

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 64


@triton.autotune(configs=configs([  # tuned apart for one split (large batches) and several (small batches)
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=5),
    triton.Config({"BLOCK_N": 32}, num_warps=2, num_stages=6),
    triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=8),
], interpreter=triton.Config({"BLOCK_N": 16})), key=["HEAD_DIM", "GROUP", "BLOCK_SIZE", "SINGLE"])
@triton.jit(do_not_specialize=["num_splits", "stride_bt"], do_not_specialize_on_alignment=STEP_POINTERS)
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, rows_ptr,
                   part_o_ptr, part_lse_ptr, counts_ptr, out_ptr, scale_log2, num_splits, min_split_len,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                   SINGLE: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                   GROUP_R: tl.constexpr, SPLITS_P2: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.program_id(2)
    num_kv_heads = tl.num_programs(0)
    r = tl.load(rows_ptr + i)
    tok = tl.load(query_start_ptr + r).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split_len)
    used = tl.cdiv(seq_len, split_len)
    start = s * split_len
    if start >= seq_len:  # an empty split (never split 0)
        return
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok * stride_qt + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)  # [GROUP_P2, D]
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    table = block_tables_ptr + r.to(tl.int64) * stride_bt
    head = h * stride_ch
    for n0 in range(start, end, BLOCK_N):  # every tile holds at least one context token
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        blk = tl.load(table + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_off = blk[:, None] * stride_cb + (offs_n % BLOCK_SIZE)[:, None] * stride_ct + head + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_P2, BLOCK_N]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    hq = h * GROUP + g
    if SINGLE:
        tl.store(out_ptr + tok * stride_ot + hq[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=(g < GROUP)[:, None])
        return
    if used == 1:  # the whole context in this split: the result is final, nothing to combine
        tl.store(out_ptr + tok * stride_ot + hq[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=(g < GROUP)[:, None])
        return
    base = (i.to(tl.int64) * num_kv_heads + h) * GROUP  # first of this program's rows in part_lse [rows, Hq, S]
    row = (base + g) * num_splits + s
    tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g < GROUP)
    tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=(g < GROUP)[:, None])
    # Every thread's partial stores come before the count (the barrier), and the count releases them to the
    # device scope; the last arriver's acquire makes all of them visible to its loads, which skip L1 (.cg).
    tl.debug_barrier()
    count = counts_ptr + i.to(tl.int64) * num_kv_heads + h
    arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    if arrived == used - 1:
        gr = tl.arange(0, GROUP_R)
        sp = tl.arange(0, SPLITS_P2)
        first = (base + gr) * num_splits  # [GROUP_R]
        live = gr < GROUP
        lse = tl.load(part_lse_ptr + first[:, None] + sp[None, :], mask=live[:, None] & (sp < used)[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # [GROUP_R, SPLITS_P2]
        lse_max = tl.where(live, tl.max(lse, 1), 0.0)
        denom = tl.sum(tl.exp2(lse - lse_max[:, None]), 1)
        total = tl.zeros([GROUP_R, HEAD_DIM], tl.float32)
        for c0 in range(0, used, CHUNK):  # CHUNK splits at a time keeps the [GROUP_R, CHUNK, D] tile in registers
            c = c0 + tl.arange(0, CHUNK)
            ok = live[:, None] & (c < used)[None, :]  # [GROUP_R, CHUNK]
            at = first[:, None] + c[None, :]
            w = tl.exp2(tl.load(part_lse_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
                        - lse_max[:, None])
            part = tl.load(part_o_ptr + at[:, :, None] * HEAD_DIM + d[None, None, :], mask=ok[:, :, None],
                           other=0.0, cache_modifier=".cg")  # [GROUP_R, CHUNK, D]
            total += tl.sum(w[:, :, None] * part, 1)
        res = total / tl.where(live, denom, 1.0)[:, None]
        tl.store(out_ptr + tok * stride_ot + (h * GROUP + gr)[:, None] * stride_oh + d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # ready for the next launch (next layer, replay)


def choose_num_splits(num_rows: int, num_kv_heads: int, num_sms: int) -> int:
    """A power of two giving about two (row, head, split) programs per multiprocessor, from the row count rounded
    up to a power of two. The rounding makes every CUDA-graph bucket (1, 2, 4, 8, then multiples of 16; see
    ``pdpool.engine.cuda_graphs.bucket_sizes``) pick what the eager step of any batch it serves picks. On an
    H100 (132 SMs; batch 64 x 4096, 8 KV heads: 1 split, 97% of copy bandwidth; batch 1 x 32k: 32 splits) a
    sweep put the neighbours within 2% of the pick."""
    rows = triton.next_power_of_2(max(1, num_rows))
    want = triton.cdiv(2 * num_sms, rows * num_kv_heads)
    return min(1 << (max(1, want).bit_length() - 1), 128)


def num_multiprocessors(device: torch.device) -> int:
    """The GPU's SM count (4 elsewhere, so CPU tests under the interpreter split too)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_workspace(num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int,
                     device) -> tuple:
    """(part_o, part_lse, counts): the split partials and the arrival counts (zero between launches; each launch
    leaves them zero), reusable by every layer of a step and by graph replays."""
    part_o = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=device)
    counts = torch.zeros(num_rows, num_kv_heads, dtype=torch.int32, device=device)
    return part_o, part_lse, counts


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 rows: torch.Tensor, scale: float, num_splits: int, workspace: tuple | None = None,
                 min_split_len: int = 0) -> None:
    """out[query_start_loc[r]] = attention of that one query token over request r's context, for r in ``rows``.

    q, out: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D] strided views; rows: [Rd] int32 request indices
    (each with query_len 1, seq_len >= 1, each at most once); workspace: ``decode_workspace(Rd, Hq, Hkv, D,
    num_splits)``, reusable across layers; min_split_len: no split shorter than this many tokens (later splits
    stay empty)."""
    Hq, D, block_size, Hkv = check_attention_args(q, out, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                  rows)
    Rd = rows.numel()
    if Rd == 0:
        return
    if workspace is None:
        workspace = decode_workspace(Rd, Hq, Hkv, D, num_splits, q.device)
    part_o, part_lse, counts = workspace
    assert part_o.shape == (Rd, Hq, num_splits, D) and part_o.is_contiguous() and part_o.dtype == torch.float32
    assert part_lse.shape == (Rd, Hq, num_splits) and part_lse.is_contiguous()
    assert counts.shape == (Rd, Hkv) and counts.is_contiguous() and counts.dtype == torch.int32
    assert Rd <= 65535, "rows are the grid's second dimension"
    group = Hq // Hkv
    group_r = triton.next_power_of_2(group)
    _decode_kernel[(Hkv, Rd, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows, part_o, part_lse, counts, out,
        scale * LOG2E, num_splits, min_split_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        SINGLE=num_splits == 1, BLOCK_SIZE=block_size, GROUP=group, GROUP_P2=max(16, triton.next_power_of_2(group)),
        GROUP_R=group_r, SPLITS_P2=max(2, triton.next_power_of_2(num_splits)), CHUNK=max(2, 32 // group_r),
        HEAD_DIM=D, PRECISION=dot_precision(q.dtype))
