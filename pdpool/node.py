"""One node, built and owned in one place: the composition root of ``pdpool serve``.

``Node(config)`` holds everything a node is made of and its lifecycle::

    start  -> the HTTP app listens at once (/health/live 200; /health/ready 503 "loading")
              the engine loads on a daemon thread: model, KV cache, and for a pool node (a prefill or decode
              role, or --redis) the KV connector: NIXL worker, role sides, Redis index, heartbeat
    ready  -> /health/ready 200; the heartbeat carries the node's load and block-hash fingerprint
    drain  -> POST /internal/drain: readiness 503, the heartbeat says draining; work in flight goes on
    stop   -> SIGTERM/SIGINT, in this order: readiness 503 and the heartbeat draining; the listener closes and
              requests in flight finish (bounded); the engine loop stops and aborts what is left; transfers in
              flight end (bounded) and leases are released; the node deregisters from Redis; only then the
              NIXL agent deregisters its memory; the HTTP client session closes last.

A stop while the model still loads does not wait for the load (it may be stuck, e.g. on a file lock): the
loading thread is a daemon and the process exits.

``pdpool.server.app`` is the HTTP surface only: it receives this node (``ServedNode``) and extra routes.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import sys
import threading
import time

import aiohttp
from aiohttp import web

from pdpool import internal_api
from pdpool.kv_metrics import KVMetrics
from pdpool.server.app import create_app
from pdpool.server.errors import APIError, NodeRunner, http_logger
from pdpool.server.metrics import ServerMetrics
from pdpool.utils import bind_sockets, http_url, raise_open_files_limit, wait_for_stop_signal

logger = logging.getLogger("pdpool.node")

STOP_GRACE_SECONDS = 10.0  # requests in flight at stop: how long they may still run


class _LatencyObserver:
    """Feeds the engine loop's latencies into the node's histograms."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def on_first_token(self, seconds: float) -> None:
        self.m.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.m.itl.observe(seconds)

    def on_finished(self, seconds: float) -> None:
        self.m.e2e.observe(seconds)


_EMPTY_STATS = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=0, num_total_blocks=0,
                    prefix_cache_hit_rate=0.0, num_prefill_chunks=0, prefix_cache_hit_tokens=0,
                    prefix_cache_queried_tokens=0, num_preemptions=0, prompt_tokens=0, generation_tokens=0,
                    num_finished=0, num_request_errors=0, block_size=0)


