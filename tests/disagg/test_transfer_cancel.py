"""A pull whose wait is cancelled (an abort, the decode node's ``asyncio.wait_for``) is over before the cancellation
reaches the caller: NIXL writes nothing into the destination blocks afterwards, when the caller frees or recomputes
them.

Real NIXL (UCX ``tcp,self``) between this process and a spawned holder process. The holder is stopped (SIGSTOP) so
that a READ stays in flight; the wait is cancelled; the holder is resumed a little later. Releasing the NIXL request
would not do (the bytes of a released READ still land once the holder answers): the cancelled wait waits the READ
out. Once the caller sees the cancellation, its blocks are overwritten with a second sentinel that must stay.
Then a new READ from the same peer works.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from pdpool.kv_transfer.agent import KVAgent
from stopped import stop_process

UCX_TLS = "tcp,self"
SHAPE = (16, 4, 2, 16, 3, 64)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: 768 KiB a block
SENTINEL = -3.0


def known_kv() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)


def holder(metadata_out, stop) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    agent = KVAgent("holder#c1", ucx_tls=UCX_TLS)
    kv = known_kv()  # registered memory: referenced until return
    agent.register_kv_cache(kv)
    metadata_out.put(agent.metadata())
    stop.get(timeout=300)
    agent.close()


@pytest.fixture(scope="module")
def pair():
    ctx = mp.get_context("spawn")
    metadata, stop = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=holder, args=(metadata, stop), daemon=True)
    proc.start()
    agent = KVAgent("puller#c9", ucx_tls=UCX_TLS)
    kv = torch.full(SHAPE, SENTINEL)
    agent.register_kv_cache(kv)
    peer = agent.add_peer(metadata.get(timeout=120))
    agent.warm_up(peer, timeout=20)  # connected: the READs below wait on the holder only
    yield agent, kv, peer, proc
    os.kill(proc.pid, signal.SIGCONT)
    stop.put(None)
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    agent.close()


async def cancelled_mid_transfer(transfer, how: str, resume) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(transfer.wait_async(30.0))

    def resume_once_cancelled() -> None:
        # The holder resumes 0.5 s after the cancellation reached the wait, never before: on a loaded machine a
        # fixed timer could fire in the same loop iteration as the 0.3 s timeout, and the READ then completes
        # before wait_for looks (it returns the result instead of raising).
        if task.cancelling() or task.done():
            loop.call_later(0.5, resume)
        else:
            loop.call_later(0.05, resume_once_cancelled)

    resume_once_cancelled()
    if how == "cancel":
        await asyncio.sleep(0.3)
        assert not task.done()  # in flight: the holder is stopped
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:  # the decode node's asyncio.wait_for around the whole load
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(task, timeout=0.3)


@pytest.mark.parametrize("how", ["cancel", "wait_for"])
def test_a_cancelled_pull_writes_nothing_afterwards(pair, how):
    agent, kv, peer, proc = pair
    kv.fill_(SENTINEL)
    resumed = []

    def resume():
        os.kill(proc.pid, signal.SIGCONT)
        resumed.append(time.monotonic())

    stop_process(proc.pid)  # every thread stopped before the READ is posted
    try:
        transfer = agent.start_read(peer, remote_block_ids=list(range(16)), local_block_ids=list(range(16)))
        asyncio.run(cancelled_mid_transfer(transfer, how, resume))
        assert resumed and transfer.done  # the cancellation came after the holder answered, not at 0.3 s
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    kv.fill_(-SENTINEL)  # what the caller does with its blocks now (recompute)
    time.sleep(1.0)
    assert bool((kv == -SENTINEL).all()), "NIXL wrote into the blocks after the cancellation was seen"
    agent.read_blocks(peer, remote_block_ids=[3, 4], local_block_ids=[3, 4], timeout=20)
    assert torch.equal(kv[3:5], known_kv()[3:5])
    assert bool((kv[:3] == -SENTINEL).all()) and bool((kv[5:] == -SENTINEL).all())
