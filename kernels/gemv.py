"""One-row linear layers (batch-1 decode): ``out[n] = sum_k x[k] * W[n, k]``, streaming W once, with no split-K.

At one token per step every projection reads its whole weight for one row, so the step is weight-streaming bound.
cuBLAS splits K for ``o_proj`` and ``down_proj`` there (a second, reduce kernel per call: 64 of the 402 kernels of
a Llama-3.1-8B batch-1 step) and runs ``qkv_proj`` at about 83% of copy bandwidth. Here one program takes
``BLOCK_N`` whole rows of W: no partials, no second launch. With ``silu_x`` the input is the fused ``gate|up``
projection and the kernel computes ``silu(gate) * up`` itself (rounded to the model dtype first, exactly as
``pdpool.kernels.activation.silu_and_mul`` writes it), so the MLP's activation kernel goes too::

    x:  [1, K]  (or gate|up [1, 2K] with silu_x)      W: [N, K] row-major (nn.Linear)      out: [1, N]

Each program keeps a [BLOCK_N, BLOCK_K] fp32 tile of products and sums it once at the end. Rows of W must be
contiguous; N and K need not be multiples of the blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import configs


@triton.autotune(configs=configs([
    triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 8, "BLOCK_K": 512}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 8, "BLOCK_K": 1024}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 16, "BLOCK_K": 1024}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 4, "BLOCK_K": 1024}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 32, "BLOCK_K": 512}, num_warps=8, num_stages=3),
], interpreter=triton.Config({"BLOCK_N": 8, "BLOCK_K": 32})), key=["N", "K", "SILU"])
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, stride_w, N, K, SILU: tl.constexpr,
                 EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            w = tl.load(w_rows + cols[None, :])
            if SILU:
                gate = tl.load(x_ptr + cols).to(tl.float32)
                up = tl.load(x_ptr + K + cols).to(tl.float32)
        else:
            col_ok = cols < K
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            if SILU:
                gate = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SILU:
            x = (gate / (1.0 + tl.exp(-gate)) * up).to(w_ptr.dtype.element_ty).to(tl.float32)
        elif EVEN:
            x = tl.load(x_ptr + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, silu_x: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] (with ``silu_x``: gate|up [1, 2K]), weight: [N, K] -> [1, N] = linear(x, weight) (no bias)."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1, f"x: [1, K], got {tuple(x.shape)}"
    N, K = weight.shape
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    assert x.shape[1] == (2 * K if silu_x else K), f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and x.device == weight.device
    out = torch.empty(1, N, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (1, N) and out.is_contiguous() and out.dtype == x.dtype
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, weight, out, weight.stride(0), N=N, K=K, SILU=silu_x,
                       EVEN=_even(N, K))
    return out


def _even(N: int, K: int) -> bool:
    """Every tuned block divides N and K (no masks): true for the serving models' projections."""
    return N % 32 == 0 and K % 1024 == 0


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, silu_x: bool = False) -> torch.Tensor:
    if silu_x:
        gate, up = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up).to(weight.dtype)
    return x.float() @ weight.float().t()