class Node:
    def __init__(self, config, on_load_failed=None) -> None:
        """``on_load_failed()``: called on the loop when the engine fails to load (``serve``: stop the node)."""
        from pdpool.kv_index.keys import PoolKeys
        from pdpool.kv_index.redis_index import IndexReader, connect, new_incarnation

        self.config = config
        self.on_load_failed = on_load_failed
        self.role = config.server.role
        self.node_id = config.node_id
        self.incarnation = new_incarnation()
        self.agent_name = f"{self.node_id}#{self.incarnation}"
        self.pooled = self.role != "both" or bool(config.disagg.redis)  # runs the KV connector
        host = config.disagg.advertise_host or config.server.host
        self.host = socket.gethostname() if host in (None, "", "0.0.0.0", "::") else host
        self.created = int(time.time())
        self.status = "loading"  # loading | ready | failed | draining | stopping
        self.error: str | None = None
        self.llm = None          # AsyncLLM once loaded
        self.worker = None       # KVWorker (pool nodes)
        self.prefill = None      # PrefillSide
        self.decode = None       # DecodeSide
        self.index = None        # NodeIndex (with --redis)
        d = config.disagg
        self.reader = IndexReader(connect(d.redis, d.redis_password), PoolKeys(d.namespace, d.pool)) \
            if self.pooled and d.redis else None   # from the start: a node still loading vouches for peers with it
        self._releaser = None    # PeerDirectory that ends refused handles' leases no decode side ends
        self.heartbeat = None
        self.peer_sweeper = None  # PeerSweeper: drops the NIXL peers of nodes that left the pool
        self.metrics = ServerMetrics(self.stats, config.served_model_name)
        self.kv_metrics = KVMetrics()
        if self.pooled:
            self.kv_metrics.register(self.metrics.registry)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._registered = False  # the heartbeat runs (the node is in the pool's Redis)
        self.app = create_app(config, self, routes=self._internal_routes())

    # ---- what the HTTP app reads -----------------------------------------------------------------

    def require_llm(self):
        """The AsyncLLM, or a 503 while the node loads (or after it failed to)."""
        if self.llm is None:
            if self.error:
                raise APIError(f"the engine failed to load: {self.error}", status=503)
            raise APIError("the model is still loading", status=503)
        return self.llm

    @property
    def draining(self) -> bool:
        return self.status in ("draining", "stopping")

    def stats(self) -> dict:
        if self.llm is None:
            return dict(_EMPTY_STATS, block_size=self.config.cache.block_size)
        return self.llm.stats()

    def drain(self) -> None:
        if not self.draining:
            logger.info("draining: /health/ready now answers 503; in-flight work continues")
            self.status = "draining"

    def release_unclaimed(self, handles: list[dict]) -> None:
        """KV handles whose response never reached a client: end their leases now (on the engine thread)."""
        if self.prefill is None or self.llm is None:
            return
        for handle in handles:
            lease_id = handle.get("lease_id")
            if lease_id:
                logger.info("lease %s: the response carrying it was not delivered; releasing it", lease_id)
                self._track(self.loop.create_task(self.llm.call(self.prefill.notify, lease_id)))

    def refuse_kv_transfer(self, kv_transfer_params: dict) -> None:
        """A request refused before its engine took it (its fields, or the model still loading) that hands a prefill
        node's KV handle over: end the handle's lease now rather than at its expiry. Loaded, the engine's connector
        does it; while loading, nothing else would (a vLLM-style proxy sends to a node without asking its
        readiness)."""
        if self.llm is not None:
            self.llm.engine.refuse_kv_transfer(kv_transfer_params)
        elif self.pooled:
            self._release_handle(kv_transfer_params)

    def _release_handle(self, kv_transfer_params: dict) -> None:
        """End the lease a refused KV handle names where no decode side does (the node loads, or has none: a prefill
        node). Any thread."""
        from pdpool.decode_node.peers import LeaseRef

        lease = LeaseRef.of(kv_transfer_params)
        if lease is not None and kv_transfer_params.get("do_remote_prefill"):
            self.loop.call_soon_threadsafe(self._start_release, lease)

    def _start_release(self, lease) -> None:
        from pdpool.decode_node.peers import PeerDirectory

        if self._releaser is None:
            d = self.config.disagg
            self._releaser = PeerDirectory(None, reader=self.reader, session_of=self.session,
                                           token=d.internal_token, timeout=d.kv_transfer_timeout)
        self._track(self.loop.create_task(self._releaser.release(lease)))

    def _track(self, task: asyncio.Task) -> None:
        """Keep ``task`` until it ends (a stop cancels it)."""
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    # ---- loading ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start loading the engine in the background (call on the server's loop)."""
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._load, name="pdpool-load", daemon=True).start()
        if self.pooled:
            self._tasks.append(self.loop.create_task(self._expire_leases()))

    def _load(self) -> None:
        from pdpool.engine.async_llm import AsyncLLM
        from pdpool.engine.llm_engine import LLMEngine

        try:
            engine = LLMEngine(self.config, connector_factory=self._make_connector if self.pooled else None)
            llm = AsyncLLM(self.config, engine=engine, latency_observer=_LatencyObserver(self.metrics))
        except Exception as exc:  # noqa: BLE001 - /health/ready and 503s say it until the node stops
            logger.exception("engine failed to load")
            self.loop.call_soon_threadsafe(self._set_failed, f"{type(exc).__name__}: {exc}")
            return
        self.loop.call_soon_threadsafe(self._set_loaded, llm)

    def _set_loaded(self, llm) -> None:
        self.llm = llm
        if self.status == "loading":
            self.status = "ready"
        if self.heartbeat is not None and not self.draining:  # a node stopping already does not register
            self.heartbeat.start()
            self._registered = True
        if self.peer_sweeper is not None:  # every heartbeat TTL: when a node that left stops being live
            self._tasks.append(self.loop.create_task(self.peer_sweeper.run(3 * self.config.disagg.heartbeat_seconds)))
        logger.info("engine ready: %s (max_model_len %d)", self.config.served_model_name, llm.max_model_len)

    def _set_failed(self, error: str) -> None:
        self.error = error
        if self.status == "loading":
            self.status = "failed"
            if self.on_load_failed is not None:
                self.on_load_failed()

    def _make_connector(self, engine):
        """The KV connector of a pool node (engine thread, during load)."""
        from pdpool.decode_node.peers import PeerDirectory
        from pdpool.decode_node.side import DecodeSide
        from pdpool.engine.kv_connector import KVConnector, kv_fingerprint
        from pdpool.kv_transfer.peer_sweep import PeerSweeper
        from pdpool.kv_transfer.worker import KVWorker
        from pdpool.prefill_node.side import NodeIdentity, PrefillSide

        d = self.config.disagg
        self.worker = KVWorker(engine.runner, self.agent_name, ucx_tls=d.ucx_tls, ucx_net_devices=d.ucx_net_devices,
                               timeout=d.kv_transfer_timeout)
        self.kv_metrics.bytes_pulled = lambda: self.worker.bytes_pulled
        self.kv_metrics.bytes_pushed = lambda: self.worker.bytes_pushed
        self._make_index(engine)
        fingerprint = kv_fingerprint(engine)
        sides = []
        if self.role in ("prefill", "both"):
            identity = NodeIdentity(self.node_id, self.incarnation, self.agent_name, self.host, self.config.server.port)
            self.prefill = PrefillSide(engine, identity, fingerprint, [self.worker.region],
                                       lease_seconds=d.kv_lease_seconds, max_leased_blocks=d.max_leased_blocks,
                                       transfer_mode=d.kv_transfer_mode, metrics=self.kv_metrics)
            sides.append(self.prefill)
        if self.role in ("decode", "both"):
            peers = PeerDirectory(self.worker, reader=self.reader, session_of=self.session,
                                  token=d.internal_token, timeout=d.kv_transfer_timeout)
            self.decode = DecodeSide(engine, self.worker, peers, fingerprint, policy=d.kv_load_failure_policy,
                                     timeout=d.kv_transfer_timeout, token=d.internal_token, metrics=self.kv_metrics,
                                     session_of=self.session, fail_request=self._fail_request, wake=self._wake)
            self.decode.loop = self.loop
            sides.append(self.decode)
        self.peer_sweeper = PeerSweeper(self.worker.agent, reader=self.reader,
                                        on_removed=[self.decode.peers.forget] if self.decode is not None else [])
        self.kv_metrics.peers_loaded = lambda: len(self.worker.agent.peers)
        self.kv_metrics.peers_removed = lambda: self.peer_sweeper.num_removed
        return KVConnector(engine.kv_cache_manager, sides, index=self.index, release=self._release_handle)

    def _make_index(self, engine) -> None:
        d = self.config.disagg
        if not d.redis:
            return
        from pdpool.kv_index.heartbeat import HeartbeatThread, NodeInfo, NodeLoad
        from pdpool.kv_index.keys import PoolKeys
        from pdpool.kv_index.redis_index import NodeIndex, connect

        keys = PoolKeys(d.namespace, d.pool)
        period = d.heartbeat_seconds
        self.index = NodeIndex(connect(d.redis, d.redis_password), keys, self.node_id, self.incarnation,
                               heartbeat_ttl=3 * period, backoff_initial=min(0.2, period),
                               backoff_max=min(10.0, 4 * period))
        self.index.resync([])  # a new incarnation starts with an empty cache
        self.index.set_agent_metadata(self.worker.metadata())
        url = http_url(self.host, self.config.server.port)
        fp = engine.fingerprint
        fingerprint = {"model_id": fp.model_id, "dtype": fp.dtype, "block_size": fp.block_size}
        scheduler = engine.scheduler

        def info() -> NodeInfo:
            load = NodeLoad(num_waiting=scheduler.num_waiting, num_running=scheduler.num_running,
                            kv_usage=scheduler.kv_cache_usage, num_free_blocks=scheduler.num_free_blocks)
            return NodeInfo(self.node_id, self.role, url, self.incarnation, self.agent_name, self.draining, load,
                            fingerprint=fingerprint,
                            prefix_cache_queried_tokens=scheduler.prefix_cache_queried_tokens,
                            prefix_cache_hit_tokens=scheduler.prefix_cache_hit_tokens,
                            max_model_len=engine.max_model_len)

        self.heartbeat = HeartbeatThread(self.index, info, period)  # started once the engine is ready

    def _fail_request(self, request_id: str, message: str) -> None:
        if self.llm is not None:
            self.llm.fail_request(request_id, APIError(message, status=503, type="kv_transfer_error",
                                                       code="kv_transfer_failed"))

    def _wake(self) -> None:
        if self.llm is not None:
            self.llm.wake()

    async def _expire_leases(self) -> None:
        period = min(1.0, max(0.02, self.config.disagg.kv_lease_seconds / 4))
        while True:
            await asyncio.sleep(period)
            if self.prefill is None or self.llm is None:
                continue
            try:
                await self.llm.call(self.prefill.expire_leases)
            except Exception:  # noqa: BLE001 - keep expiring
                logger.exception("lease expiry failed")

    # ---- internal routes -------------------------------------------------------------------------

    def _internal_routes(self) -> list[web.RouteDef]:
        token = self.config.disagg.internal_token

        async def drain(request: web.Request) -> web.Response:
            """``POST /internal/drain`` (the preStop hook)."""
            internal_api.check(request, token)
            self.drain()
            return web.json_response({"status": "draining"})

        routes = [web.post(internal_api.PREFIX + "drain", drain)]
        if not self.pooled:
            return routes

        async def agent(request: web.Request) -> web.Response:
            internal_api.check(request, token)
            self.require_llm()
            return web.json_response({"node_id": self.node_id, "incarnation": self.incarnation,
                                      "agent_name": self.agent_name,
                                      "agent_metadata": base64.b64encode(self.worker.metadata()).decode()})

        routes.append(web.get(internal_api.PREFIX + "kv/agent", agent))
        if self.role in ("prefill", "both"):
            from pdpool.prefill_node.routes import lease_routes

            routes += lease_routes(self, token)
        return routes

    # ---- stopping --------------------------------------------------------------------------------

    async def stop(self, runner: web.AppRunner) -> None:
        """The ordered shutdown of the module docstring; ``runner`` serves the app."""
        loading = self.llm is None and self.error is None
        self.status = "stopping"
        if loading:
            logger.info("stopping while the model loads; not waiting for the load")
        await runner.cleanup()  # closes the listener; in-flight handlers run to the runner's shutdown timeout
        for task in self._tasks:
            task.cancel()
        if self.decode is not None:
            self.decode.stop_renewing()
        if self.llm is not None:
            await self.llm.shutdown()
        if self.decode is not None and self.decode.tasks:  # loads in flight end (each bounded by its timeout)
            await asyncio.wait(list(self.decode.tasks), timeout=3 * self.config.disagg.kv_transfer_timeout)
        if self.prefill is not None and self.llm is not None:
            self.prefill.release_all()  # the engine thread is idle now: no step runs
        if self.index is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._deregister)
        if self.worker is not None and not loading:
            self.worker.close()  # no transfer reads or writes our memory any more
        if self._session is not None:
            await self._session.close()

    def _deregister(self) -> None:
        if self._registered:
            self.heartbeat.stop()
        self.index.deregister()


