"""The one-row GEMV kernel (batch-1 projections; ``silu_x``: SiLU-and-mul folded into the input) and the fused
q/k norm + rotary + KV store kernel, against torch references; shapes with and without masked edges."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import DEVICE, DTYPES, ON_GPU, TOLERANCE, node_cache, rel_err  # noqa: I001  (first)
from pdpool.kernels.activation import silu_and_mul
from pdpool.kernels.fused_qkv import rotary_store_kv
from pdpool.kernels.gemv import gemv, gemv_ref
from pdpool.kernels.rmsnorm import rms_norm
from pdpool.kernels.rotary import apply_rotary
from pdpool.kernels.store_kvcache import store_kvcache

# (N, K): the serving shapes on a GPU (Llama-3.1-8B qkv, o, down; Qwen3-0.6B o), small ones here: one even
# (every block divides), the others with masked row and column edges
SHAPES = [(6144, 4096), (4096, 4096), (4096, 14336), (1024, 2048)] if ON_GPU else [(64, 1024), (37, 70), (8, 33)]


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_matches_reference(shape, dtype):
    N, K = shape
    x, w = rand(1, K, dtype=dtype), rand(N, K, dtype=dtype) / K ** 0.5
    out = gemv(x, w)
    assert out.shape == (1, N) and out.dtype == dtype
    assert rel_err(out, gemv_ref(x, w)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_with_silu_input_matches_unfused(shape, dtype):
    """silu_x: the same as silu_and_mul (rounded to the dtype) then the projection."""
    N, K = shape
    gate_up, w = rand(1, 2 * K, dtype=dtype), rand(N, K, dtype=dtype) / K ** 0.5
    out = gemv(gate_up, w, silu_x=True)
    ref = silu_and_mul(gate_up).float() @ w.float().t()
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(out, gemv_ref(gate_up, w, silu_x=True)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_store_kv_matches_separate_kernels(qk_norm, dtype):
    """On strided views of one qkv projection, shuffled slots and a padding slot: q and k as the separate norm and
    rotary kernels leave them, and the cache as store_kvcache writes it; nothing else in the cache changes."""
    T, hq, hkv, d = (300, 32, 8, 128) if ON_GPU else (7, 4, 2, 32)
    qkv = rand(T, (hq + 2 * hkv) * d, dtype=dtype)
    views = lambda t: (t[:, :hq * d].view(T, hq, d), t[:, hq * d:(hq + hkv) * d].view(T, hkv, d),  # noqa: E731
                       t[:, (hq + hkv) * d:].view(T, hkv, d))
    positions = torch.randint(0, 4000, (T,), device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    w_q, w_k = ((1 + 0.1 * torch.randn(d, device=DEVICE)).to(dtype) for _ in range(2))
    num_blocks = -(-T // 16) + 3
    slots = torch.randperm(num_blocks * 16, device=DEVICE)[:T]
    slots[T // 2] = -1
    kv = node_cache(num_blocks, hkv, d, dtype)
    kv_ref = kv.clone()

    ref_qkv = qkv.clone()
    q, k, v = views(ref_qkv)
    if qk_norm:
        q, k = rms_norm(q, w_q, 1e-6), rms_norm(k, w_k, 1e-6)
    q, k = apply_rotary(q, k, positions, inv_freq)
    store_kvcache(k, v, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots)

    q2, k2, v2 = views(qkv)
    rotary_store_kv(q2, k2, v2, positions, inv_freq, kv[:, 1, 0], kv[:, 1, 1], slots,
                    *((w_q, w_k) if qk_norm else (None, None)), eps=1e-6)
    assert rel_err(q2, q.float()) < TOLERANCE[dtype] and rel_err(k2, k.float()) < TOLERANCE[dtype]
    if not qk_norm:  # the same arithmetic as the rotary kernel: equal
        assert torch.equal(q2, q) and torch.equal(k2, k)
    assert torch.equal(v2, v), "v is not modified"
    written = kv_ref.isnan().logical_not()
    assert torch.equal(kv.isnan().logical_not(), written), "slots written differ (padding must write nothing)"
    assert rel_err(kv[written], kv_ref[written].float()) < TOLERANCE[dtype]
