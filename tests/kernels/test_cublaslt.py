"""cuBLASLt through ctypes (``pdpool.kernels.cublaslt``; the tenth pass's algorithm search, measured, not used by
the model): the heuristic's candidates and their split-K variants against an fp32 reference, two launches and a
CUDA-graph replay bit for bit equal. GPU only: the library is the one torch loads for CUDA."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import ON_GPU, TOLERANCE, rel_err  # noqa: I001  (first)

pytestmark = pytest.mark.skipif(not ON_GPU, reason="cuBLASLt is loaded by torch's CUDA build only")

SHAPES = [(192, 6144, 4096), (256, 4096, 14336), (37, 4096, 4096)]  # (M, N, K)


@pytest.mark.parametrize("shape", SHAPES)
def test_candidates_match_reference_and_replay(shape):
    from pdpool.kernels import cublaslt

    M, N, K = shape
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    ref = x.float() @ w.float().t()
    lt = cublaslt.LtGemm(M, N, K)
    heur = lt.heuristic(8)
    assert heur, "the heuristic returned no algorithm"
    for cand in heur[:3] + lt.split_variants(heur[:1])[:3]:
        out = lt(x, w, cand)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], cand.label
        assert torch.equal(out, lt(x, w, cand)), f"{cand.label}: two launches differ"
        graph, static = torch.cuda.CUDAGraph(), torch.empty_like(out)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lt(x, w, cand, out=static)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            lt(x, w, cand, out=static)
        static.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, out), f"{cand.label}: the graph replay differs from the eager launch"


def test_wrong_shape_is_refused():
    from pdpool.kernels import cublaslt

    lt = cublaslt.LtGemm(16, 64, 128)
    x = torch.randn(16, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="vs"):
        lt(x, torch.randn(64, 96, device="cuda", dtype=torch.bfloat16), lt.heuristic(1)[0])
