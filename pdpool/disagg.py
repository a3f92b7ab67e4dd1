"""What a node adds for prefill/decode disaggregation, for every role: one engine, one wiring.

``DisaggNode(config)`` gives the node its incarnation (new at each start) and, once the engine is built:

* the NIXL worker over the KV cache (``pdpool.engine.kv_connector.KVWorker``);
* the role sides: ``prefill_node`` for ``prefill``, ``decode_node`` for ``decode``, both for ``both``;
* with ``--redis``: the block index (every step's stored/removed hashes in one pipeline, resync at start and
  every 30 heartbeats), the heartbeat thread, the agent metadata under node id + incarnation; clean shutdown
  deregisters. Redis is never on the readiness path: a node serves without it and heals when it is back;
* the internal routes (``GET /internal/kv/agent`` and the prefill role's lease endpoints) and the KV metrics.

``pdpool serve`` uses it (``pdpool.server.app.run_server``) when ``enabled(config)``: a prefill or decode role, or
``--redis``; ``python -m pdpool.disagg <pdpool serve flags>`` serves such a node whatever the role.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import sys
import uuid

import aiohttp
from aiohttp import web

from pdpool import internal_api
from pdpool.engine.kv_connector import KVConnector, KVConnectorEngine, KVWorker, kv_fingerprint
from pdpool.kv_metrics import KVMetrics
from pdpool.server.errors import APIError

logger = logging.getLogger(__name__)


class DisaggNode:
    def __init__(self, config) -> None:
        self.config = config
        d = config.disagg
        self.role = config.server.role
        self.node_id = config.node_id
        self.incarnation = uuid.uuid4().hex[:16]
        self.agent_name = f"{self.node_id}#{self.incarnation}"
        host = d.advertise_host or config.server.host
        self.host = socket.gethostname() if host in ("0.0.0.0", "::") else host
        self.port = config.server.port
        self.metrics = KVMetrics()
        self.worker: KVWorker | None = None
        self.prefill = None
        self.decode = None
        self.index = None
        self.reader = None
        self.heartbeat = None
        self.llm_of = lambda: None  # the app's AsyncLLM once loaded
        self.app_state: dict = {}  # the app's state (``draining`` once POST /internal/drain came)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, set at startup (before the engine loads)

    # ---- engine ------------------------------------------------------------------------------------

    def make_engine(self, config) -> KVConnectorEngine:
        """The node's engine (blocking: loads the model); ``create_app``'s ``engine_factory``."""
        return KVConnectorEngine(config, self._make_connector)

    def _make_connector(self, engine) -> KVConnector:
        from pdpool.decode_node.peers import PeerDirectory
        from pdpool.decode_node.side import DecodeSide
        from pdpool.prefill_node.side import NodeIdentity, PrefillSide

        d = self.config.disagg
        self.worker = KVWorker(engine.runner, self.agent_name, ucx_tls=d.ucx_tls, ucx_net_devices=d.ucx_net_devices,
                               timeout=d.kv_transfer_timeout)
        self.metrics.bytes_pulled = lambda: self.worker.bytes_pulled
        self.metrics.bytes_pushed = lambda: self.worker.bytes_pushed
        self._start_index(engine)
        fingerprint = kv_fingerprint(engine)
        sides = []
        if self.role in ("prefill", "both"):
            identity = NodeIdentity(self.node_id, self.incarnation, self.agent_name, self.host, self.port)
            self.prefill = PrefillSide(engine, identity, fingerprint, [self.worker.region],
                                       lease_seconds=d.kv_lease_seconds, max_leased_blocks=d.max_leased_blocks,
                                       transfer_mode=d.kv_transfer_mode, metrics=self.metrics)
            sides.append(self.prefill)
        if self.role in ("decode", "both"):
            peers = PeerDirectory(self.worker, reader=self.reader, session_of=self.session,
                                  token=d.internal_token, timeout=d.kv_transfer_timeout)
            self.decode = DecodeSide(engine, self.worker, peers, fingerprint, policy=d.kv_load_failure_policy,
                                     timeout=d.kv_transfer_timeout, token=d.internal_token, metrics=self.metrics,
                                     session_of=self.session, fail_request=self._fail_request,
                                     wake=lambda: self.llm_of().wake())
            self.decode.loop = self.loop
            sides.append(self.decode)
        return KVConnector(sides, index=self.index)

    def _fail_request(self, request_id: str, message: str) -> None:
        self.llm_of().fail_request(request_id, APIError(message, status=503, type="kv_transfer_error",
                                                        code="kv_transfer_failed"))

    # ---- Redis -------------------------------------------------------------------------------------

    def _start_index(self, engine) -> None:
        d = self.config.disagg
        if not d.redis:
            return
        from pdpool.kv_index.heartbeat import HeartbeatThread, NodeInfo, NodeLoad
        from pdpool.kv_index.keys import PoolKeys
        from pdpool.kv_index.redis_index import IndexReader, NodeIndex, connect

        keys = PoolKeys(self.config.disagg.namespace, self.config.disagg.pool)
        period = d.heartbeat_seconds
        self.index = NodeIndex(connect(d.redis, d.redis_password), keys, self.node_id, self.incarnation,
                               heartbeat_ttl=3 * period, backoff_initial=min(0.2, period),
                               backoff_max=min(10.0, 4 * period))
        self.reader = IndexReader(connect(d.redis, d.redis_password), keys)
        self.index.resync([])  # a new incarnation starts with an empty cache
        self.index.set_agent_metadata(self.worker.metadata())
        url = f"http://{self.host}:{self.port}"
        self.draining = False

        def info() -> NodeInfo:
            s = engine.scheduler
            load = NodeLoad(num_waiting=s.num_waiting, num_running=s.num_running, kv_usage=s.kv_cache_usage,
                            num_free_blocks=s.num_free_blocks)
            return NodeInfo(self.node_id, self.role, url, self.incarnation, self.agent_name,
                            self.draining or bool(self.app_state.get("draining")), load)

        self.heartbeat = HeartbeatThread(self.index, info, period).start()

    # ---- HTTP --------------------------------------------------------------------------------------

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def create_app(self) -> web.Application:
        """The node's OpenAI app (``pdpool.server.app``) with this node's engine, internal routes and metrics."""
        from pdpool.prefill_node.routes import add_routes
        from pdpool.server.app import METRICS_KEY, STATE_KEY, create_app

        app = create_app(self.config, engine_factory=self.make_engine)
        state = app[STATE_KEY]
        self.app_state = state
        self.llm_of = lambda: state.get("llm")
        token = self.config.disagg.internal_token
        self.metrics.register(app[METRICS_KEY].registry)

        def loaded():
            llm = state.get("llm")
            if llm is None:
                raise APIError("the model is still loading", status=503)
            return llm

        async def agent(request: web.Request) -> web.Response:
            internal_api.check(request, token)
            loaded()
            return web.json_response({"node_id": self.node_id, "incarnation": self.incarnation,
                                      "agent_name": self.agent_name,
                                      "agent_metadata": base64.b64encode(self.worker.metadata()).decode()})

        app.router.add_get("/internal/kv/agent", agent)
        if self.role in ("prefill", "both"):
            add_routes(app, llm_of=loaded, side_of=lambda: self.prefill, worker_of=lambda: self.worker, token=token)
        app.on_startup.insert(0, self._on_startup)  # the loop is known before the engine starts loading
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_startup(self, app) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks.append(self.loop.create_task(self._expire_leases()))

    async def _expire_leases(self) -> None:
        period = min(1.0, max(0.02, self.config.disagg.kv_lease_seconds / 4))
        while True:
            await asyncio.sleep(period)
            if self.prefill is None or self.llm_of() is None:
                continue
            try:
                await self.llm_of().call(self.prefill.expire_leases)
            except Exception:  # noqa: BLE001 - keep expiring
                logger.exception("lease expiry failed")

    async def _on_shutdown(self, app) -> None:
        for task in self._tasks:
            task.cancel()
        if self.heartbeat is not None:
            self.draining = True
            self.heartbeat.stop()
            await asyncio.get_running_loop().run_in_executor(None, self.index.deregister)
        if self._session is not None:
            await self._session.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def enabled(config) -> bool:
    """Whether ``pdpool serve`` runs this wiring: a prefill or decode role, or a pool index to publish to."""
    return config.server.role != "both" or bool(config.disagg.redis)


async def serve(config, *, stop: asyncio.Event | None = None) -> None:
    """``pdpool.server.app.serve`` with the node's disaggregation wiring (the engine loads in the background)."""
    from pdpool.server.app import serve as serve_app

    node = DisaggNode(config)
    try:
        await serve_app(config, stop=stop, app=node.create_app())
    finally:
        node.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from pdpool import config as config_mod

    parser = argparse.ArgumentParser(prog="python -m pdpool.disagg")
    config_mod.add_arguments(parser)
    cfg = config_mod.from_args(parser.parse_args(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.device.num_threads:
        import torch

        torch.set_num_threads(cfg.device.num_threads)
    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
