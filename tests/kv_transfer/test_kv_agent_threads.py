"""KVAgent with NIXL's UCX thread pool (``num_threads``, ``split_batch_size``), and the poll interval.

Two agents in this process (NIXL allows it), host memory, ``UCX_TLS=tcp,self``. With ``split_batch_size=4`` a
transfer of 12 one-block descriptors is posted in chunks by the pool's threads; every byte must still land.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from pdpool.kv_transfer.agent import _POLL_S, KVAgent, _poll_interval

SHAPE = (24, 2, 2, 16, 2, 8)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
TIMEOUT = 20.0


def make_pair(**agent_args):
    holder = KVAgent("holder#t", ucx_tls="tcp,self", **agent_args)
    reader = KVAgent("reader#t", ucx_tls="tcp,self", **agent_args)
    src = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)
    dst = torch.full(SHAPE, float("nan"))
    holder.register_kv_cache(src)
    reader.register_kv_cache(dst)
    peer = reader.add_peer(holder.metadata())
    holder.add_peer(reader.metadata())
    return holder, reader, peer, src, dst


@pytest.mark.parametrize("agent_args", [dict(), dict(num_threads=2, split_batch_size=4)])
def test_shuffled_read_is_exact(agent_args):
    holder, reader, peer, src, dst = make_pair(**agent_args)
    try:
        rng = random.Random(0)
        remote_ids, local_ids = rng.sample(range(SHAPE[0]), 12), rng.sample(range(SHAPE[0]), 12)
        reader.read_blocks(peer, remote_block_ids=remote_ids, local_block_ids=local_ids, timeout=TIMEOUT)
        assert torch.equal(dst[local_ids], src[remote_ids])
        assert reader.stats.descriptors == 12  # no two pairs adjacent on both sides with this seed
    finally:
        reader.close()
        holder.close()


def test_poll_interval_grows_with_the_wait_and_is_capped():
    assert _poll_interval(0.0, _POLL_S) == 0.0                      # spin at first
    assert _poll_interval(0.0032, _POLL_S) == pytest.approx(1e-4)   # 1/32 of the time waited
    assert _poll_interval(10.0, _POLL_S) == _POLL_S


def test_an_idle_agent_does_not_spin():
    """NIXL's Python API sets its progress thread's idle delay to 0, and the thread then polls UCX without pause
    (an idle agent took 99% of a core; every pool node has one). KVAgent builds it with a delay: measured in a
    child process, whose CPU time is its own alone, an idle agent with a registered cache takes a few percent."""
    code = (
        "import time, torch\n"
        "from pdpool.kv_transfer.agent import KVAgent\n"
        "agent = KVAgent('idle#t', ucx_tls='tcp,self')\n"
        "agent.register_kv_cache(torch.zeros(4, 1, 2, 16, 1, 8))\n"
        "cpu, wall = time.process_time(), time.monotonic()\n"
        "time.sleep(2.0)\n"
        "print((time.process_time() - cpu) / (time.monotonic() - wall))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    busy = float(out.stdout.strip().splitlines()[-1])
    assert busy < 0.3, f"an idle agent used {busy:.0%} of a core"
