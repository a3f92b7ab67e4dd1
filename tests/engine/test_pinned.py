"""Pinned host buffers reused across steps (``pdpool.engine.pinned``): a buffer is never written while a queued copy
still reads it, and the samples' host buffers go back to the pool only once read. CUDA only (pinned memory and
events need a GPU); the device tool's GPU calls run these."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdpool.engine.pinned import PinnedPool, PinnedRing
from pdpool.engine.sampler import PendingSample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and CUDA events need a GPU")


def test_ring_buffers_are_not_overwritten_while_a_copy_reads_them():
    """Each step's packed buffer is copied behind a long kernel (the copies are still queued when the ring comes
    round to their buffer again); every device copy must hold its own step's values."""
    ring = PinnedRing(slots=3)
    busy = torch.randn(4096, 4096, device="cuda")
    copies, expected = [], []
    for step in range(12):
        parts = [np.arange(step, step + 100, dtype=np.int64), np.full(37 + step, -step, dtype=np.int64)]
        host, pinned, slot = ring.concatenate(parts)
        assert np.shares_memory(host, pinned.numpy()) and pinned.is_pinned()
        expected.append(np.concatenate(parts))
        for _ in range(3):
            busy = busy @ busy / 64  # keeps the stream busy so the copies below wait in the queue
        copies.append(pinned.to("cuda", non_blocking=True))
        ring.copied(slot)
    torch.cuda.synchronize()
    for dev, want in zip(copies, expected):
        assert np.array_equal(dev.cpu().numpy(), want)


def test_ring_grows_a_buffer_for_a_larger_step():
    ring = PinnedRing(slots=2)
    for n in (10, 5000, 20000, 7):
        host, pinned, slot = ring.concatenate([np.arange(n, dtype=np.int64)])
        assert host.shape == (n,) and np.array_equal(pinned.to("cuda").cpu().numpy(), np.arange(n))
        ring.copied(slot)


def test_pending_samples_from_a_pool_read_right_and_once():
    pool = PinnedPool()
    busy = torch.randn(2048, 2048, device="cuda")
    pending = []
    for step in range(8):
        for _ in range(2):
            busy = busy @ busy / 32
        ids = torch.arange(5, device="cuda") + 10 * step
        lp = torch.full((5,), -float(step), device="cuda")
        pending.append((step, PendingSample(ids, (lp,), None, {}, pool)))
        if step >= 2:  # read two steps behind, as the overlapped loop does (one behind) and more
            s, p = pending.pop(0)
            out = p.result()
            assert out.token_ids == [10 * s + i for i in range(5)] and out.logprobs == [-float(s)] * 5
            assert p.result() is out  # read once; the buffers went back to the pool
    for s, p in pending:
        assert p.result().token_ids == [10 * s + i for i in range(5)]
    key = ((5,), torch.int64), ((5,), torch.float32)
    assert len(pool._free[key]) >= 2  # reused, not one set per step
