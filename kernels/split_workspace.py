"""The scratch of the split-K GEMMs (``skinny_gemm``, ``tma_gemm``): fp32 partial tiles and int32 arrival counters,
one pair per device, grown on demand. A kernel's last program to arrive at a tile resets its counter to zero, so
the counters are zero between launches; launches on one stream run in order, so the kernels can share the pair."""

from __future__ import annotations

import torch

MAX_TILES = 1 << 16  # arrival counters

_WORKSPACES: dict = {}  # device -> (fp32 partials, int32 counts)
_KEEP: list = []  # every grown buffer is kept: a captured graph holds its address


def split_workspace(elems: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """At least ``elems`` fp32 partials and the device's counters."""
    ws = _WORKSPACES.get(device)
    if ws is None or ws[0].numel() < max(elems, 1):
        ws = (torch.empty(max(elems, 1), dtype=torch.float32, device=device),
              ws[1] if ws is not None else torch.zeros(MAX_TILES, dtype=torch.int32, device=device))
        _WORKSPACES[device] = ws
        _KEEP.append(ws[0])
    return ws
