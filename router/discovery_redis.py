"""Nodes from their Redis heartbeats. A node that stops heartbeating drops out within its TTL (its ``hb:`` key
expires). When Redis is unreachable the last known list stays, and the router's own cooldowns keep dead
nodes out. When Redis comes back without some nodes' heartbeats (a restart without persistence: its ``run_id``
changed; or an outage long enough for their ``hb:`` keys to expire, since the nodes could not renew them), those
nodes are kept for ``RESTART_GRACE_S`` while they write their heartbeats again, instead of leaving the router
with no node for up to a heartbeat period (every request a 503)."""

from __future__ import annotations

import asyncio
import logging
import time

from pdpool.block_hash import ModelFingerprint
from pdpool.kv_index import IndexReader, IndexUnavailableError, NodeInfo
from pdpool.router.endpoints import Endpoint, Pool

logger = logging.getLogger("pdpool.router")

# A node rewrites its keys at its next heartbeat that reaches Redis: within its heartbeat period (2 s by default),
# or its write backoff (at most 10 s, ``NodeIndex.backoff_max``) after a long outage.
RESTART_GRACE_S = 15.0


def endpoint_of(info: NodeInfo) -> Endpoint:
    fp = None
    if isinstance(info.fingerprint, dict):
        try:
            fp = ModelFingerprint(str(info.fingerprint["model_id"]), str(info.fingerprint["dtype"]),
                                  int(info.fingerprint["block_size"]))
        except (KeyError, TypeError, ValueError):
            fp = None
    return Endpoint(node_id=info.node_id, url=info.url.rstrip("/"), role=info.role, source="redis", pdpool=True,
                    incarnation=info.incarnation, fingerprint=fp, ready=True, draining=info.draining,
                    load=info.load, max_model_len=info.max_model_len)


class RedisDiscovery:
    def __init__(self, reader: IndexReader, pool: Pool, period: float, run_sync) -> None:
        self.reader = reader
        self.pool = pool
        self.period = period
        self.run_sync = run_sync       # runs a blocking call off the event loop
        self.reachable: bool | None = None
        self.run_id: str | None = None                  # the Redis server's, to tell a restart from departures
        self.known: dict[str, Endpoint] = {}            # the last refresh's nodes
        self.kept_until: dict[str, float] = {}          # nodes a Redis restart/outage lost -> keep until

    async def refresh(self) -> bool:
        try:
            infos = await self.run_sync(self.reader.live_nodes)
        except IndexUnavailableError as exc:
            if self.reachable is not False:
                logger.warning("Redis unreachable for discovery; keeping the last known nodes (%s)", exc)
            self.reachable = False
            return False
        came_back = self.reachable is False
        if came_back:
            logger.info("Redis reachable again for discovery: %d live nodes", len(infos))
        self.reachable = True
        endpoints = {node_id: endpoint_of(info) for node_id, info in infos.items()}
        if self.run_id is None or any(n not in endpoints for n in self.known):
            await self._keep_nodes_redis_lost(endpoints, came_back)
        self.known = endpoints
        self.pool.replace("redis", list(endpoints.values()))
        return True

    async def _keep_nodes_redis_lost(self, endpoints: dict[str, Endpoint], came_back: bool) -> None:
        """Off the common path: only when a known node is missing (or on the first refresh). A node that
        deregistered, or whose heartbeat expired while Redis was reachable, is dropped; one that a Redis restart
        or outage lost is kept a while."""
        try:
            run_id = await self.run_sync(self.reader.server_run_id)
        except IndexUnavailableError:
            run_id = self.run_id
        now = time.monotonic()
        restarted = self.run_id is not None and run_id != self.run_id
        lost = [n for n in self.known if n not in endpoints]
        if (restarted or came_back) and lost:
            logger.warning("Redis %s without %d nodes' heartbeats; keeping them for %.0f s while they register "
                           "again: %s", "restarted (run_id changed)" if restarted else "came back after an outage",
                           len(lost), RESTART_GRACE_S, ", ".join(lost))
            self.kept_until.update({n: now + RESTART_GRACE_S for n in lost})
        self.run_id = run_id
        for node_id, until in list(self.kept_until.items()):
            if node_id in endpoints or now >= until:
                del self.kept_until[node_id]
            else:
                endpoints[node_id] = self.known[node_id]

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - discovery must keep going
                logger.exception("Redis discovery failed")
            await asyncio.sleep(self.period)
