"""Nodes from their Redis heartbeats. A node that stops heartbeating drops out within its TTL (its ``hb:`` key
expires). When Redis is unreachable the last known list stays, and the router's own cooldowns keep dead
nodes out."""

from __future__ import annotations

import asyncio
import logging

from pdpool.block_hash import ModelFingerprint
from pdpool.kv_index import IndexReader, IndexUnavailableError, NodeInfo
from pdpool.router.endpoints import Endpoint, Pool

logger = logging.getLogger("pdpool.router")


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

    async def refresh(self) -> bool:
        try:
            infos = await self.run_sync(self.reader.live_nodes)
        except IndexUnavailableError as exc:
            if self.reachable is not False:
                logger.warning("Redis unreachable for discovery; keeping the last known nodes (%s)", exc)
            self.reachable = False
            return False
        if self.reachable is False:
            logger.info("Redis reachable again for discovery: %d live nodes", len(infos))
        self.reachable = True
        self.pool.replace("redis", [endpoint_of(i) for i in infos.values()])
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - discovery must keep going
                logger.exception("Redis discovery failed")
            await asyncio.sleep(self.period)
