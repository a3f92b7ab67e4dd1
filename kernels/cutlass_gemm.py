"""CUTLASS sm90a GEMMs for the decode projections through ctypes: ``out[M, N] = x[M, K] @ W[N, K]^T`` (bf16 in and
out, fp32 accumulate), on torch's current stream with a fixed workspace, so they can be captured in a CUDA graph.

Issue 13, eleventh pass: a measured candidate against cuBLAS (``benchmarks/bench_decode_gemm.py --methods
cutlass:all``), not wired into the model. The kernels are ``csrc/cutlass_decode_gemm.cu``, built off the GPU by
``benchmarks/build_cutlass_gemm.sh`` into ``.bench_cutlass/libcutlass_decode_gemm.so``; the library's path is an
argument of ``load`` or ``$PDPOOL_CUTLASS_GEMM_LIB``.

A config is ``<kernel>:<mode>``. Kernel names read ``{sw,pl}_{sk,pp}_<tile M'xN'xK'>_<cluster>``: ``sw`` swap-AB
(the weight rows are CUTLASS's M', the batch rows its N'), ``sk`` cooperative with the stream-K scheduler, ``pp``
ping-pong with the persistent scheduler. Modes of the ``sk`` kernels pick the scheduler's decomposition:

    heur   CUTLASS's heuristic         dp   data-parallel (whole tiles)
    sk     stream-K                    s2, s3, s4 ...   split-K into that many slices
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

KERNELS = (  # the CONFIG lines of csrc/cutlass_decode_gemm.cu, in order
    "sw_sk_128x64x64_1x1", "sw_sk_128x64x128_1x1", "sw_sk_128x64x64_2x1", "sw_pp_64x64x128_1x1",
    "sw_sk_128x128x64_1x1", "sw_sk_128x128x64_2x1", "sw_sk_128x128x64_1x2", "sw_pp_64x128x64_1x1",
    "sw_sk_128x192x64_1x1", "sw_sk_128x192x64_2x1", "sw_pp_64x192x64_1x1", "pl_sk_128x128x64_2x1",
    "sw_sk_128x256x64_1x1", "sw_sk_128x256x64_2x1", "sw_pp_64x256x64_1x1", "sw_sk_256x128x64_1x2",
)
MODES = {"heur": (0, 1), "dp": (1, 1), "sk": (3, 1)}  # name -> (CUTLASS DecompositionMode, splits)
WORKSPACE_BYTES = 64 << 20
DEFAULT_LIB = Path(__file__).resolve().parents[1] / ".bench_cutlass" / "libcutlass_decode_gemm.so"
ERRORS = {1: "cannot implement", 2: "workspace too small", 3: "initialize failed", 4: "launch failed"}

_LIB: ctypes.CDLL | None = None
_WORKSPACES: dict = {}


@dataclass(frozen=True)
class Kernel:
    name: str
    swap_ab: bool
    stream_k: bool
    tile: tuple[int, int, int]  # CUTLASS's M', N', K'
    cluster: tuple[int, int]

    @classmethod
    def parse(cls, name: str) -> "Kernel":
        side, sched, tile, cluster = name.split("_")
        return cls(name, side == "sw", sched == "sk", tuple(int(t) for t in tile.split("x")),
                   tuple(int(c) for c in cluster.split("x")))

    def row_tile(self) -> int:
        """The tile along the batch rows: N' when swapped, M' otherwise."""
        return self.tile[1] if self.swap_ab else self.tile[0]


def parse_config(config: str) -> tuple[Kernel, int, int]:
    """``'<kernel>:<mode>'`` -> (kernel, decomposition mode, splits); a ``pp`` kernel takes no mode."""
    name, _, mode = config.partition(":")
    if name not in KERNELS:
        raise ValueError(f"unknown CUTLASS kernel {name!r}; built: {', '.join(KERNELS)}")
    kernel = Kernel.parse(name)
    if not kernel.stream_k:
        if mode not in ("", "persistent"):
            raise ValueError(f"{name} is a persistent kernel, it takes no mode ({mode!r})")
        return kernel, 0, 1
    mode = mode or "heur"
    if mode in MODES:
        return kernel, *MODES[mode]
    if not (mode[0] == "s" and mode[1:].isdigit() and int(mode[1:]) > 1):
        raise ValueError(f"bad mode {mode!r}: heur, dp, sk or s<N> (split-K into N > 1 slices)")
    return kernel, 2, int(mode[1:])


def load(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """The built library (once per process); every kernel of ``KERNELS`` must be in it."""
    global _LIB
    if _LIB is None:
        path = path or os.environ.get("PDPOOL_CUTLASS_GEMM_LIB") or DEFAULT_LIB
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} is missing: run benchmarks/build_cutlass_gemm.sh")
        lib = ctypes.CDLL(str(path))
        for name in KERNELS:
            fn = getattr(lib, f"cutlass_gemm_{name}")
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_size_t] \
                + [ctypes.c_int] * 2 + [ctypes.c_void_p]
            need = getattr(lib, f"cutlass_gemm_{name}_workspace")
            need.restype = ctypes.c_size_t
            need.argtypes = [ctypes.c_int] * 5
        _LIB = lib
    return _LIB


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[device]


def workspace_bytes(config: str, M: int, N: int, K: int) -> int:
    kernel, mode, splits = parse_config(config)
    return getattr(load(), f"cutlass_gemm_{kernel.name}_workspace")(M, N, K, mode, splits)


def linear(x: torch.Tensor, weight: torch.Tensor, config: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` by one CUTLASS config; x: [M, K], weight: [N, K], both bf16 and contiguous."""
    kernel, mode, splits = parse_config(config)
    M, K = x.shape
    N = weight.shape[0]
    if not (x.dtype == weight.dtype == torch.bfloat16 and x.is_cuda and weight.device == x.device):
        raise ValueError(f"bf16 CUDA tensors on one device expected: {x.dtype} {x.device}, "
                         f"{weight.dtype} {weight.device}")
    if not (x.is_contiguous() and weight.is_contiguous() and weight.shape[1] == K):
        raise ValueError(f"x {tuple(x.shape)} / weight {tuple(weight.shape)}: contiguous [M, K] and [N, K] expected")
    if K % 8 or N % 8:
        raise ValueError(f"K {K} and N {N} must be multiples of 8 (16-byte TMA rows)")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    if not (out.shape == (M, N) and out.is_contiguous() and out.dtype == x.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: a contiguous [{M}, {N}] {x.dtype} tensor expected")
    if M == 0:
        return out
    ws = _workspace(x.device)
    status = getattr(load(), f"cutlass_gemm_{kernel.name}")(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), M, N, K, ws.data_ptr(), WORKSPACE_BYTES, mode, splits,
        torch.cuda.current_stream(x.device).cuda_stream)
    if status:
        raise RuntimeError(f"CUTLASS {config} at M {M} N {N} K {K}: {ERRORS.get(status, status)}")
    return out
