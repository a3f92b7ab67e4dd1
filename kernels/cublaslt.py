"""cuBLASLt through ctypes, for an explicit algorithm search on the decode GEMMs: ``out[M, N] = x[M, K] @ W[N, K]^T``
(bf16 in and out, fp32 accumulate), run on torch's current stream with a fixed workspace, so it can be captured in
a CUDA graph.

Issue 13, tenth pass. torch's ``F.linear`` takes cuBLAS's heuristic pick; this lists more of the library's own
candidates for one shape (the heuristic's top ``n``, their split-K variants, and the algorithm ids' tile x stages
configurations that ``cublasLtMatmulAlgoCheck`` accepts), for the caller to time in graph replays and keep the
fastest. The library is the ``libcublasLt`` that torch already loaded (found in ``/proc/self/maps``).

Column-major view, as torch calls it: D[N, M] = op(A) B with A = W as a K x N matrix (transposed), B = x as K x M.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

COMPUTE_32F = 68  # cublasComputeType_t
R_32F, R_16BF, R_16F = 0, 14, 2  # cudaDataType_t
DTYPES = {torch.bfloat16: R_16BF, torch.float16: R_16F}
DESC_TRANSA, DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_REDUCTION, CFG_SWIZZLE, CFG_CUSTOM, CFG_STAGES = 0, 1, 2, 3, 4, 5, 6
CAP_SPLITK, CAP_REDUCTION_MASK, CAP_TILE_IDS, CAP_STAGES_IDS = 0, 1, 6, 13
WORKSPACE_BYTES = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_LIB = None
_HANDLE = None
_WORKSPACES: dict = {}


def _lib() -> ctypes.CDLL:
    global _LIB, _HANDLE
    if _LIB is None:
        torch.ones(8, 8, device="cuda", dtype=torch.bfloat16) @ torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
        assert paths, "libcublasLt is not loaded by torch"
        _LIB = ctypes.CDLL(sorted(paths)[0])
        handle = ctypes.c_void_p()
        _check(_LIB.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _HANDLE = handle
    return _LIB


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[device]


@dataclass
class Candidate:
    algo: Algo
    label: str
    workspace: int


class LtGemm:
    """One (M, N, K, dtype) problem's descriptors, its candidate algorithms and a launcher."""

    def __init__(self, M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16):
        lib = _lib()
        self.M, self.N, self.K, self.dtype = M, N, K, dtype
        self.dt = DTYPES[dtype]
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "MatmulDescCreate")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "DescSetAttribute")
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for lay, rows, cols, ld in ((self.a, K, N, K), (self.b, K, M, K), (self.c, N, M, N)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), self.dt, ctypes.c_uint64(rows),
                                                  ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def heuristic(self, count: int) -> list[Candidate]:
        lib = _lib()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "PrefSet")
        results = (HeuristicResult * count)()
        returned = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_HANDLE, self.desc, self.a, self.b, self.c, self.c, pref, count,
                                                  results, ctypes.byref(returned)), "AlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        return [Candidate(results[i].algo, f"heur{i}:{self.describe(results[i].algo)}", results[i].workspace_size)
                for i in range(returned.value) if results[i].state == 0]

    def _config(self, algo: Algo, attr: int) -> int:
        v, written = ctypes.c_int32(0), ctypes.c_size_t(0)
        _lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4,
                                                     ctypes.byref(written))
        return v.value

    def _set(self, algo: Algo, attr: int, value: int) -> bool:
        v = ctypes.c_int32(value)
        return _lib().cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4) == 0

    def _cap(self, algo: Algo, attr: int) -> list[int]:
        lib, written = _lib(), ctypes.c_size_t(0)
        lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written))
        n = max(1, written.value // 4)
        buf = (ctypes.c_uint32 * n)()
        if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, 4 * n, ctypes.byref(written)):
            return []
        return list(buf[:written.value // 4])

    def describe(self, algo: Algo) -> str:
        return "id{} tile{} st{} sk{} red{} swz{}".format(*(self._config(algo, a) for a in (
            CFG_ID, CFG_TILE, CFG_STAGES, CFG_SPLITK, CFG_REDUCTION, CFG_SWIZZLE)))

    def check(self, algo: Algo) -> int | None:
        """The workspace the algorithm needs for this problem, or None if the library refuses it."""
        res = HeuristicResult()
        status = _lib().cublasLtMatmulAlgoCheck(_HANDLE, self.desc, self.a, self.b, self.c, self.c,
                                                ctypes.byref(algo), ctypes.byref(res))
        ok = status == 0 and res.state == 0 and res.workspace_size <= WORKSPACE_BYTES
        return res.workspace_size if ok else None

    def split_variants(self, base: list[Candidate], splits=(2, 3, 4, 8)) -> list[Candidate]:
        out = []
        for cand in base:
            if not (self._cap(cand.algo, CAP_SPLITK) or [0])[0]:
                continue
            mask = (self._cap(cand.algo, CAP_REDUCTION_MASK) or [0])[0]
            for split in splits:
                for scheme in (1, 2, 4):  # in place, compute-type workspace, output-type workspace
                    if not mask & scheme:
                        continue
                    algo = Algo.from_buffer_copy(cand.algo)
                    if self._set(algo, CFG_SPLITK, split) and self._set(algo, CFG_REDUCTION, scheme):
                        ws = self.check(algo)
                        if ws is not None:
                            out.append(Candidate(algo, f"{cand.label.split(':')[0]}+sk{split}r{scheme}", ws))
        return out

    def enumerate_ids(self, limit: int) -> list[Candidate]:
        """Every algorithm id's (tile, stages) pairs that the library accepts for this problem, up to ``limit``."""
        lib = _lib()
        ids = (ctypes.c_int * 256)()
        n = ctypes.c_int(0)
        if lib.cublasLtMatmulAlgoGetIds(_HANDLE, COMPUTE_32F, R_32F, self.dt, self.dt, self.dt, self.dt, 256, ids,
                                        ctypes.byref(n)):
            return []
        out = []
        for algo_id in ids[:n.value]:
            algo = Algo()
            if lib.cublasLtMatmulAlgoInit(_HANDLE, COMPUTE_32F, R_32F, self.dt, self.dt, self.dt, self.dt,
                                          algo_id, ctypes.byref(algo)):
                continue
            for tile in self._cap(algo, CAP_TILE_IDS) or [0]:
                for stages in self._cap(algo, CAP_STAGES_IDS) or [0]:
                    cand = Algo.from_buffer_copy(algo)
                    if self._set(cand, CFG_TILE, tile) and self._set(cand, CFG_STAGES, stages):
                        ws = self.check(cand)
                        if ws is not None:
                            out.append(Candidate(cand, f"enum:{self.describe(cand)}", ws))
                            if len(out) >= limit:
                                return out
        return out

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, cand: Candidate, out: torch.Tensor | None = None):
        assert x.shape == (self.M, self.K) and weight.shape == (self.N, self.K) and x.is_contiguous() \
            and weight.is_contiguous(), f"x {tuple(x.shape)} / weight {tuple(weight.shape)} vs {self.M, self.N, self.K}"
        out = torch.empty(self.M, self.N, dtype=x.dtype, device=x.device) if out is None else out
        ws = _workspace(x.device)
        _check(_lib().cublasLtMatmul(
            _HANDLE, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(weight.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), self.c,
            ctypes.c_void_p(out.data_ptr()), self.c, ctypes.byref(cand.algo), ctypes.c_void_p(ws.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)),
            "cublasLtMatmul")
        return out
