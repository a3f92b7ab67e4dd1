"""Paged attention for prefill and extend: a varlen batch of queries attends causally to the cached prefix and to
its own new tokens, all read from the paged cache (the new K/V were written there first). GQA by head index.

Grid (Hq, q tiles, prefill rows); q heads vary fastest so the GROUP heads sharing a KV head run together and
share its tiles in L2; the q tiles are taken last-first, since later tiles see more keys. For a tile of queries
``m0 .. m0 + BLOCK_M`` of a request with ``prefix = seq_len - query_len`` cached tokens::

    keys:  | 0 ........ full_end |  full_end .. min(prefix + m0 + BLOCK_M, seq_len) |
           |  seen by every row  |  causal mask: key <= prefix + row                 |
           no mask                full_end = (prefix + m0) // BLOCK_N * BLOCK_N
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import STEP_POINTERS, check_attention_args, configs, dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, head, stride_cb, stride_ct,
                  lo, hi, q_pos, seq_len, scale_log2,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = offs_n < seq_len
            blk = tl.load(table + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            blk = tl.load(table + offs_n // BLOCK_SIZE).to(tl.int64)
        kv_off = blk[:, None] * stride_cb + (offs_n % BLOCK_SIZE)[:, None] * stride_ct + head + d[None, :]
        if MASKED:
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        else:
            k = tl.load(k_cache_ptr + kv_off)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if MASKED:
            allowed = (offs_n[None, :] <= q_pos[:, None]) & valid[None, :]
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        else:
            v = tl.load(v_cache_ptr + kv_off)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.autotune(configs=configs([
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=4),  # best on H100, 8 x 2048
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
], interpreter=triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})), key=["HEAD_DIM", "GROUP", "BLOCK_SIZE"])
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=STEP_POINTERS)
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, rows_ptr,
                    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch,
                    stride_bt, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    hq = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    r = tl.load(rows_ptr + tl.program_id(2))
    q_start = tl.load(query_start_ptr + r)
    q_len = tl.load(query_start_ptr + r + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    prefix = seq_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    tok = q_start.to(tl.int64) + offs_m
    q = tl.load(q_ptr + tok[:, None] * stride_qt + hq * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + r.to(tl.int64) * stride_bt
    head = (hq // GROUP) * stride_ch
    full_end = (prefix + m0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, head, stride_cb, stride_ct,
                                  0, full_end, q_pos, seq_len, scale_log2,
                                  BLOCK_SIZE, HEAD_DIM, BLOCK_N, MASKED=False, PRECISION=PRECISION)
    hi = tl.minimum(prefix + m0 + BLOCK_M, seq_len)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, head, stride_cb, stride_ct,
                                  full_end, hi, q_pos, seq_len, scale_log2,
                                  BLOCK_SIZE, HEAD_DIM, BLOCK_N, MASKED=True, PRECISION=PRECISION)
    o = acc / l_i[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + hq * stride_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  rows: torch.Tensor, max_query_len: int, scale: float) -> None:
    """out[tokens of r] = causal attention of request r's queries over its context, for r in ``rows``.

    q, out: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D] strided views; rows: [Rp] int32 request indices;
    max_query_len: the largest query length among ``rows`` (host int, sizes the grid)."""
    Hq, D, block_size, Hkv = check_attention_args(q, out, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                  rows)
    Rp = rows.numel()
    if Rp == 0 or max_query_len == 0:
        return
    grid = lambda meta: (Hq, triton.cdiv(max_query_len, meta["BLOCK_M"]), Rp)  # noqa: E731
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, rows, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=Hq // Hkv, HEAD_DIM=D, PRECISION=dot_precision(q.dtype))
