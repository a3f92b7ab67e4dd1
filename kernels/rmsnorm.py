"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

    residual_out = x + residual                       (rounded to the model dtype, as HF adds in that dtype)
    out = weight * (residual_out * rsqrt(mean(residual_out^2) + eps)).to(dtype)   (HF's order: normalize in fp32,
                                                                                   cast, then scale)
One program per row of [T, H]; the whole row sits in registers (H up to 16k). A [T, heads, D] input (Qwen3's
per-head q/k norm, on strided views of the fused qkv projection) is normalized per (token, head) row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import assert_last_dim_contiguous


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                     stride_x, stride_xh, stride_r, stride_o, stride_oh, stride_ro,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)  # head, for [T, heads, D] inputs (0 otherwise)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + t * stride_x + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + t * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv_rms).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t * stride_o + h * stride_oh + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] or [T, heads, H], weight: [H] -> out of x's shape; with ``residual`` (2-d x only) [T, H] ->
    (out, x + residual). Rows may be strided. ``out``/``residual_out`` may be given (same shape; ``out`` may be
    ``x`` itself, ``residual_out`` may be ``residual`` itself)."""
    assert x.dim() in (2, 3) and x.stride(-1) == 1, f"x: [T, H] or [T, heads, H], strides {x.stride()}"
    T, H = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    assert weight.shape == (H,) and weight.is_contiguous() and weight.device == x.device
    assert H <= 16384, "one row per program: split the row for wider hidden sizes"
    if out is None:
        out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    assert_last_dim_contiguous("out", out, x.dim())
    assert out.shape == x.shape and out.dtype == torch.promote_types(x.dtype, weight.dtype)
    if residual is not None:
        assert x.dim() == 2, "the residual add is for [T, H] hidden states"
        assert_last_dim_contiguous("residual", residual, 2)
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        assert_last_dim_contiguous("residual_out", residual_out, 2)
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype
    if T:
        _rms_norm_kernel[(T, heads)](
            x, residual if residual is not None else x, weight, out,
            residual_out if residual_out is not None else out, eps,
            x.stride(0), x.stride(1) if heads > 1 else 0, residual.stride(0) if residual is not None else 0,
            out.stride(0), out.stride(1) if heads > 1 else 0,
            residual_out.stride(0) if residual_out is not None else 0,
            HIDDEN=H, BLOCK=triton.next_power_of_2(H), HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, triton.next_power_of_2(H) // 512)))
    return out if residual is None else (out, residual_out)


def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)
