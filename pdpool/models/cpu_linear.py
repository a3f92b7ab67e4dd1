"""Linear layers on the CPU at decode sizes: a native small-row kernel, oneDNN-packed weights, then ``F.linear``.

A decode step's GEMMs have few rows (M = the step's decode tokens) and read every weight once: they are a stream
over the weights. Per call, by row count (measured with ``benchmarks/bench_cpu_linear.py`` on this 2-core machine,
docs/performance.md, "Offline throughput on the CPU"):

    rows <= NATIVE_MAX_ROWS   the native kernel (kernels/csrc/linear_cpu.cpp) on the weight in place: each weight
                              row read once for all rows, the next rows prefetched; fp32 at 8 rows 1.3-1.6x the
                              oneDNN-packed path, about equal at 32-48; bf16/fp16 3-4x F.linear on AVX2
    rows <= PACKED_MAX_ROWS   fp32 only: oneDNN on a weight reordered once at load (``_reorder_linear_weight``,
                              ``_linear_pointwise``; ``F.linear`` reorders on every call): 1.2-1.6x F.linear at 64
                              rows, about equal at 512
    otherwise                 ``F.linear``

Each path is used only where it loads (the extension built, the oneDNN ops present and agreeing with ``F.linear``
on a tiny case); otherwise the next one serves. The GPU path is untouched. A weight changed in place after packing
(its ``_version`` moves) is packed again before its next use.

bf16/fp16 weights above NATIVE_MAX_ROWS go to ``F.linear``, which torch runs through oneDNN (ideep): one primitive
per (rows, N, K), JIT-compiled and kept in two caches, ideep's (``LRU_CACHE_CAPACITY``) and oneDNN's
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1024 entries each by default. With continuous batching a step's token count
changes nearly every step, so on a serving node these fill up: on the bf16 demo model about 2 MiB of RSS per new
token count, levelling off only at hundreds of MiB (docs/performance.md, "Node memory under load").
``bound_onednn_caches`` (called before the model's first CPU matmul) sets both to ``PDPOOL_ONEDNN_CACHE_CAPACITY``
entries unless the environment already names them.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from pdpool.kernels import cpu_decode

log = logging.getLogger(__name__)

PACKED_MAX_ROWS = 128  # measured win at 64 rows, parity at 512 (docs/performance.md)
NATIVE_MAX_ROWS = 32  # native kernel: fp32 1.05-1.2x packed at 24-32 rows, behind at 48 (bench_cpu_linear.py)
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ONEDNN_CACHE_ENV = "PDPOOL_ONEDNN_CACHE_CAPACITY"
DEFAULT_ONEDNN_CACHE_CAPACITY = 256  # entries of each cache; 0: leave torch's own (1024 each)


def bound_onednn_caches() -> int | None:
    """Bound oneDNN's primitive cache and ideep's LRU cache to ``$PDPOOL_ONEDNN_CACHE_CAPACITY`` entries each
    (default DEFAULT_ONEDNN_CACHE_CAPACITY; 0 leaves both at torch's 1024), unless the environment already sets
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` / ``DNNL_PRIMITIVE_CACHE_CAPACITY`` or ``LRU_CACHE_CAPACITY``. Both
    libraries read these variables when their cache is first built: this must run before the process's first
    oneDNN op, or it changes nothing. Returns the capacity set, or None when it left them as they were."""
    raw = os.environ.get(ONEDNN_CACHE_ENV, "").strip()
    try:
        capacity = int(raw) if raw else DEFAULT_ONEDNN_CACHE_CAPACITY
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", ONEDNN_CACHE_ENV, raw, DEFAULT_ONEDNN_CACHE_CAPACITY)
        capacity = DEFAULT_ONEDNN_CACHE_CAPACITY
    if capacity <= 0:
        return None
    if not any(name in os.environ for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")):
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))  # ideep's; 0 there crashes, so only >= 1 is set
    return capacity


def native_linear_available() -> bool:
    """True when the CPU extension (kernels/csrc/linear_cpu.cpp) is built and loads."""
    return cpu_decode.available()


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, by the native small-row kernel: every
    weight row read once for all rows of x. Meant for few rows (decode steps); any row count is correct."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the native linear takes CPU tensors")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected x [..., K], weight [N, K]")
    if x.dtype not in NATIVE_DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one dtype of {NATIVE_DTYPES}; got {x.dtype}, "
                         f"{weight.dtype}, {None if bias is None else bias.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}]; got {tuple(bias.shape)}")
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # [M, K]
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
    error = cpu_decode.load().small_linear(rows, weight.detach().contiguous(),
                                           None if bias is None else bias.detach().contiguous(), out)
    if error:
        raise ValueError(f"native linear (cpu): {error}")
    return out.reshape(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=1)
def packed_linear_available() -> bool:
    """True when this torch build's oneDNN ops exist and match F.linear on a tiny fp32 case."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        ops = torch.ops.mkldnn
        if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
        x = torch.randn(3, 16, generator=gen)
        packed = ops._reorder_linear_weight(w, 3)
        out = ops._linear_pointwise(x, packed, b, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, w, b), rtol=1e-4, atol=1e-5))
    except Exception as exc:  # noqa: BLE001 - any failure means the build cannot do it: fall back
        log.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False


class PackedWeight:
    """A weight [N, K] on the CPU and the paths that run it by row count (module docstring); fp32 weights also keep
    a oneDNN-packed copy, repacked when the weight changes in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self._version = -1
        self._packed: torch.Tensor | None = None
        self.native = (native_linear_available() and weight.dtype in NATIVE_DTYPES and weight.is_contiguous()
                       and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())))
        self.packs = weight.dtype == torch.float32 and packed_linear_available()

    def packed(self) -> torch.Tensor:
        if self._version != self.weight._version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
            self._version = self.weight._version
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        if self.native and rows <= NATIVE_MAX_ROWS:
            return self._native(x, rows)
        if self.packs and rows <= PACKED_MAX_ROWS:
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed(), bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


    def _native(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """native_linear without its checks, which the weight passed at construction (about 15 us per call of
        Python, on a step of ~120 calls)."""
        flat = x if x.dim() == 2 else x.reshape(rows, x.shape[-1])  # [M, K]
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(rows, self.weight.shape[0], dtype=x.dtype)
        error = cpu_decode.load().small_linear(flat, self.weight, self.bias, out)
        if error:
            raise ValueError(f"native linear (cpu): {error}")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.weight.shape[0])


class PackedLinear(nn.Module):
    """Stands in for a CPU ``nn.Linear``: the same ``weight`` and ``bias`` parameters (same state-dict keys), run
    through ``PackedWeight``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.packed_weight = PackedWeight(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed_weight(x)


def eligible(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return packed_linear_available() or native_linear_available()
    return weight.dtype in NATIVE_DTYPES and native_linear_available()


def pack_cpu_linears(model: nn.Module) -> int:
    """Route every CPU ``nn.Linear`` of ``model`` (and its logits weight) through ``PackedWeight``: fp32 weights
    when the native kernel or the oneDNN ops are there, bf16/fp16 weights when the native kernel is. Returns how
    many weights were wrapped (0 when neither is available or the model is not on the CPU)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and eligible(child.weight):
                packed = PackedLinear(child)
                if packed.packed_weight.packs:
                    packed.packed_weight.packed()
                setattr(parent, name, packed)
                count += 1
    if hasattr(model, "logits_linear"):
        tied = getattr(model, "tie_word_embeddings", False)
        weight = model.model.embed_tokens.weight if tied else model.lm_head.weight
        if eligible(weight):
            model.logits_linear = PackedWeight(weight)
            if model.logits_linear.packs:
                model.logits_linear.packed()
            count += 1
    return count
