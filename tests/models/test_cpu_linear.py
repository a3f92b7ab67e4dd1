"""The CPU linear paths (pdpool.models.cpu_linear) against F.linear: the native small-row kernel
(kernels/csrc/linear_cpu.cpp) in fp32/fp16/bf16 on odd and real shapes, and the oneDNN-packed path, on the demo
model's layer shapes."""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pdpool.models import cpu_linear
from pdpool.models.cpu_linear import (NATIVE_MAX_ROWS, PACKED_MAX_ROWS, PackedWeight, native_linear,
                                      native_linear_available, pack_cpu_linears, packed_linear_available)

# (N, K): qkv, o, gate_up, down, logits of the demo model (SmolLM2-135M shapes)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


# per dtype: inputs rounded to the dtype, sums in fp32, one rounding of the output (F.linear's own bf16/fp16 CPU
# path rounds differently, so the reference is F.linear in fp32 on the same rounded values)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}


def reference(x, w, b):
    out = F.linear(x.float(), w.float(), None if b is None else b.float())
    return out.to(x.dtype)


def make(rows, n, k, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def test_native_kernel_builds_here():
    # the extension builds on this machine; a skip here would hide every native test below
    assert native_linear_available()


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16, 31, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 37), (5, 8), (4, 1), (1, 9), (129, 1031)])
def test_native_matches_f_linear(dtype, rows, n, k):
    x, w, b = make(rows, n, k, dtype, bias=n % 2 == 1, seed=rows * 1000 + n + k)
    rtol, atol = TOL[dtype]
    got = native_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), reference(x, w, b).float(), rtol=rtol, atol=atol)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(1, 300), bias=st.booleans(),
       dtype=st.sampled_from(list(TOL)), seed=st.integers(0, 2 ** 16))
def test_native_any_shape(rows, n, k, bias, dtype, seed):
    x, w, b = make(rows, n, k, dtype, bias, seed)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(native_linear(x, w, b).float(), reference(x, w, b).float(), rtol=rtol, atol=atol)


def test_native_non_contiguous_and_batched_input():
    x, w, b = make(6, 40, 24, torch.float32, bias=True, seed=3)
    wide = torch.randn(6, 48)
    strided_rows = wide[:, 8:32]  # rows strided, last dim contiguous
    strided_rows.copy_(x)
    torch.testing.assert_close(native_linear(strided_rows, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    transposed = x.t().contiguous().t()  # last dim strided: copied
    torch.testing.assert_close(native_linear(transposed, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    batched = x.reshape(2, 3, 24)
    torch.testing.assert_close(native_linear(batched, w, b), F.linear(batched, w, b), rtol=1e-5, atol=1e-5)


def test_native_empty_inputs():
    w, b = torch.randn(5, 8), torch.randn(5)
    assert native_linear(torch.empty(0, 8), w, b).shape == (0, 5)
    torch.testing.assert_close(native_linear(torch.empty(3, 0), torch.empty(5, 0), b), b.expand(3, 5))
    assert native_linear(torch.randn(3, 8), torch.empty(0, 8)).shape == (3, 0)


@pytest.mark.parametrize("x,w,b,match", [
    (torch.randn(2, 8), torch.randn(4, 9), None, "expected x"),
    (torch.randn(2, 8), torch.randn(4, 8, 1), None, "expected x"),
    (torch.randn(2, 8).double(), torch.randn(4, 8).double(), None, "dtype"),
    (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, "dtype"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(4).half(), "dtype"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), "bias must be"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(4, 1), "bias must be"),
    (torch.randn(2, 8, device="meta"), torch.randn(4, 8), None, "CPU tensors"),
])
def test_native_bad_input_is_a_clear_error(x, w, b, match):
    with pytest.raises(ValueError, match=match):
        native_linear(x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wraps_half_precision_linears_natively(dtype):
    model = nn.Sequential(nn.Linear(24, 16).to(dtype))
    assert pack_cpu_linears(model) == 1
    layer = model[0]
    assert layer.packed_weight.native and not layer.packed_weight.packs
    rtol, atol = TOL[dtype]
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1):  # native, then F.linear
        x = torch.randn(rows, 24).to(dtype)
        torch.testing.assert_close(layer(x).float(), reference(x, layer.weight, layer.bias).float(), rtol=rtol,
                                   atol=atol)


def test_native_off_switch(monkeypatch):
    monkeypatch.setenv("PDPOOL_CPU_KERNELS", "0")
    assert not native_linear_available()
    assert not PackedWeight(torch.randn(8, 4)).native


def test_available_on_this_build():
    # this CPU torch build ships oneDNN; if it did not, the fallback tests below still hold
    assert packed_linear_available() == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 64, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
def test_matches_f_linear(n, k, rows):
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen) * 0.02
    b = torch.randn(n, generator=gen) if n == 960 else None
    x = torch.randn(rows, k, generator=gen)
    torch.testing.assert_close(PackedWeight(w, b)(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_repacks_after_in_place_change():
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(32, 16, generator=gen), torch.randn(4, 16, generator=gen)
    pw = PackedWeight(w)
    pw(x)
    w.mul_(2.0)
    torch.testing.assert_close(pw(x), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_falls_back_when_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_linear, "packed_linear_available", lambda: False)
    monkeypatch.setattr(cpu_linear, "native_linear_available", lambda: False)
    model = nn.Sequential(nn.Linear(16, 8))
    assert pack_cpu_linears(model) == 0
    assert not hasattr(model[0], "packed_weight")


def test_skips_non_fp32_without_the_native_kernel(monkeypatch):
    monkeypatch.setattr(cpu_linear, "native_linear_available", lambda: False)
    model = nn.Sequential(nn.Linear(16, 8).to(torch.bfloat16), nn.Linear(8, 4))
    assert pack_cpu_linears(model) == (1 if packed_linear_available() else 0)
    assert not hasattr(model[0], "packed_weight")
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[1](x), F.linear(x, model[1].weight, model[1].bias), rtol=1e-4, atol=1e-4)


ONEDNN_VARS = ("PDPOOL_ONEDNN_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY",
               "LRU_CACHE_CAPACITY")


@pytest.mark.parametrize("setting, onednn, lru", [
    ({}, str(cpu_linear.DEFAULT_ONEDNN_CACHE_CAPACITY), str(cpu_linear.DEFAULT_ONEDNN_CACHE_CAPACITY)),
    ({"PDPOOL_ONEDNN_CACHE_CAPACITY": "32"}, "32", "32"),
    ({"PDPOOL_ONEDNN_CACHE_CAPACITY": "0"}, None, None),  # 0: torch's own defaults
    ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "4"}, "8", "4"),  # the user's win
    ({"DNNL_PRIMITIVE_CACHE_CAPACITY": "8"}, None, str(cpu_linear.DEFAULT_ONEDNN_CACHE_CAPACITY)),  # older name
])
def test_bound_onednn_caches_sets_the_environment(monkeypatch, setting, onednn, lru):
    for name in ONEDNN_VARS:  # set first, so that monkeypatch restores each as it was, absent or not
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    cpu_linear.bound_onednn_caches()
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == onednn
    assert os.environ.get("LRU_CACHE_CAPACITY") == lru
