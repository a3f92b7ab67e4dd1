"""The operator's probe and metrics endpoints (``--health-port``): ``/healthz``, ``/readyz``, ``/metrics``.

kopf's own ``--liveness`` endpoint starts with kopf, and kopf starts only on the leader: a standby replica would
fail it and be restarted forever. This server starts before the Lease is sought, so every replica answers.

- ``/healthz`` (liveness): the event loop answers, and kopf, once started, has not stopped.
- ``/readyz`` (readiness): the CRD is served, and the API server answered the elector (or, without leader
  election, kopf runs) within the last two lease durations. A standby replica is ready: it can take over.
- ``/metrics``: ``pdpool_operator_leader`` (1 on the replica that reconciles), ``pdpool_operator_ready``.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class Health:
    def __init__(self, lease_seconds: float = 15.0):
        self.lease_seconds = lease_seconds
        self.crd_served = False
        self.elector = None                 # a LeaseElector, when leader election is on
        self.kopf_task: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self._leader = Gauge("pdpool_operator_leader", "1 on the replica that holds the Lease and reconciles.",
                             registry=self.registry)
        self._ready = Gauge("pdpool_operator_ready", "1 while /readyz answers 200.", registry=self.registry)
        self._runner: web.AppRunner | None = None

    def alive(self) -> tuple[bool, str]:
        if self.kopf_task is not None and self.kopf_task.done():
            return False, "kopf stopped"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if not self.crd_served:
            return False, "waiting for the InferencePool CRD to be served"
        if self.elector is not None:
            contact = self.elector.last_contact
            if contact is None or time.monotonic() - contact > 2 * self.lease_seconds:
                return False, "the API server has not answered the Lease elector"
            return True, "leading" if self.elector.is_leader() else "standby"
        if self.kopf_task is None or self.kopf_task.done():
            return False, "kopf is not running"
        return True, "running"

    async def _healthz(self, _request: web.Request) -> web.Response:
        ok, why = self.alive()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        ok, why = self.ready()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        self._leader.set(1 if self.elector is None and self.kopf_task is not None
                         or self.elector is not None and self.elector.is_leader() else 0)
        self._ready.set(1 if self.ready()[0] else 0)
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, host: str | None, port: int) -> None:
        """``host`` None: every address of every family this machine has."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
