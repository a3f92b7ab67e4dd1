"""The decode-sized GEMM (``pdpool.kernels.skinny_gemm``; measured, not used by the model) against an fp32
reference: row-swapped tiles and not, K split or not, with masked row, column and K edges; the split's sum in a
fixed order."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import DEVICE, DTYPES, ON_GPU, TOLERANCE, rel_err  # noqa: I001  (first)
from pdpool.kernels import skinny_gemm as sk

# (M, N, K): on a GPU the decode shapes of Llama-3.1-8B (qkv, o, down) and Qwen3-0.6B (o) at bucket sizes and a
# ragged row count; here small ones, even and with edges in every dimension
SHAPES = ([(208, 6144, 4096), (256, 4096, 4096), (96, 4096, 14336), (203, 1024, 2048), (16, 4096, 4096)] if ON_GPU
          else [(37, 45, 70), (16, 64, 128), (5, 33, 50)])
# on the CPU: the interpreter's config, and others covering each branch (no swap, a 3-way split, K blocks past K)
CONFIGS = sk.GPU_CONFIGS[:1] + [c for c in sk.GPU_CONFIGS if c.kwargs["SPLIT_K"] > 1][:2] if ON_GPU else [
    sk.INTERPRETER_CONFIG, sk._cfg(0, 16, 16, 16, 1, 1, 1), sk._cfg(1, 32, 16, 32, 3, 1, 1),
    sk._cfg(0, 16, 32, 64, 2, 1, 1)]


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: str(c.kwargs))
def test_skinny_linear_matches_reference(shape, config, dtype):
    M, N, K = shape
    x, w = rand(M, K, dtype=dtype), rand(N, K, dtype=dtype) / K ** 0.5
    out = sk.skinny_linear(x, w, config=config)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, sk.skinny_ref(x, w)) < TOLERANCE[dtype]
    again = sk.skinny_linear(x, w, config=config)  # the split's arrival counters were left at zero
    assert torch.equal(out, again), "the split-K sum depends on arrival order or on a stale counter"


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_tuned_path(dtype):
    """x as a row-strided view (a slice of a wider activation), through the autotuned entry point."""
    M, N, K = SHAPES[0]
    wide = rand(M, K + 24, dtype=dtype)
    x, w = wide[:, :K], rand(N, K, dtype=dtype) / K ** 0.5
    assert rel_err(sk.skinny_linear(x, w), sk.skinny_ref(x, w)) < TOLERANCE[dtype]


def test_empty_rows():
    w = rand(8, 16, dtype=DTYPES[0])
    assert sk.skinny_linear(rand(0, 16, dtype=DTYPES[0]), w).shape == (0, 8)


def test_bad_layout_is_refused():
    w = rand(16, 32, dtype=DTYPES[0])
    with pytest.raises(AssertionError, match="contiguous"):
        sk.skinny_linear(rand(32, 16, dtype=DTYPES[0]).t(), w)
    with pytest.raises(AssertionError, match="vs weight"):
        sk.skinny_linear(rand(16, 31, dtype=DTYPES[0]), w)
