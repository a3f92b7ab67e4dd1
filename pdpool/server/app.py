"""The OpenAI HTTP surface of one node (aiohttp): completions, chat, models, health, metrics.

The server listens at once and loads the model in the background: ``/health/live`` answers 200 from the
start, ``/health/ready`` (and ``/health``) 503 until the engine is loaded, and ``/v1/*`` 503 meanwhile.
Clients that disconnect cancel their handler (``handler_cancellation=True``), which aborts their requests.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from typing import Any, Callable

from aiohttp import web

from pdpool import internal_api
from pdpool.engine.async_llm import AsyncLLM
from pdpool.engine.llm_engine import LLMEngine
from pdpool.server import protocol
from pdpool.server.errors import APIError, error_middleware
from pdpool.server.metrics import CONTENT_TYPE, ServerMetrics
from pdpool.server.serving import Generation, full_response, stream_response

logger = logging.getLogger("pdpool.server")

CONFIG_KEY = web.AppKey("config", object)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
STATE_KEY = web.AppKey("state", dict)

PUBLIC_PATHS = ("/health", "/metrics", "/ping", "/version",
                "/internal/")  # node-to-node: checked against the internal token instead (pdpool.internal_api)


class _Observer:
    """Feeds the engine loop's latencies into the app's histograms."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def on_first_token(self, seconds: float) -> None:
        self.m.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.m.itl.observe(seconds)

    def on_finished(self, seconds: float) -> None:
        self.m.e2e.observe(seconds)


def _auth_middleware(api_key: str | None):
    @web.middleware
    async def auth(request: web.Request, handler):
        if api_key and not request.path.startswith(PUBLIC_PATHS):
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise APIError("Invalid or missing API key (Authorization: Bearer <key>).", status=401,
                               code="invalid_api_key")
        return await handler(request)

    return auth


def require_llm(request: web.Request) -> AsyncLLM:
    """The app's AsyncLLM, or a 503 while it loads (role modules' handlers use it too)."""
    state = request.app[STATE_KEY]
    if state.get("error"):
        raise APIError(f"the engine failed to load: {state['error']}", status=503)
    llm = state.get("llm")
    if llm is None:
        raise APIError("the model is still loading", status=503)
    return llm


def _served_names(request: web.Request) -> list[str]:
    return [request.app[CONFIG_KEY].served_model_name]


# ---- handlers ------------------------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    body = await protocol.read_json(request)
    llm = require_llm(request)
    req = protocol.parse_completion(body, _served_names(request))
    return await _generate(request, llm, req)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await protocol.read_json(request)
    llm = require_llm(request)
    req = protocol.parse_chat(body, _served_names(request), llm.engine.apply_chat_template)
    return await _generate(request, llm, req)


async def _generate(request: web.Request, llm: AsyncLLM, req: protocol.GenerationRequest) -> web.StreamResponse:
    gen = Generation(llm, req)
    await gen.start()
    if req.stream:
        return await stream_response(gen, request)
    return web.json_response(await full_response(gen))


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG_KEY]
    state = request.app[STATE_KEY]
    llm = state.get("llm")
    card = {"id": cfg.served_model_name, "object": "model", "created": state["created"], "owned_by": "pdpool",
            "root": cfg.model.model, "parent": None}
    if llm is not None:
        card["max_model_len"] = llm.max_model_len
    return web.json_response({"object": "list", "data": [card]})


async def health_live(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def health_ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.get("draining"):
        return web.json_response({"status": "draining"}, status=503)
    if state.get("llm") is None:
        status = "failed" if state.get("error") else "loading"
        return web.json_response({"status": status, "error": state.get("error")}, status=503)
    return web.json_response({"status": "ready", "role": request.app[CONFIG_KEY].server.role})


async def drain(request: web.Request) -> web.Response:
    """``POST /internal/drain`` (the preStop hook): readiness turns false, so the Service and the router stop
    sending work; requests in flight and KV leases already granted are still served to the end."""
    internal_api.check(request, request.app[CONFIG_KEY].disagg.internal_token)
    if not request.app[STATE_KEY].get("draining"):
        logger.info("draining: /health/ready now answers 503; in-flight work continues")
    request.app[STATE_KEY]["draining"] = True
    return web.json_response({"status": "draining"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": CONTENT_TYPE})


# ---- app -----------------------------------------------------------------------------------------

_EMPTY_STATS = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=0, num_total_blocks=0,
                    prefix_cache_hit_rate=0.0, num_prefill_chunks=0, prefix_cache_hit_tokens=0,
                    prefix_cache_queried_tokens=0, num_preemptions=0, prompt_tokens=0, generation_tokens=0,
                    num_finished=0, block_size=0)


def create_app(node_config, *, llm: AsyncLLM | None = None,
               engine_factory: Callable[[Any], LLMEngine] | None = None) -> web.Application:
    """The node's app. Without ``llm``, the engine (``engine_factory(node_config)``, default ``LLMEngine``) loads
    in a thread once the app starts; role modules add their routes to the returned app before it starts."""
    app = web.Application(middlewares=[error_middleware, _auth_middleware(node_config.server.api_key)],
                          client_max_size=64 * 1024 * 1024)
    state: dict = {"llm": llm, "error": None, "created": int(time.time())}
    app[STATE_KEY] = state
    app[CONFIG_KEY] = node_config

    def stats() -> dict:
        current = state.get("llm")
        if current is None:
            return dict(_EMPTY_STATS, block_size=node_config.cache.block_size)
        return current.stats()

    app[METRICS_KEY] = ServerMetrics(stats)
    observer = _Observer(app[METRICS_KEY])
    if llm is not None:
        llm.latency_observer = observer

    async def load_engine(app: web.Application) -> None:
        if state["llm"] is not None:
            return

        def build() -> AsyncLLM:
            engine = engine_factory(node_config) if engine_factory is not None else None
            return AsyncLLM(node_config, latency_observer=observer, engine=engine)

        async def load() -> None:
            try:
                state["llm"] = await asyncio.get_running_loop().run_in_executor(None, build)
                logger.info("engine ready: %s (max_model_len %d)", node_config.served_model_name,
                            state["llm"].max_model_len)
            except Exception as exc:  # noqa: BLE001 - reported by /health/ready and 503s
                logger.exception("engine failed to load")
                state["error"] = f"{type(exc).__name__}: {exc}"

        state["load_task"] = asyncio.get_running_loop().create_task(load())

    async def shutdown_engine(app: web.Application) -> None:
        task = state.get("load_task")
        if task is not None and not task.done():
            await asyncio.wait([task])
        if state.get("llm") is not None:
            await state["llm"].shutdown()

    app.on_startup.append(load_engine)
    app.on_cleanup.append(shutdown_engine)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health_ready)
    app.router.add_get("/health/live", health_live)
    app.router.add_get("/health/ready", health_ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post(internal_api.PREFIX + "drain", drain)
    return app


async def serve(node_config, *, stop: asyncio.Event | None = None, app: web.Application | None = None) -> None:
    app = app if app is not None else create_app(node_config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, node_config.server.host, node_config.server.port)
    await site.start()
    logger.info("pdpool %s node listening on http://%s:%d (model %s)", node_config.server.role,
                node_config.server.host, node_config.server.port, node_config.served_model_name)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        logger.info("shutting down")
        await runner.cleanup()


def run_server(node_config) -> None:
    from pdpool import disagg  # role sides, NIXL, Redis index

    asyncio.run(disagg.serve(node_config) if disagg.enabled(node_config) else serve(node_config))
