"""SiLU-and-mul: the gated MLP's activation on the fused gate|up projection, ``silu(gate) * up``.

    x: [T, 2I] = gate | up  ->  out: [T, I], computed in fp32 and rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import assert_last_dim_contiguous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    assert_last_dim_contiguous("x", x, 2)
    T, two_inter = x.shape
    assert two_inter % 2 == 0
    inter = two_inter // 2
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device) if out is None else out
    assert_last_dim_contiguous("out", out, 2)
    assert out.shape == (T, inter) and out.dtype == x.dtype and out.device == x.device
    block = min(1024, triton.next_power_of_2(inter))
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), INTER=inter,
                                                            BLOCK=block, num_warps=4)
    return out


def silu_and_mul_ref(x):
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
