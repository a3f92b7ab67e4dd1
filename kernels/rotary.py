"""Rotary position embedding (neox layout: the two halves of each head rotate together) on q and k in one launch.

The angles are computed in the kernel from the positions and the inverse frequencies, in fp32 as HF does; the
frequencies carry any scaling ('linear', 'llama3': see ``pdpool.models.llama.inv_frequencies``)::

    angle[t, i] = positions[t] * inv_freq[i]                      i < D/2
    out[..., :D/2] = x1 * cos - x2 * sin,  out[..., D/2:] = x2 * cos + x1 * sin
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import assert_last_dim_contiguous


@triton.jit
def _rotate_heads(x_ptr, o_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                  NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr):
    h = tl.arange(0, HEADS_P2)[:, None]
    i = tl.arange(0, HALF)[None, :]
    mask = h < NUM_HEADS
    src = x_ptr + t * stride_xt + h * stride_xh + i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [HEADS_P2, HALF]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = o_ptr + t * stride_ot + h * stride_oh + i
    tl.store(dst, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, inv_freq_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_HEADS_P2: tl.constexpr,
                   K_HEADS_P2: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    angle = tl.load(positions_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + tl.arange(0, HALF))  # [HALF]
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_P2, HALF)
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_K_HEADS, K_HEADS_P2, HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] (rows may be strided), positions: [T] int, inv_freq: [D/2] fp32
    -> rotated (q, k), into ``q_out``/``k_out`` when given (may be q and k themselves: in place)."""
    assert_last_dim_contiguous("q", q, 3)
    assert_last_dim_contiguous("k", k, 3)
    T, Hq, D = q.shape
    assert k.shape[0] == T and k.shape[2] == D and k.dtype == q.dtype and k.device == q.device
    assert D % 2 == 0 and triton.next_power_of_2(D // 2) == D // 2, "head_dim/2 must be a power of two"
    assert positions.shape == (T,) and positions.is_contiguous() and not positions.is_floating_point()
    assert inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    for name, o, x in (("q_out", q_out, q), ("k_out", k_out, k)):
        assert_last_dim_contiguous(name, o, 3)
        assert o.shape == x.shape and o.dtype == x.dtype and o.device == x.device
    if T:
        _rotary_kernel[(T,)](
            q, k, q_out, k_out, positions, inv_freq,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1),
            NUM_Q_HEADS=Hq, NUM_K_HEADS=k.shape[1], Q_HEADS_P2=triton.next_power_of_2(Hq),
            K_HEADS_P2=triton.next_power_of_2(k.shape[1]), HALF=D // 2)
    return q_out, k_out


def apply_rotary_ref(q, k, positions, inv_freq):
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos(), emb.sin()

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)
