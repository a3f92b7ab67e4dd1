"""What comes between the qkv projection and attention, in one launch: Qwen3's per-head q/k RMSNorm (optional),
rotary on q and k (neox), and the KV store of the rotated k and of v into the paged cache.

Separately these were up to four kernels a layer (q norm, k norm, rotary, store), each a few microseconds of
launch and tail for a few kilobytes of data at decode batch sizes. One program per token::

    q[t, h] = rotate(norm_q(q[t, h]))            in place (q may be a strided view of the projection)
    k[t, h] = rotate(norm_k(k[t, h]))            in place, and k_cache[slot[t]] = k[t, h]
    v_cache[slot[t]] = v[t, h]                   slot -1 (padding) is written nowhere

Each value is rounded as the separate kernels round it (``rmsnorm``: normalize in fp32, cast, scale in fp32,
cast; ``rotary``: fp32 from the rounded input, cast), so the cache holds what ``store_kvcache`` stored before.
The norm's sum of squares adds the two halves of the head apart (the rotation reads the halves), which may
change its last bit against ``rms_norm``'s one sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import assert_last_dim_contiguous, assert_paged_cache


@triton.jit
def _norm_rotate(x_ptr, t, stride_t, stride_h, w_ptr, eps, cos, sin,
                 NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotated (and normalized) heads of token t, stored in place; returns the two halves in the input dtype."""
    h = tl.arange(0, HEADS_P2)[:, None]
    i = tl.arange(0, HALF)[None, :]
    mask = h < NUM_HEADS
    src = x_ptr + t * stride_t + h * stride_h + i
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:
        ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)  # [HEADS_P2]
        inv = (1.0 / tl.sqrt(ss / (2 * HALF) + eps))[:, None]
        w1 = tl.load(w_ptr + i).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i).to(tl.float32)
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(src, o1, mask=mask)
    tl.store(src + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _qkv_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr, eps,
                k_cache_ptr, v_cache_ptr, slot_ptr,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_HEADS_P2: tl.constexpr,
                K_HEADS_P2: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    angle = tl.load(positions_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + tl.arange(0, HALF))  # [HALF]
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    _norm_rotate(q_ptr, t, stride_qt, stride_qh, q_norm_ptr, eps, cos, sin, NUM_Q_HEADS, Q_HEADS_P2, HALF, NORM)
    k1, k2 = _norm_rotate(k_ptr, t, stride_kt, stride_kh, k_norm_ptr, eps, cos, sin, NUM_K_HEADS, K_HEADS_P2,
                          HALF, NORM)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        h = tl.arange(0, K_HEADS_P2)[:, None]
        i = tl.arange(0, HALF)[None, :]
        mask = h < NUM_K_HEADS
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch + i
        tl.store(k_cache_ptr + dst, k1, mask=mask)
        tl.store(k_cache_ptr + dst + HALF, k2, mask=mask)
        src = v_ptr + t * stride_vt + h * stride_vh + i
        tl.store(v_cache_ptr + dst, tl.load(src, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, tl.load(src + HALF, mask=mask), mask=mask)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (rows may be strided), positions: [T] int, inv_freq: [D/2] fp32,
    caches: [num_blocks, block_size, Hkv, D] strided views, slot_mapping: [T] int64 (-1: nowhere);
    q_norm/k_norm: [D] weights of the per-head RMSNorm (both or neither). q and k are rotated in place."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert_last_dim_contiguous(name, x, 3)
    assert_paged_cache("k_cache", k_cache)
    assert_paged_cache("v_cache", v_cache, like=k_cache)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape == (T, Hkv, D) and q.dtype == k.dtype == v.dtype == k_cache.dtype
    assert k_cache.shape[2:] == (Hkv, D), f"cache heads/dim {tuple(k_cache.shape[2:])} != k {(Hkv, D)}"
    assert D % 2 == 0 and triton.next_power_of_2(D // 2) == D // 2, "head_dim/2 must be a power of two"
    assert positions.shape == (T,) and positions.is_contiguous() and not positions.is_floating_point()
    assert inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (T,) and slot_mapping.is_contiguous()
    assert (q_norm is None) == (k_norm is None), "q and k are normalized together or not at all"
    if q_norm is not None:
        assert q_norm.shape == k_norm.shape == (D,) and q_norm.is_contiguous() and k_norm.is_contiguous()
    if T == 0:
        return
    _qkv_kernel[(T,)](
        q, k, v, positions, inv_freq, q_norm if q_norm is not None else inv_freq,
        k_norm if k_norm is not None else inv_freq, eps, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=Hq, NUM_K_HEADS=Hkv, Q_HEADS_P2=triton.next_power_of_2(Hq),
        K_HEADS_P2=triton.next_power_of_2(Hkv), HALF=D // 2, BLOCK_SIZE=k_cache.shape[1], NORM=q_norm is not None)
