"""The CPU extension's fused elementwise ops (kernels/csrc/fused_ops_cpu.cpp via kernels/cpu_ops.py) and its KV store,
compiled for real with the machine's compiler, against their torch references in fp32, fp16 and bf16: strided rows
where the model passes them strided, widths that are not a multiple of 8, and bad input refused with a message."""

from __future__ import annotations

import pytest
import torch

from pdpool.kernels import cpu_decode, cpu_ops
from pdpool.kernels.activation import silu_and_mul_ref
from pdpool.kernels.rmsnorm import rms_norm_ref
from pdpool.kernels.rotary import apply_rotary_ref
from pdpool.models.llama import RMSNorm, apply_rope

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32: a few ulps (exp, and the order of the squares' sum); reduced precision: an ulp of its own
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand(*shape, dtype):
    return torch.randn(*shape).to(dtype)


def close(out, ref, dtype):
    assert not out.isnan().any()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_with_residual_matches_the_model_norm(hidden, dtype):
    x, residual = rand(37, hidden, dtype=dtype), rand(37, hidden, dtype=dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = rand(hidden, dtype=dtype)
    ref, ref_residual = norm(x, residual)  # the torch ops the kernel replaces
    out, out_residual = cpu_ops.rms_norm(x, norm.weight, 1e-5, residual)
    assert torch.equal(out_residual, ref_residual)  # the add rounds as torch's does
    close(out, ref, dtype)
    close(cpu_ops.rms_norm(x, norm.weight, 1e-5), rms_norm_ref(x, norm.weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_views(dtype):
    qkv = rand(9, 6 * 64, dtype=dtype)
    q = qkv[:, :4 * 64].view(9, 4, 64)  # Qwen3's q norm: [T, heads, D] rows of the fused projection
    weight = rand(64, dtype=dtype)
    close(cpu_ops.rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views(dtype):
    T, D = 23, 64
    qkv = rand(T, 15 * D, dtype=dtype)
    q, k = qkv[:, :9 * D].view(T, 9, D), qkv[:, 9 * D:12 * D].view(T, 3, D)
    positions = torch.randperm(4096)[:T]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    q_ref, k_ref = apply_rotary_ref(q, k, positions, inv_freq)
    v_before, q_before = qkv[:, 12 * D:].clone(), q.clone()
    cpu_ops.apply_rotary(q, k, *cpu_ops.rotary_cos_sin(positions, inv_freq))
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)
    assert torch.equal(qkv[:, 12 * D:], v_before)  # only q and k were written
    if dtype == torch.float32:  # and the model's torch path agrees to an ulp
        angles = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), -1)[:, None, :]
        close(q, apply_rope(q_before, emb.cos(), emb.sin()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_and_mul_matches_reference(inter, dtype):
    x = rand(17, 2 * inter, dtype=dtype) * 4
    ref = silu_and_mul_ref(x)
    if dtype != torch.float32:  # the model's torch ops round silu(gate) to the dtype first
        gate, up = x.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    close(cpu_ops.silu_and_mul(x), ref, dtype)
    wide = rand(17, 2 * inter + 5, dtype=dtype)[:, :2 * inter]  # strided rows
    close(cpu_ops.silu_and_mul(wide), silu_and_mul_ref(wide), dtype)


def test_silu_exp_over_the_whole_range():
    gate = torch.linspace(-120, 120, 24001)
    out = cpu_ops.silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None, :])
    ref = torch.nn.functional.silu(gate)
    assert torch.allclose(out[0], ref, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_each_row_at_its_slot_and_skips_padding(dtype):
    kv = torch.zeros(10, 2, 2, 16, 3, 64, dtype=dtype)  # the node layout: [blocks, layers, K/V, block, Hkv, D]
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    kv_new = rand(5, 2 * 3 * 64 + 8, dtype=dtype)  # k, v as strided views of one projection
    k, v = kv_new[:, :192].view(5, 3, 64), kv_new[:, 192:384].view(5, 3, 64)
    slots = torch.tensor([3, -1, 17, 159, 0])
    cpu_decode.store_kv(k, v, k_cache, v_cache, slots)
    expected = torch.zeros_like(kv)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 16, 1, 0, slot % 16], expected[slot // 16, 1, 1, slot % 16] = k[t], v[t]
    assert torch.equal(kv, expected)


def test_bad_input_is_refused_with_a_message():
    k_cache = torch.zeros(4, 16, 2, 32)
    k = torch.zeros(3, 2, 32)
    with pytest.raises(ValueError, match="slot 64 outside"):
        cpu_decode.store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([0, 64, 1]))
    with pytest.raises(ValueError, match="contiguous int64"):
        cpu_decode.store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="one dtype"):
        cpu_decode.store_kv(k, k.half(), k_cache, k_cache.clone(), torch.tensor([0, 1, 2]))
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        cpu_ops.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        cpu_ops.rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="contiguous last dim"):
        cpu_ops.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        cpu_ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="cos must be contiguous"):
        cpu_ops.apply_rotary(torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(2, 3), torch.zeros(2, 4))


def test_model_uses_the_native_ops_on_cpu():
    from pdpool.models.llama import fused_ops_default

    assert fused_ops_default(torch.device("cpu"))


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch):
    from pdpool.kernels import cpu_features

    real = cpu_features.cpu_flags()
    assert cpu_features.default_cpu_dtype()[0] == ("bfloat16" if real & {"avx512_bf16", "amx_bf16"} else "float32")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert cpu_features.default_cpu_dtype() == ("bfloat16", "the CPU has native bf16 (avx512_bf16)")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu_features.default_cpu_dtype()[0] == "float32"