async def serve(config, *, stop: asyncio.Event | None = None) -> str | None:
    """Run one node until ``stop`` is set, SIGINT/SIGTERM arrives or the engine fails to load; returns the load
    error in that last case (else None)."""
    stop = stop or asyncio.Event()
    node = Node(config, on_load_failed=stop.set)
    runner = NodeRunner(node.app, handler_cancellation=True, access_log=None, shutdown_timeout=STOP_GRACE_SECONDS,
                        logger=http_logger())
    await runner.setup()
    sockets = bind_sockets(config.server.host, config.server.port)
    for sock in sockets:   # one site per address: IPv4 and IPv6 when --host is unset
        await web.SockSite(runner, sock).start()
    logger.info("pdpool %s node listening on %s (model %s)", config.server.role,
                ", ".join(http_url(*sock.getsockname()[:2]) for sock in sockets), config.served_model_name)
    await node.start()
    try:
        await wait_for_stop_signal(stop)
    finally:
        logger.info("shutting down")
        await node.stop(runner)
    return node.error   # set only by a failed load


def run(config) -> None:
    """``pdpool serve``: one node, in this process. An engine that fails to load ends the process with status 1, as
    vLLM's does: a supervisor (Kubernetes, ``pdpool up``) sees the exit and restarts it with a back-off, where a node
    left up and never ready would only look stuck."""
    raise_open_files_limit()
    error = asyncio.run(serve(config))
    if error is not None:
        # Out without the interpreter's finalization: threads a failed load left in native code (torch's, say)
        # may still run, and tearing the runtime down under them aborts the process (SIGABRT, "terminate called
        # without an active exception") instead of exiting with this status. The node is already stopped.
        print(f"pdpool serve: the engine failed to load: {error}", file=sys.stderr, flush=True)
    # Stopped in order (node.stop: listener, engine, leases, Redis entries, NIXL agent): what the interpreter's
    # finalization would add is torch's and the heap's teardown, about 2 s of CPU, which a pod's termination (and
    # a restart) waits on. Out without it, the logs flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)
