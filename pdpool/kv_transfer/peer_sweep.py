"""Drop the NIXL peers of nodes that left the pool, so a node's loaded agents follow the pool, not its history.

Node ids are pod names: every rollout and scale event brings new ones, and each peer a node ever loaded (a prefill
node's agent on a decode node, a decode node's on a prefill node that pushes) kept its NIXL metadata and UCX
endpoints for the life of the process. A sweep, every few seconds on the node's event loop (never on a request's
path), removes each loaded peer that has left and is idle (``KVAgent.remove_idle_peers``: no transfer in flight,
none queued under ``KVAgent.using``):

* with Redis: a peer has left when the pool has no live node with its agent name (``IndexReader.live_nodes``: the
  node's heartbeat is gone, or it heartbeats as another incarnation);
* without Redis, or while Redis does not answer: when it has not been used for ``idle_seconds``.

A peer removed by mistake (a heartbeat late past its TTL) costs only its reload at the next handoff: every user of
a peer loads it again when it is missing (``on_removed`` tells ``PeerDirectory`` to forget it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from pdpool.kv_transfer.agent import KVAgent

logger = logging.getLogger(__name__)

IDLE_PEER_SECONDS = 600.0


class PeerSweeper:
    def __init__(self, agent: KVAgent, *, reader=None, idle_seconds: float = IDLE_PEER_SECONDS,
                 on_removed: Iterable[Callable[[str], None]] = ()) -> None:
        self.agent = agent
        self.reader = reader  # pdpool.kv_index IndexReader, or None without Redis
        self.idle_seconds = idle_seconds
        self.on_removed = list(on_removed)
        self.num_removed = 0

    async def sweep(self) -> list[str]:
        """One sweep (on the event loop); the names of the peers removed."""
        live = None
        if self.reader is not None and self.agent.peers:
            try:
                nodes = await asyncio.get_running_loop().run_in_executor(None, self.reader.live_nodes)
                live = {info.agent_name or f"{node}#{info.incarnation}" for node, info in nodes.items()}
            except Exception as exc:  # IndexUnavailableError: only the idle bound applies
                logger.info("peer sweep: Redis did not answer (%s); removing peers idle for %.0f s only", exc,
                            self.idle_seconds)
        return self.sweep_with(live)

    def sweep_with(self, live_agents: set[str] | None) -> list[str]:
        """Remove the idle peers not in ``live_agents`` (None: those idle for ``idle_seconds``)."""
        if live_agents is None:
            removed = self.agent.remove_idle_peers(lambda name: self.agent.idle_seconds(name) >= self.idle_seconds)
        else:
            removed = self.agent.remove_idle_peers(lambda name: name not in live_agents)
        for name in removed:
            for forget in self.on_removed:
                forget(name)
        if removed:
            self.num_removed += len(removed)
            logger.info("NIXL agent %s removed %d peers that left the pool: %s; %d loaded", self.agent.name,
                        len(removed), ", ".join(removed), len(self.agent.peers))
        return removed

    async def run(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - keep sweeping
                logger.exception("peer sweep failed")
