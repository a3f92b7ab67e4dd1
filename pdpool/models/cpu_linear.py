"""oneDNN linear layers on the CPU, weights repacked once at load.

``F.linear`` on the CPU reorders the weight into oneDNN's blocked layout on every call; at decode sizes that is a
large part of the step. ``torch.ops.mkldnn._reorder_linear_weight`` does it once, and
``torch.ops.mkldnn._linear_pointwise`` runs the GEMM on the packed weight. Measured on this 2-core machine
(docs/performance.md, "CPU linear layers"): 1.2-1.6x faster than ``F.linear`` at 64 rows on every layer shape,
about equal at 512 rows, so the packed path is used up to ``PACKED_MAX_ROWS`` rows and ``F.linear`` above.

Only fp32 weights on the CPU, and only when this torch build has the ops and they agree with ``F.linear`` on a tiny
case; otherwise nothing changes. The GPU path is untouched. A weight changed in place after packing (its
``_version`` moves) is packed again before its next use.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PACKED_MAX_ROWS = 128  # measured win at 64 rows, parity at 512 (docs/performance.md)


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
    """A weight [N, K] fp32 on the CPU and its oneDNN-packed copy, repacked when the weight changes in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self._version = -1
        self._packed: torch.Tensor | None = None

    def packed(self) -> torch.Tensor:
        if self._version != self.weight._version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
            self._version = self.weight._version
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or rows > PACKED_MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed(), bias, "none", [], "")


class PackedLinear(nn.Module):
    """Stands in for an fp32 CPU ``nn.Linear``: the same ``weight`` and ``bias`` parameters (same state-dict
    keys), run through their packed copy."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.packed_weight = PackedWeight(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed_weight(x)


def eligible(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def pack_cpu_linears(model: nn.Module) -> int:
    """Route every fp32 CPU ``nn.Linear`` of ``model`` (and its logits weight) through the packed oneDNN path.
    Returns how many weights were packed (0 when the ops are unavailable or the model is not on the CPU)."""
    if not packed_linear_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and eligible(child.weight):
                packed = PackedLinear(child)
                packed.packed_weight.packed()
                setattr(parent, name, packed)
                count += 1
    if hasattr(model, "logits_linear"):
        tied = getattr(model, "tie_word_embeddings", False)
        weight = model.model.embed_tokens.weight if tied else model.lm_head.weight
        if eligible(weight):
            model.logits_linear = PackedWeight(weight)
            model.logits_linear.packed()
            count += 1
    return count
