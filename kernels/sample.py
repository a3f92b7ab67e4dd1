"""One pass over the logits for the common sampling case: temperature (or greedy), no top-k/top-p/min-p.

Random rows take the Gumbel-max draw, ``argmax(logits / T + G)`` with ``G = -log(-log U)``, which samples from
``softmax(logits / T)`` (the same distribution as the torch sampler's exponential race, another random stream);
greedy rows (temperature 0) take the argmax, first index on ties as ``torch.argmax``. ``U`` is Philox
(``tl.rand``) keyed by one seed per call and the element's offset ``row * V + col``, so a row's draw depends on
the seed and its own row only. The torch sampler does ~10 passes over ``[R, V]`` float32 for this case (divide,
softmax, exponentials, clamp, divide, argmax); this kernel reads the logits once and writes ``[R]`` ids.

``gumbel_argmax_ref`` is the torch reference (same Philox-free formula on given uniforms)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import assert_last_dim_contiguous, interpreting


@triton.jit(do_not_specialize=["seed"])
def _gumbel_argmax_kernel(logits_ptr, stride_row, temp_ptr, out_ptr, seed, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row)
    noisy = temp > 0
    inv_t = tl.where(noisy, 1.0 / tl.where(noisy, temp, 1.0), 1.0)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < V
        x = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, row * V + offs)
        u = tl.maximum(u, 1e-20)
        g = -tl.log(-tl.log(u))
        score = tl.where(noisy, x * inv_t + g, x)
        score = tl.where(mask, score, float("-inf"))
        better = score > best_val  # strict: each lane keeps its first maximum
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """logits: [R, V] (any float dtype, last dim contiguous); temperature: [R] float32 (0 = greedy) -> ids [R]
    int64. Queues one kernel; no host sync."""
    assert_last_dim_contiguous("logits", logits, 2)
    R, V = logits.shape
    assert temperature.shape == (R,) and temperature.dtype == torch.float32
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    block = 256 if interpreting() else 2048
    _gumbel_argmax_kernel[(R,)](logits, logits.stride(0), temperature, out, seed, V, BLOCK=block,
                                num_warps=1 if interpreting() else 8)
    return out


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The same formula in torch on given uniforms [R, V]: argmax(logits / T - log(-log U)), argmax for T = 0."""
    x = logits.float()
    noisy = temperature > 0
    g = -torch.log(-torch.log(uniforms.clamp_min(1e-20)))
    score = torch.where(noisy[:, None], x / torch.where(noisy, temperature, 1.0)[:, None] + g, x)
    return score.argmax(dim=-1)
