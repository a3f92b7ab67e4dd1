"""The peer sweep: a node drops the NIXL agents of peers that left the pool, never one with a transfer in flight or
queued (real NIXL agents in this process, host memory, ``UCX_TLS=tcp,self``; a real redis-server and the nodes'
real heartbeats).

Node ids are pod names, new at every rollout and scale event: without the sweep each node kept every peer agent
it ever loaded, with its UCX endpoints, for the life of the process.
"""

from __future__ import annotations

import asyncio
import time

import torch

from pdpool.kv_index.heartbeat import NodeInfo
from pdpool.kv_index.keys import PoolKeys
from pdpool.kv_index.redis_index import IndexReader, NodeIndex, connect
from pdpool.kv_transfer.agent import KVAgent
from pdpool.kv_transfer.peer_sweep import PeerSweeper

SHAPE = (4, 2, 2, 16, 2, 8)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
KEYS = PoolKeys("ns", "sweep")


class Peer:
    """A pool node: its agent over a KV cache filled with ``fill``, and its heartbeat in Redis."""

    def __init__(self, server, node_id: str, incarnation: str, fill: float) -> None:
        self.agent = KVAgent(f"{node_id}#{incarnation}", ucx_tls="tcp,self")
        self.kv = torch.full(SHAPE, fill)
        self.agent.register_kv_cache(self.kv)
        self.index = NodeIndex(connect(server.url, server.password), KEYS, node_id, incarnation, heartbeat_ttl=30.0)
        self.index.heartbeat(NodeInfo(node_id, "prefill", f"http://{node_id}:8000", incarnation, self.agent.name))

    def leave(self) -> None:
        """Stop as a node stops: deregister (its heartbeat goes), close the agent."""
        self.index.deregister()
        self.agent.close()


def holder_of(name: str = "decode-0#a") -> KVAgent:
    a = KVAgent(name, ucx_tls="tcp,self")
    a.register_kv_cache(torch.zeros(SHAPE))
    return a


def loaded_in_nixl(agent: KVAgent, peer: str) -> bool:
    return agent._nixl.check_remote_metadata(peer)


def test_peers_that_left_are_removed_and_one_in_flight_is_kept_until_it_ends(redis_server):
    holder = holder_of()
    reader = IndexReader(connect(redis_server.url, redis_server.password), KEYS)
    forgotten = []
    sweeper = PeerSweeper(holder, reader=reader, on_removed=[forgotten.append])
    peers = [Peer(redis_server, f"prefill-{i}", "1", float(i + 1)) for i in range(4)]
    try:
        for p in peers:
            holder.add_peer(p.agent.metadata())
            holder.read_blocks(p.agent.name, remote_block_ids=[0], local_block_ids=[0], timeout=20.0)
        names = [p.agent.name for p in peers]
        # prefill-1 has a READ in flight (posted, not waited), prefill-2 a handoff queued before its transfer.
        in_flight = holder.start_read(names[1], remote_block_ids=[1], local_block_ids=[1], timeout=20.0)
        with holder.using(names[2]):
            peers[1].index.deregister()
            peers[2].index.deregister()
            redis_server.client().delete(KEYS.heartbeat("prefill-3"))  # killed: its heartbeat expired
            assert asyncio.run(sweeper.sweep()) == [names[3]]
            assert holder.peers == names[:3] and forgotten == [names[3]]
            assert not loaded_in_nixl(holder, names[3]) and loaded_in_nixl(holder, names[1])
            assert asyncio.run(sweeper.sweep()) == []  # still in use: kept
        assert holder.in_use(names[1]) == 1 and holder.in_use(names[2]) == 0
        in_flight.wait(20.0)
        assert torch.equal(holder._kv_cache[1], peers[1].kv[1])
        assert holder.in_use(names[1]) == 0
        assert sorted(asyncio.run(sweeper.sweep())) == names[1:3]
        assert holder.peers == [names[0]] and loaded_in_nixl(holder, names[0])
        assert not loaded_in_nixl(holder, names[1]) and not loaded_in_nixl(holder, names[2])
        holder.read_blocks(names[0], remote_block_ids=[2], local_block_ids=[2], timeout=20.0)  # the live one works
        assert torch.equal(holder._kv_cache[2], peers[0].kv[2])
    finally:
        holder.close()
        for p in peers:
            p.agent.close()


