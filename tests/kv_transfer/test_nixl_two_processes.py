"""Real NIXL transfers (UCX, host memory) between this process and a spawned peer process.

The peer plays the prefill node: its KV tensor (pdpool's layout) holds known values; it publishes its agent
metadata through the real Redis index. This process plays the decode node: it fills its blocks with garbage,
pulls non-contiguous blocks with READ and checks every byte; the peer then pushes blocks into us with WRITE.
Notifications travel both ways. Finally the peer is killed and a transfer to it must raise KVTransferError.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from pdpool.kv_index import IndexReader, NodeIndex, NodeInfo, PoolKeys, connect
from pdpool.kv_transfer.agent import KVAgent, KVTransferError
from stopped import stop_process

UCX_TLS = "tcp,self"  # works on any host; "cma,tcp,self" adds zero-copy same-host reads (see the benchmark)
SHAPE = (16, 4, 2, 16, 3, 64)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
KEYS = PoolKeys("ns", "pool")
TIMEOUT = 20.0


def known_kv() -> torch.Tensor:
    """Every element distinct (exact in float32), so a misplaced byte range cannot go unnoticed."""
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)


def _node_index(redis_url: str, password: str, node_id: str, incarnation: str) -> NodeIndex:
    return NodeIndex(connect(redis_url, password, timeout=2.0), KEYS, node_id, incarnation, heartbeat_ttl=60)


def prefill_peer(redis_url: str, password: str, commands, results) -> None:
    """The peer process: serve READs, then WRITE into the decode node when told to."""
    os.environ["OMP_NUM_THREADS"] = "1"
    agent = KVAgent("prefill-0#inc1", ucx_tls=UCX_TLS)
    kv = known_kv()  # stays referenced (registered memory) until this function returns
    agent.register_kv_cache(kv)
    index = _node_index(redis_url, password, "prefill-0", "inc1")
    index.set_agent_metadata(agent.metadata())
    index.heartbeat(NodeInfo("prefill-0", "prefill", "http://127.0.0.1:1", "inc1", agent_name=agent.name))
    results.put(("ready", None))
    while True:
        cmd, arg = commands.get(timeout=120)
        if cmd == "wait-notif":
            agent.wait_notif(None, arg, TIMEOUT)
            results.put(("notif", arg))
        elif cmd == "push":
            node_id, incarnation, remote_ids, local_ids, notif = arg
            md = IndexReader(connect(redis_url, password), KEYS).agent_metadata(node_id, incarnation)
            peer = agent.add_peer(md)
            agent.write_blocks(peer, remote_block_ids=remote_ids, local_block_ids=local_ids, notif=notif,
                               timeout=TIMEOUT)
            results.put(("pushed", agent.stats.bytes_written))
        elif cmd == "exit":
            agent.close()
            return


@pytest.fixture(scope="module")
def pair():
    """(redis server, our agent, our KV tensor, peer name, command queue, result queue, peer process)."""
    from redis_server import RedisServer

    with RedisServer(password="s3cret") as server:
        ctx = mp.get_context("spawn")
        commands, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=prefill_peer, args=(server.url, server.password, commands, results),
                           daemon=True)
        proc.start()
        agent = KVAgent("decode-0#inc9", ucx_tls=UCX_TLS)
        kv = torch.full(SHAPE, float("nan"))
        agent.register_kv_cache(kv)
        index = _node_index(server.url, server.password, "decode-0", "inc9")
        assert index.set_agent_metadata(agent.metadata())
        assert results.get(timeout=60) == ("ready", None)
        md = IndexReader(connect(server.url, server.password), KEYS).agent_metadata("prefill-0", "inc1")
        peer = agent.add_peer(md)
        assert agent.add_peer(md) == peer == "prefill-0#inc1"  # idempotent
        yield server, agent, kv, peer, commands, results, proc
        if proc.is_alive():
            commands.put(("exit", None))
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        agent.close()


def test_pull_non_contiguous_blocks_with_read(pair):
    _, agent, kv, peer, commands, results, _ = pair
    kv.normal_()  # garbage
    remote_ids, local_ids = [2, 3, 4, 9, 15, 0], [10, 11, 12, 1, 5, 7]
    commands.put(("wait-notif", b"pulled:req-1"))
    agent.read_blocks(peer, remote_block_ids=remote_ids, local_block_ids=local_ids, notif=b"pulled:req-1",
                      timeout=TIMEOUT)
    src = known_kv()
    assert torch.equal(kv[local_ids], src[remote_ids])  # bit-exact
    untouched = [b for b in range(SHAPE[0]) if b not in local_ids]
    assert not torch.equal(kv[untouched], src[untouched])
    assert results.get(timeout=TIMEOUT) == ("notif", b"pulled:req-1")
    block_bytes = kv[0].numel() * 4
    assert agent.stats.bytes_read == len(remote_ids) * block_bytes
    assert agent.stats.descriptors == 4  # runs: 2-4->10-12, 9->1, 15->5, 0->7
    assert agent.stats.warmups == 1


def test_pull_from_an_asyncio_loop(pair):
    """``wait_async`` leaves the event loop free while a pull is outstanding.

    The peer is stopped (SIGSTOP) before the READ is posted, so over TCP the READ cannot complete until it
    resumes. The pull task polls it; another task on the same loop then finds it still pending, and only that
    task resumes the peer. So the pull can end only if the loop ran other work while the transfer was
    outstanding: a wait that held the loop would time out instead. No outcome depends on timing."""
    _, agent, kv, peer, _, _, proc = pair
    agent.read_blocks(peer, remote_block_ids=[0], local_block_ids=[0], timeout=TIMEOUT)  # connected and warm
    kv.zero_()
    events = []

    async def pull_while_the_peer_is_stopped():
        pending = agent.start_read(peer, remote_block_ids=list(range(16)), local_block_ids=list(range(16)))
        pull = asyncio.create_task(pending.wait_async(TIMEOUT))
        for _ in range(50):  # the pull task runs between these turns (it was ready first) and polls
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)  # and through timed sleeps of its own
        events.append(("pending", pull.done(), pending.done))
        os.kill(proc.pid, signal.SIGCONT)
        events.append("resumed")
        await pull
        events.append(("done", pending.done))

    stop_process(proc.pid)
    try:
        asyncio.run(pull_while_the_peer_is_stopped())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert events == [("pending", False, False), "resumed", ("done", True)]
    assert torch.equal(kv, known_kv())


def test_push_with_write(pair):
    _, agent, kv, _, commands, results, _ = pair
    kv.fill_(-7.0)
    remote_ids, local_ids = [0, 1, 6, 7, 8], [5, 6, 12, 13, 3]  # ours are "remote" for the pushing peer
    commands.put(("push", ("decode-0", "inc9", remote_ids, local_ids, b"pushed:req-2")))
    agent.wait_notif("prefill-0#inc1", b"pushed:req-2", TIMEOUT)  # a WRITE's notif follows its data
    src = known_kv()
    assert torch.equal(kv[remote_ids], src[local_ids])
    others = [b for b in range(SHAPE[0]) if b not in remote_ids]
    assert bool((kv[others] == -7.0).all())
    kind, nbytes = results.get(timeout=TIMEOUT)
    assert (kind, nbytes) == ("pushed", len(remote_ids) * kv[0].numel() * 4)


def test_bad_requests_raise_before_posting(pair):
    _, agent, _, peer, *_ = pair
    with pytest.raises(KVTransferError, match="unknown peer"):
        agent.read_blocks("nobody#0", [0], [0], timeout=1)
    with pytest.raises(ValueError, match="remote block ids \\[16\\]"):
        agent.read_blocks(peer, [16], [0], timeout=1)
    with pytest.raises(KVTransferError, match="not received"):
        agent.wait_notif(peer, b"never-sent", timeout=0.2)


def test_stalled_peer_times_out(pair):
    """A peer that stops answering (SIGSTOP): the wait is bounded and raises; the pair recovers after."""
    _, agent, kv, peer, _, _, proc = pair
    stop_process(proc.pid)  # every thread stopped: no READ can complete from here
    try:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="timed out after 0.5s"):
            agent.read_blocks(peer, remote_block_ids=list(range(16)), local_block_ids=list(range(16)), timeout=0.5)
        assert time.monotonic() - t0 < 2.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    kv.zero_()
    agent.read_blocks(peer, remote_block_ids=[1, 2], local_block_ids=[1, 2], timeout=TIMEOUT)
    assert torch.equal(kv[1:3], known_kv()[1:3])


def test_peer_gone_raises_kv_transfer_error(pair):
    _, agent, _, peer, _, _, proc = pair
    proc.kill()
    proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as excinfo:
        for _ in range(3):  # UCX may complete one in-flight READ from its buffers; never three
            agent.read_blocks(peer, remote_block_ids=list(range(16)), local_block_ids=list(range(16)),
                              timeout=3.0)
    assert time.monotonic() - t0 < 3 * 3.0 + 2
    print("peer gone:", excinfo.value)
    assert agent.stats.failures >= 1
