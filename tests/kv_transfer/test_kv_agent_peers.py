"""A node's loaded peers: one agent per peer node, whatever its restarts, and nothing left in NIXL by a peer that
went away (real NIXL agents in this process, host memory, ``UCX_TLS=tcp,self``).

A prefill node that pushes loads each decode node's agent (``<node>#<incarnation>``) when asked to push; a decode
node loads each prefill node's. Every restart of a peer is a new incarnation, so without dropping the old one a
long-running node collected a NIXL remote agent (and its UCX endpoint to a dead process) per peer restart.
"""

from __future__ import annotations

import gc

import pytest
import torch

from pdpool.kv_transfer.agent import KVAgent, KVTransferError, node_of

SHAPE = (4, 2, 2, 16, 2, 8)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]


def agent(name: str, fill: float) -> tuple[KVAgent, torch.Tensor]:
    a = KVAgent(name, ucx_tls="tcp,self")
    kv = torch.full(SHAPE, fill)
    a.register_kv_cache(kv)
    return a, kv


def test_a_new_incarnation_of_a_peer_replaces_the_old_one():
    holder, held = agent("prefill-0#a", 1.0)
    old, _ = agent("decode-0#1", 0.0)
    other, _ = agent("decode-1#1", 0.0)
    new, new_kv = agent("decode-0#2", 0.0)
    try:
        for peer in (old, other, new):
            holder.add_peer(peer.metadata())
        with pytest.raises(KVTransferError, match="unknown peer 'decode-0#1'"):
            holder.peer_region("decode-0#1")
        assert holder.peer_region("decode-1#1") and holder.peer_region("decode-0#2")
        holder.write_blocks("decode-0#2", remote_block_ids=[2], local_block_ids=[0], timeout=20.0)
        assert torch.equal(new_kv[2], held[0]) and not new_kv[1].any()
    finally:
        for a in (holder, old, other, new):
            a.close()


def test_node_of():
    assert node_of("prefill-0#a1b2") == "prefill-0" and node_of("a#b#c") == "a#b" and node_of("diag") is None


def test_a_transfer_refused_at_post_releases_its_request():
    """A peer gone between two transfers (a prefill node killed): NIXL makes the transfer request, then refuses to post
    it (NIXL_ERR_REMOTE_DISCONNECT). Every such request was left in NIXL, one per failed handoff; the real agent's
    calls are counted here."""
    holders = [agent("prefill-0#a", 1.0)[0]]
    reader, _ = agent("decode-0#a", 0.0)
    try:
        peer = reader.add_peer(holders[0].metadata())
        reader.read_blocks(peer, remote_block_ids=[0], local_block_ids=[1], timeout=20.0)
        made, released = [], []
        nixl = reader._nixl
        initialize, release = nixl.initialize_xfer, nixl.release_xfer_handle
        nixl.initialize_xfer = lambda *a, **kw: made.append(1) or initialize(*a, **kw)
        nixl.release_xfer_handle = lambda h: released.append(1) or release(h)
        holders.pop().close()
        gc.collect()  # the holder's NIXL agent goes: its process died
        for _ in range(3):
            with pytest.raises(KVTransferError):
                reader.read_blocks(peer, remote_block_ids=[0], local_block_ids=[1], timeout=5.0)
        assert made and len(released) == len(made)
    finally:
        reader.close()