def test_a_node_that_comes_back_is_loaded_again_and_transfers():
    """A node's peer removed by the sweep (its heartbeat late), then a handoff from it (same incarnation) or from its
    next incarnation: each is loaded again and read."""
    holder = holder_of()
    sweeper = PeerSweeper(holder, reader=None)
    first = holder_of("prefill-0#1")
    first._kv_cache.fill_(3.0)
    second = None
    try:
        holder.add_peer(first.metadata())
        holder.read_blocks("prefill-0#1", remote_block_ids=[0], local_block_ids=[0], timeout=20.0)
        assert sweeper.sweep_with(live_agents=set()) == ["prefill-0#1"]
        holder.add_peer(first.metadata())
        holder.read_blocks("prefill-0#1", remote_block_ids=[1], local_block_ids=[1], timeout=20.0)
        assert torch.equal(holder._kv_cache[1], first._kv_cache[1])
        first.close()
        second = holder_of("prefill-0#2")
        second._kv_cache.fill_(5.0)
        holder.add_peer(second.metadata())
        holder.read_blocks("prefill-0#2", remote_block_ids=[2], local_block_ids=[2], timeout=20.0)
        assert torch.equal(holder._kv_cache[2], second._kv_cache[2]) and holder.peers == ["prefill-0#2"]
        assert sweeper.sweep_with(live_agents={"prefill-0#2"}) == [] and holder.peers == ["prefill-0#2"]
    finally:
        for a in (holder, first, second):
            if a is not None:
                a.close()


def test_without_redis_only_peers_idle_past_the_bound_are_removed():
    holder = holder_of()
    sweeper = PeerSweeper(holder, reader=None, idle_seconds=0.3)
    busy, idle = holder_of("prefill-0#1"), holder_of("prefill-1#1")
    try:
        for p in (busy, idle):
            holder.add_peer(p.metadata())
        with holder.using(busy.name):
            time.sleep(0.4)
            assert asyncio.run(sweeper.sweep()) == [idle.name]
        assert asyncio.run(sweeper.sweep()) == []  # its use just ended
        time.sleep(0.4)
        assert asyncio.run(sweeper.sweep()) == [busy.name] and holder.peers == []
    finally:
        for a in (holder, busy, idle):
            a.close()


def test_loaded_peers_stay_bounded_over_many_churn_cycles(redis_server):
    """Pods come and go under new names (a rollout per cycle): the holder loads each, reads from it, the pod leaves;
    the sweep keeps the holder's loaded agents to the live ones."""
    holder = holder_of()
    reader = IndexReader(connect(redis_server.url, redis_server.password), KEYS)
    sweeper = PeerSweeper(holder, reader=reader)
    live: list[Peer] = []
    most = 0
    try:
        for cycle in range(12):
            p = Peer(redis_server, f"prefill-{cycle:03d}-x7k", "1", float(cycle + 1))
            live.append(p)
            holder.add_peer(p.agent.metadata())
            holder.read_blocks(p.agent.name, remote_block_ids=[cycle % 4], local_block_ids=[0], timeout=20.0)
            assert torch.equal(holder._kv_cache[0], p.kv[0])
            if len(live) > 2:
                left = live.pop(0)
                left.leave()
                assert asyncio.run(sweeper.sweep()) == [left.agent.name]
                assert not loaded_in_nixl(holder, left.agent.name)
            most = max(most, len(holder.peers))
            assert sorted(holder.peers) == sorted(q.agent.name for q in live)
            assert not holder._in_use
        assert most <= 3 and sweeper.num_removed == 10
    finally:
        holder.close()
        for p in live:
            p.agent.close()
