"""A Hopper decode GEMM: ``out[M, N] = x[M, K] @ W[N, K]^T`` for M <= 256 rows, persistent and stream-K, its tiles
loaded by TMA (host tensor descriptors), the weight on the MMA's M side (swap-AB) and all batch rows in one tile,
so each weight tile is read from HBM once.

Issue 13, tenth pass: the fourth pass's skinny kernel (``skinny_gemm.py``) lost to cuBLAS from 128 rows up; this
one adds TMA, a persistent grid of one program per SM, and a stream-K split of the work so that no SM idles in a
wave tail (``gate_up`` at 128-row weight tiles is 224 tiles on 132 SMs; ``down`` is only 32 tiles)::

    iterations: tile t = weight rows t*BW.., k step j = cols j*BK..;   global index i = t * K_ITERS + j
    program p runs i in [p*CHUNK, min((p+1)*CHUNK, TOTAL)), tile by tile:

    | tile 0 ........ | tile 1 ........ | tile 2 ........ |        (K_ITERS each)
    | p0 ......... | p1 ......... | p2 ......... | p3 ...           (CHUNK each)

    a segment covering its whole tile stores the tile; a partial one stores its fp32 tile in its program's slot
    (slot 0: the segment that starts the program's range, slot 1: the one that ends it) and counts itself in;
    the tile's last segment to arrive adds the slots of programs first..last in that order (fixed: bitwise
    deterministic for a given CHUNK) and stores the tile.

``CHUNK`` a multiple of ``K_ITERS`` gives a plain persistent data-parallel GEMM (no partial tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import dot_precision
from pdpool.kernels.split_workspace import MAX_TILES, split_workspace

MAX_ROWS = 256
SMEM_BYTES = 227 * 1024 - 8192  # H100's per-block shared memory, less what the compiler adds beside the stages


# the row count and the split's sizes change with the batch: not specialized, so one compile per row tile
@triton.jit(do_not_specialize=["M", "N", "K_ITERS", "TOTAL", "CHUNK"])
def _tma_gemm_kernel(w_desc, x_desc, out_ptr, ws_ptr, counts_ptr, M, N, K_ITERS, TOTAL, CHUNK, stride_o,
                     PRECISION: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    it = pid * CHUNK
    end = tl.minimum(it + CHUNK, TOTAL)
    rw = tl.arange(0, BLOCK_W)
    rx = tl.arange(0, BLOCK_X)
    offs = rw[:, None] * BLOCK_X + rx[None, :]  # a [BW, BX] fp32 tile in a workspace slot
    while it < end:
        tile = it // K_ITERS
        tile_lo = tile * K_ITERS
        seg_end = tl.minimum(end, tile_lo + K_ITERS)
        acc = tl.zeros([BLOCK_W, BLOCK_X], dtype=tl.float32)  # acc[w, x] = out[x, w]
        for j in tl.range(it - tile_lo, seg_end - tile_lo, num_stages=NUM_STAGES):
            wt = w_desc.load([tile * BLOCK_W, j * BLOCK_K])  # [BW, BK]
            xt = x_desc.load([0, j * BLOCK_K])  # [BX, BK]; rows past M read as zeros
            acc = tl.dot(wt, tl.trans(xt), acc, input_precision=PRECISION)
        cols = tile * BLOCK_W + rw
        out_ptrs = out_ptr + rx[None, :].to(tl.int64) * stride_o + cols[:, None]
        out_ok = (rx < M)[None, :] & (cols < N)[:, None]
        if (it == tile_lo) & (seg_end == tile_lo + K_ITERS):
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            slot = pid * 2 + (it != pid * CHUNK).to(tl.int32)
            tl.store(ws_ptr + slot.to(tl.int64) * (BLOCK_W * BLOCK_X) + offs, acc)
            tl.debug_barrier()  # every thread's partial is stored before the count
            first = tile_lo // CHUNK
            last = tl.minimum((tile_lo + K_ITERS - 1) // CHUNK, tl.cdiv(TOTAL, CHUNK) - 1)
            arrived = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:
                total = tl.zeros([BLOCK_W, BLOCK_X], dtype=tl.float32)
                for q in range(first, last + 1):
                    # program q's segment of this tile is its slot 0 if q's range starts inside the tile
                    q_slot = q * 2 + (q * CHUNK < tile_lo).to(tl.int32)
                    total += tl.load(ws_ptr + q_slot.to(tl.int64) * (BLOCK_W * BLOCK_X) + offs,
                                     cache_modifier=".cg")
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(counts_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        it = seg_end


@dataclass(frozen=True)
class TmaGemmConfig:
    """One launch shape: weight rows per tile, K per step, pipeline depth, warps, and the stream-K split
    (``programs``: the persistent grid, default one per SM; ``whole_tiles``: CHUNK rounded up to whole tiles, so
    no partial tiles)."""

    block_w: int = 128
    block_k: int = 64
    stages: int = 4
    warps: int = 8
    programs: int | None = None
    whole_tiles: bool = False

    def __repr__(self) -> str:
        return (f"tma(bw={self.block_w},bk={self.block_k},st={self.stages},w={self.warps},"
                f"p={self.programs},{'dp' if self.whole_tiles else 'sk'})")


def row_tile(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def fits(cfg: TmaGemmConfig, m: int, k: int) -> bool:
    """The config's pipeline stages fit in shared memory for this row tile, its accumulator in registers, and K is
    a whole number of its steps."""
    bx = row_tile(m)
    return ((cfg.block_w + bx) * cfg.block_k * 2 * cfg.stages <= SMEM_BYTES and cfg.block_w * bx <= 128 * 256
            and k % cfg.block_k == 0)


def plan(M: int, N: int, K: int, cfg: TmaGemmConfig, sms: int) -> tuple[int, int, int, int]:
    """(K_ITERS, TOTAL, CHUNK, programs) of a launch."""
    k_iters = triton.cdiv(K, cfg.block_k)
    total = triton.cdiv(N, cfg.block_w) * k_iters
    programs = min(cfg.programs or sms, total)
    chunk = triton.cdiv(total, programs)
    if cfg.whole_tiles:
        chunk = triton.cdiv(chunk, k_iters) * k_iters
    return k_iters, total, chunk, triton.cdiv(total, chunk)


def tma_linear(x: torch.Tensor, weight: torch.Tensor, cfg: TmaGemmConfig | None = None,
               sms: int | None = None) -> torch.Tensor:
    """x: [M, K] contiguous, M <= 256; weight: [N, K] contiguous -> [M, N] = F.linear(x, weight)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    assert x.dim() == 2 and x.is_contiguous(), f"x: contiguous [M, K], got {tuple(x.shape)} {x.stride()}"
    assert weight.dim() == 2 and weight.is_contiguous(), "weight: contiguous [N, K]"
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and x.dtype == weight.dtype and x.device == weight.device, \
        f"x {tuple(x.shape)} {x.dtype} vs weight {tuple(weight.shape)} {weight.dtype}"
    assert M <= MAX_ROWS, f"at most {MAX_ROWS} rows, got {M}"
    assert (K * x.element_size()) % 16 == 0, f"TMA needs 16-byte row strides: K {K} of {x.dtype}"
    cfg = cfg or TmaGemmConfig()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    assert not x.is_cuda or fits(cfg, M, K), f"{cfg} does not fit {M} rows x K {K} (shared memory, registers, K)"
    if sms is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    bx = row_tile(M)
    k_iters, total, chunk, programs = plan(M, N, K, cfg, sms)
    assert triton.cdiv(N, cfg.block_w) <= MAX_TILES
    ws, counts = split_workspace(2 * programs * cfg.block_w * bx, x.device)
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_w, cfg.block_k])
    x_desc = TensorDescriptor.from_tensor(x, [bx, cfg.block_k])
    _tma_gemm_kernel[(programs,)](w_desc, x_desc, out, ws, counts, M, N, k_iters, total, chunk, out.stride(0),
                                  PRECISION=dot_precision(x.dtype), BLOCK_W=cfg.block_w, BLOCK_X=bx,
                                  BLOCK_K=cfg.block_k, NUM_STAGES=cfg.stages, num_warps=cfg.warps,
                                  num_stages=cfg.stages)
    return out
