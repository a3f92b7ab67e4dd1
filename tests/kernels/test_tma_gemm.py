"""The Hopper decode GEMM (``pdpool.kernels.tma_gemm``) against an fp32 reference: stream-K splits that cut tiles
into 1, 2 and 3 segments, whole-tile persistent launches, edges in every dimension; the split's sum in a fixed
order (two launches give identical outputs, and the arrival counters are left at zero)."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import DEVICE, DTYPES, ON_GPU, TOLERANCE, rel_err  # noqa: I001  (first)
from pdpool.kernels import split_workspace, tma_gemm as tg

# (M, N, K): on a GPU Llama-3.1-8B's decode projections at bucket sizes and a ragged row count; here small ones
# (K a multiple of 8 elements: TMA's 16-byte row stride for fp16)
SHAPES = ([(256, 4096, 14336), (192, 6144, 4096), (203, 4096, 4096), (64, 28672, 4096), (1, 4096, 4096)] if ON_GPU
          else [(5, 40, 72), (16, 64, 128), (33, 100, 96)])
# the stream-K split by programs: one tile per few programs (3 segments), tiles cut in two, whole tiles
CONFIGS = ([tg.TmaGemmConfig(), tg.TmaGemmConfig(whole_tiles=True), tg.TmaGemmConfig(128, 128, 2, 8, programs=97)]
           if ON_GPU else [tg.TmaGemmConfig(16, 16, 1, 1, programs=3), tg.TmaGemmConfig(16, 16, 1, 1, programs=7),
                           tg.TmaGemmConfig(16, 16, 1, 1, programs=50), tg.TmaGemmConfig(32, 32, 1, 1, programs=2,
                                                                                         whole_tiles=True)])


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_tma_linear_matches_reference(shape, config, dtype):
    M, N, K = shape
    x, w = rand(M, K, dtype=dtype), rand(N, K, dtype=dtype) / K ** 0.5
    out = tg.tma_linear(x, w, config)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, x.float() @ w.float().t()) < TOLERANCE[dtype]
    again = tg.tma_linear(x, w, config)
    assert torch.equal(out, again), "the stream-K sum depends on arrival order or on a stale counter"
    assert not split_workspace._WORKSPACES[x.device][1].any(), "an arrival counter was left non-zero"


@pytest.mark.parametrize("config", CONFIGS[:3], ids=repr)
def test_plan_covers_every_iteration_once(config):
    """Every (tile, k step) falls in exactly one program's range, and no program is empty."""
    for M, N, K in SHAPES:
        k_iters, total, chunk, programs = tg.plan(M, N, K, config, sms=132 if ON_GPU else 4)
        assert programs * chunk >= total > (programs - 1) * chunk
        if config.whole_tiles:
            assert chunk % k_iters == 0


def test_bad_input_is_refused():
    dtype = DTYPES[0]
    w = rand(16, 32, dtype=dtype)
    with pytest.raises(AssertionError, match="contiguous"):
        tg.tma_linear(rand(32, 16, dtype=dtype).t(), w)
    with pytest.raises(AssertionError, match="vs weight"):
        tg.tma_linear(rand(16, 24, dtype=dtype), w)
    with pytest.raises(AssertionError, match="at most 256 rows"):
        tg.tma_linear(rand(257, 32, dtype=dtype), w)
    too_deep = tg.TmaGemmConfig(128, 128, 3, 8)  # 3 x (128 + 256) x 128 x 2 bytes of stages: more than 227 KB
    assert not tg.fits(too_deep, 256, 4096) and tg.fits(too_deep, 128, 4096)
    if ON_GPU:
        with pytest.raises(AssertionError, match="does not fit"):
            tg.tma_linear(rand(256, 4096, dtype=dtype), rand(128, 4096, dtype=dtype), too_deep)
    assert tg.tma_linear(rand(0, 32, dtype=dtype), w).shape == (0, 16)
