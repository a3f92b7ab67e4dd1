"""The router's composition root and HTTP surface (aiohttp).

``Router`` builds every piece from the config (discovery, prefix index, scheduler, request path, metrics),
owns their lifecycle, and serves ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health/live``, ``/health/ready``, ``/metrics`` and ``/openapi.json``. A client that disconnects cancels its
handler (``handler_cancellation=True``), which closes the upstream legs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from aiohttp import web

from pdpool.frontend import Frontend
from pdpool.logs import HEADER as REQUEST_ID_HEADER, request_id_from, request_id_var
from pdpool.router import openapi
from pdpool.router.endpoints import Pool
from pdpool.router.handoff import RequestPath, _PassThrough, pass_through_response
from pdpool.router.http1 import Http1Client, httptools
from pdpool.router.inflight import InflightTracker
from pdpool.router.metrics import CONTENT_TYPE, RouterMetrics
from pdpool.router.prefix_index import ApproxIndex, PrefixIndex
from pdpool.router.request import parse
from pdpool.router.scheduler import Scheduler
from pdpool.router.settings import SchedulerProfile
from pdpool.router.upstream import Upstream
from pdpool.server import protocol
from pdpool.server.auth import check_api_key
from pdpool.server.errors import APIError, error_response

logger = logging.getLogger("pdpool.router")

PUBLIC = ("/health", "/metrics", "/openapi.json")
ROUTER_KEY = web.AppKey("router", object)


class Router:
    def __init__(self, cfg, profile: SchedulerProfile, frontend: Frontend) -> None:
        self.cfg = cfg
        r = cfg.router
        self.frontend = frontend
        self.served_names = [cfg.served_model_name]
        self.created = int(time.time())
        self.pool = Pool(r.node_cooldown)
        self.inflight = InflightTracker()
        self.metrics = RouterMetrics(self.pool, self.inflight)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="router-redis")
        self.reader = None
        if r.redis:
            from pdpool.kv_index import IndexReader, PoolKeys, connect

            self.reader = IndexReader(connect(r.redis, r.redis_password, timeout=0.25), PoolKeys(r.namespace, r.pool))
        self.index = PrefixIndex(self.reader, ApproxIndex(r.approx_index_entries), self.run_sync, self.metrics,
                                 recent_seconds=r.recent_seconds)
        self.pool.listeners.append(self.index.on_change)
        self.scheduler = Scheduler(self.pool, self.index, self.inflight, profile, model_id=cfg.served_model_name,
                                   dtype=r.dtype, block_size=r.block_size, disagg_min_tokens=r.disagg_min_tokens)
        self.session: aiohttp.ClientSession | None = None
        self.http1: Http1Client | None = None
        self.path: RequestPath | None = None
        self.discoveries: list = []
        self._tasks: list[asyncio.Task] = []
        self.num_inflight = 0

    def run_sync(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        r = self.cfg.router
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
                                             auto_decompress=False)
        if self.reader is not None:
            from pdpool.router.index_reader import AsyncIndexReader

            self.index.async_reader = AsyncIndexReader(r.redis, r.redis_password, self.reader.keys)
        self.http1 = Http1Client() if httptools is not None else None
        upstream = Upstream(self.session, connect_timeout=r.connect_timeout, request_timeout=r.request_timeout,
                            internal_token=r.internal_token, http1=self.http1)
        self.path = RequestPath(self.scheduler, upstream, self.pool, self.index, self.inflight, self.metrics,
                                max_retries=r.max_retries, prefill_timeout=r.prefill_timeout)
        static = {"prefill": r.prefill, "decode": r.decode, "both": r.both}
        if any(static.values()):
            from pdpool.router.discovery_static import StaticDiscovery

            self.discoveries.append(StaticDiscovery(static, self.pool, self.session, r.discovery_seconds))
        elif self.reader is not None and not r.kubernetes:  # with --kubernetes, Redis is the prefix index only
            from pdpool.router.discovery_redis import RedisDiscovery

            self.discoveries.append(RedisDiscovery(self.reader, self.pool, r.discovery_seconds, self.run_sync))
        if r.kubernetes:
            from pdpool.router.discovery_k8s import KubernetesDiscovery

            self.discoveries.append(KubernetesDiscovery.from_config(r, self.pool, self.session))
        for d in self.discoveries:  # a first view before serving
            try:
                await asyncio.wait_for(d.refresh(), timeout=5)
            except Exception:  # noqa: BLE001 - the loop below retries
                logger.exception("first discovery refresh failed")
            self._tasks.append(asyncio.get_running_loop().create_task(d.run()))
        logger.info("router ready to route: %d nodes known (%s)", len(self.pool.endpoints),
                    ", ".join(f"{e.node_id}={e.role}" for e in self.pool.endpoints.values()))

    async def stop(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self.http1 is not None:
            self.http1.close()
        if self.index.async_reader is not None:
            await self.index.async_reader.close()
        self._executor.shutdown(wait=False)

    # ---- handlers -------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        limit = self.cfg.router.max_inflight
        if limit and self.num_inflight >= limit:
            raise APIError(f"too many requests in flight (--max-inflight {limit}); retry later", status=429,
                           code="too_many_requests")
        self.num_inflight += 1
        try:
            body = await protocol.read_json(request)
            rr = parse(request.path, body, self.frontend, self.served_names, request_id_var.get(),
                       await request.read())  # the bytes read_json parsed (aiohttp keeps them)
            try:
                return await self.path.serve(request, rr)
            except _PassThrough as exc:
                return pass_through_response(exc, rr.request_id)
        finally:
            self.num_inflight -= 1

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.served_names[0], "object": "model", "created": self.created, "owned_by": "pdpool",
                "root": self.cfg.router.model, "parent": None}
        return web.json_response({"object": "list", "data": [card]})

    async def health_live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive", "pid": os.getpid()})  # with --workers: which one answered

    async def health_ready(self, request: web.Request) -> web.Response:
        nodes = {e.node_id: e.role for e in self.pool.decode_candidates()}
        if not nodes:
            return web.json_response({"status": "no ready node"}, status=503)
        return web.json_response({"status": "ready", "nodes": nodes})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi_page(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.spec(request.app))


def _middlewares(router: Router):
    api_key = router.cfg.router.api_key

    @web.middleware
    async def outer(request: web.Request, handler):
        """Request id, authentication and OpenAI errors; counts every response by status."""
        rid = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        token = request_id_var.set(rid)
        try:
            try:
                if not request.path.startswith(PUBLIC):
                    check_api_key(request.headers, api_key)
                resp = await handler(request)
            except APIError as err:
                if err.status >= 500:
                    logger.warning("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
                resp = error_response(err)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                resp = error_response(APIError(exc.reason or "HTTP error", status=exc.status))
            except (asyncio.CancelledError, ConnectionResetError):
                logger.info("client disconnected from %s %s", request.method, request.path)
                raise
            except Exception as exc:  # noqa: BLE001 - the router must stay up
                logger.exception("internal error on %s %s", request.method, request.path)
                resp = error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500))
            if not resp.prepared:
                resp.headers[REQUEST_ID_HEADER] = rid
            router.metrics.responses.labels(str(resp.status)).inc()
            return resp
        finally:
            request_id_var.reset(token)

    return [outer]


def create_app(router: Router) -> web.Application:
    app = web.Application(middlewares=_middlewares(router), client_max_size=64 * 1024 * 1024)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.generate)
    app.router.add_post("/v1/chat/completions", router.generate)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health/live", router.health_live)
    app.router.add_get("/health/ready", router.health_ready)
    app.router.add_get("/health", router.health_ready)
    app.router.add_get("/metrics", router.metrics_page)
    app.router.add_get("/openapi.json", router.openapi_page)
    return app
