"""Pinned host buffers reused across steps, so a step's host-to-device and device-to-host copies allocate nothing.

``PinnedRing``: the runner packs each step's int64 inputs straight into one of a few pinned buffers, taken in turn,
and copies it to the device from there (before: a pageable numpy array, then ``pin_memory()``, which checks the
pointer, takes a block from torch's pinned allocator and copies it). A buffer is written again only once the copy
that read it has run: an event recorded after that copy, waited for (in practice long done) before reuse::

    slot:   | 0: step N-3 (copied) | 1: step N-2 (copied) | 2: step N-1 | 3: step N (packing) |

``PinnedPool``: the sampler's device-to-host copies of each step's samples land in pinned buffers kept by shape, each
with its event; a set goes back to the pool once its reader has read it.
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedRing:
    def __init__(self, slots: int = 4) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events = [torch.cuda.Event() for _ in range(slots)]
        self._pending = [False] * slots  # a copy reading the buffer was queued (its event recorded)
        self._next = 0

    def concatenate(self, parts: list) -> tuple[np.ndarray, torch.Tensor, int]:
        """``np.concatenate(parts)`` as int64, written into the next pinned buffer: (host array, the same memory as
        a torch tensor, slot). Call ``copied(slot)`` right after queuing the copy that reads it."""
        n = sum(len(p) for p in parts)
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        if self._pending[slot]:
            self._events[slot].synchronize()
            self._pending[slot] = False
        buf = self._buffers[slot]
        if buf is None or buf.numel() < n:
            size = max(n, 2 * buf.numel() if buf is not None else 4096)
            buf = self._buffers[slot] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        tensor = buf[:n]
        host = tensor.numpy()
        np.concatenate(parts, out=host, casting="same_kind")
        return host, tensor, slot

    def copied(self, slot: int) -> None:
        self._events[slot].record()
        self._pending[slot] = True


class PinnedPool:
    """Pinned host tensors for a set of device tensors' shapes and dtypes, with the event that marks their copy."""

    def __init__(self) -> None:
        self._free: dict[tuple, list] = {}

    def take(self, like: tuple[torch.Tensor, ...]) -> tuple[tuple, tuple[torch.Tensor, ...], torch.cuda.Event]:
        key = tuple((tuple(t.shape), t.dtype) for t in like)
        free = self._free.get(key)
        if free:
            tensors, event = free.pop()
        else:
            tensors = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in like)
            event = torch.cuda.Event()
        return key, tensors, event

    def give_back(self, key: tuple, tensors: tuple[torch.Tensor, ...], event) -> None:
        """Only after the copy into ``tensors`` completed and they were read."""
        self._free.setdefault(key, []).append((tensors, event))
