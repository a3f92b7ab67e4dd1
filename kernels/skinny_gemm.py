"""A decode-sized GEMM (16 <= M <= 256 rows): ``out[M, N] = x[M, K] @ W[N, K]^T``, each weight tile read by one
program for all of its rows. Measured against cuBLAS and NOT used by the model: kept, with its test and
``bench_decode_kernel.py --skinny``, as the measured starting point for a Hopper-specific kernel.

The idea (issue 13, fourth pass): at M ~ 200 a Llama-3.1-8B decode step's GEMMs took 6.5 ms against 4.7 ms to
stream their weights; cuBLAS tiles M in 128s (a 208-row batch reads the weights twice) and leaves a ragged last
wave on 132 SMs. Here one program covers up to 256 rows (``BLOCK_M``) and narrow projections split K::

    grid = (M tiles, N tiles, SPLIT_K)        program (m, n, s): rows m*BM.., weight rows n*BN.., K range s
    SWAP: acc[BN, BM] = W_tile @ x_tile^T     (the weight on the MMA's 64-row side; the rows on its N side)
    SPLIT_K > 1: each K range's fp32 tile goes to the workspace; the tile's last program to arrive adds the
                 ranges in order 0..S-1 (so the sum does not depend on arrival order) and writes the output

What the H100 said (docs/performance.md, fourth pass): from 128 rows up, the best of these configs is 0.65-0.93x
cuBLAS's speed (``gate_up`` at 208 rows: 119.9 us against 98.7 us); it wins only at 16 rows (1.03-1.08x) and on
the logits weight up to 64 rows. The x operand is re-read from L2 once per weight tile, and cuBLAS's sm90 kernels
share operand tiles across a 2-CTA cluster, which Triton does not do here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import configs, dot_precision
from pdpool.kernels.split_workspace import MAX_TILES, split_workspace

SPLIT_MAX_N = 8192  # K is split only for projections this narrow (few N tiles)


def _cfg(swap, bm, bn, bk, split, warps, stages):
    return triton.Config({"SWAP": swap, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
                         num_warps=warps, num_stages=stages)


GPU_CONFIGS = [
    _cfg(1, 256, 128, 64, 1, 8, 3),  # first: the PDPOOL_KERNEL_AUTOTUNE=0 config (one tile of rows, no split)
    _cfg(0, 256, 128, 64, 1, 8, 3),
    _cfg(1, 256, 64, 64, 1, 4, 4),
    _cfg(1, 128, 128, 64, 1, 4, 4),
    _cfg(0, 128, 128, 64, 1, 4, 4),
    _cfg(1, 128, 64, 128, 1, 4, 4),
    _cfg(1, 64, 128, 128, 1, 4, 4),
    _cfg(1, 32, 128, 128, 1, 4, 4),
    _cfg(1, 16, 128, 128, 1, 4, 5),
    _cfg(1, 256, 128, 64, 2, 8, 3),
    _cfg(1, 256, 128, 64, 4, 8, 3),
    _cfg(0, 256, 128, 64, 4, 8, 3),
    _cfg(1, 256, 64, 64, 2, 4, 4),
    _cfg(1, 128, 128, 64, 2, 4, 4),
    _cfg(1, 128, 128, 64, 4, 4, 4),
    _cfg(1, 64, 128, 128, 4, 4, 4),
    _cfg(1, 32, 128, 128, 4, 4, 4),
    _cfg(1, 16, 128, 128, 4, 4, 5),
]
# under the interpreter: small tiles and a K split, so the tests' shapes cross every mask and the reduction
INTERPRETER_CONFIG = _cfg(1, 16, 16, 16, 2, 1, 1)


def _fits(cfg: triton.Config, m_key: int, n: int) -> bool:
    """A config is tried for a key when its row tile is needed (not wider than the rows rounded up to a power of
    two), it reads each weight tile at most twice, and it splits K only for narrow projections."""
    bm, split = cfg.kwargs["BLOCK_M"], cfg.kwargs["SPLIT_K"]
    return bm <= triton.next_power_of_2(m_key) and triton.cdiv(m_key, bm) <= 2 and (split == 1 or n <= SPLIT_MAX_N)


def _prune(cfgs, nargs, **kwargs):
    kept = [c for c in cfgs if _fits(c, nargs["M_KEY"], nargs["N"])]
    return kept or cfgs[:1]


def _bench(fn, quantiles=None):
    return triton.testing.do_bench(fn, warmup=3, rep=12, quantiles=quantiles)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, counts_ptr, M, N, K, M_KEY, stride_x, stride_w, stride_o,
                   PRECISION: tl.constexpr, SWAP: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m = tl.program_id(0)  # row tiles of one weight tile are neighbours in launch order: the weight hits L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past the edge are masked, not clamped to the last row: clamped, every program read that one row's lines
    # once per padded row, and those requests all went to the same L2 slices (measured 2x slower at 192 rows)
    m_ok = (rm < M)[:, None]
    n_ok = (rn < N)[:, None]
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_span, K), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xt = tl.load(x_rows + cols[None, :], mask=m_ok, other=0.0)  # [BM, BK]
            wt = tl.load(w_rows + cols[None, :], mask=n_ok, other=0.0)  # [BN, BK]
        else:
            col_ok = (cols < K)[None, :]
            xt = tl.load(x_rows + cols[None, :], mask=m_ok & col_ok, other=0.0)
            wt = tl.load(w_rows + cols[None, :], mask=n_ok & col_ok, other=0.0)
        if SWAP:
            acc = tl.dot(wt, tl.trans(xt), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_o + rn[None, :]
    out_ok = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
        return
    tile = pid_n * tl.num_programs(0) + pid_m
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    parts = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(parts + pid_k * (BLOCK_M * BLOCK_N) + offs, acc)
    tl.debug_barrier()  # every thread's partial is stored before the count (as in the sampler's reduction)
    arrived = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.load(parts + offs, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(parts + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)
        tl.atomic_xchg(counts_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch


_even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % (a["BLOCK_K"] * a["SPLIT_K"]) == 0})
_tuned_kernel = triton.autotune(configs=configs(GPU_CONFIGS, interpreter=INTERPRETER_CONFIG), key=["M_KEY", "N", "K"],
                                prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)(
                                    _even_k(_skinny_kernel))
_one_config_kernel = _even_k(_skinny_kernel)


def row_key(m: int) -> int:
    return -(-m // 16) * 16


def _workspace_need(m_key: int, n: int, cfgs: list[triton.Config]) -> int:
    need = 0
    for c in cfgs:
        bm, bn, split = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"]
        if split > 1 and (_fits(c, m_key, n) or c is cfgs[0]):
            need = max(need, triton.cdiv(m_key, bm) * triton.cdiv(n, bn) * split * bm * bn)
    return need


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: triton.Config | None = None) -> torch.Tensor:
    """x: [M, K] (last dim contiguous), weight: [N, K] row-major -> [M, N] = F.linear(x, weight), by the kernel.
    ``config``: launch that config (tests) instead of the tuned choice."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x: [M, K] with contiguous rows, got {tuple(x.shape)} {x.stride()}"
    assert weight.dim() == 2 and weight.stride(-1) == 1, "weight rows must be contiguous"
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and x.dtype == weight.dtype and x.device == weight.device, \
        f"x {tuple(x.shape)} {x.dtype} vs weight {tuple(weight.shape)} {weight.dtype}"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    m_key = row_key(M)
    cfgs = [config] if config is not None else _tuned_kernel.configs
    ws, counts = split_workspace(_workspace_need(m_key, N, cfgs), x.device)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]),  # noqa: E731
                         meta["SPLIT_K"])
    args = (x, weight, out, ws, counts, M, N, K, m_key, x.stride(0), weight.stride(0), out.stride(0))
    precision = dot_precision(x.dtype)
    if config is not None:
        meta = config.kwargs
        assert triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]) <= MAX_TILES
        _one_config_kernel[grid(meta)](*args, PRECISION=precision, **meta, num_warps=config.num_warps,
                                   num_stages=config.num_stages)
    else:
        _tuned_kernel[grid](*args, PRECISION=precision)
    return out


def skinny_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight.float().t()
