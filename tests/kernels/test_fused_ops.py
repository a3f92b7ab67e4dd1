"""Fused elementwise kernels (RMSNorm with residual add, rotary with llama3 frequencies, SiLU-and-mul) against their
torch references, on fresh random inputs with strided rows where the model passes them strided."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernel_builders import DEVICE, DTYPES, ON_GPU, TOLERANCE, poisoned_like, rel_err  # noqa: I001  (first)
from pdpool.kernels.activation import silu_and_mul, silu_and_mul_ref
from pdpool.kernels.rmsnorm import rms_norm, rms_norm_ref
from pdpool.kernels.rotary import apply_rotary, apply_rotary_ref
from pdpool.models.llama import inv_frequencies

T = 300 if ON_GPU else 7
HIDDEN = [4096, 5120] if ON_GPU else [96, 64]  # a width that is not a power of two, and one that is
INTER = 14336 if ON_GPU else 80
MAX_POS = 32768 if ON_GPU else 4096
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(with_residual, hidden, dtype):
    x, residual = rand(T, hidden, dtype=dtype), rand(T, hidden, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    out = poisoned_like(x)
    if with_residual:
        ref, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
        rms_norm(x, weight, 1e-5, residual, out=out, residual_out=residual)  # the residual updated in place
        assert torch.equal(residual, ref_residual)
    else:
        rms_norm(x, weight, 1e-5, out=out)
        ref = rms_norm_ref(x, weight, 1e-5)
    assert out.dtype == ref.dtype and rel_err(out, ref.float()) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_views(dtype):
    """Qwen3's q/k norm: [T, heads, D] rows of the fused qkv projection, normalized per (token, head)."""
    hq, hkv, d = (32, 8, 128) if ON_GPU else (4, 2, 32)
    qkv = rand(T, (hq + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, :hq * d].view(T, hq, d)
    weight = (1 + 0.1 * torch.randn(d, device=DEVICE)).to(dtype)
    out = poisoned_like(q.contiguous())
    rms_norm(q, weight, 1e-6, out=out)
    assert rel_err(out, rms_norm_ref(q, weight, 1e-6).float()) < TOLERANCE[dtype]
    ref = rms_norm_ref(q, weight, 1e-6)
    rms_norm(q, weight, 1e-6, out=q)  # in place, on the strided view
    assert rel_err(q, ref.float()) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rotary_matches_reference(scaling, dtype):
    hq, hkv, d = (32, 8, 128) if ON_GPU else (4, 2, 32)
    config = SimpleNamespace(rope_theta=500000.0, rope_scaling=scaling)
    inv_freq = inv_frequencies(config, d).to(DEVICE)
    qkv = rand(T, (hq + 2 * hkv) * d, dtype=dtype)  # the fused projection: q and k are strided views of it
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    positions = torch.randint(0, MAX_POS, (T,), device=DEVICE)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, inv_freq)
    q_out, k_out = apply_rotary(q, k, positions, inv_freq, q_out=poisoned_like(q_ref).to(dtype),
                                k_out=poisoned_like(k_ref).to(dtype))
    assert rel_err(q_out, q_ref) < TOLERANCE[dtype] and rel_err(k_out, k_ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    x = rand(T, 2 * INTER, dtype=dtype)
    out = torch.full((T, INTER), float("nan"), dtype=dtype, device=DEVICE)
    silu_and_mul(x, out=out)
    assert rel_err(out, silu_and_mul_ref(x)) < TOLERANCE[dtype]
