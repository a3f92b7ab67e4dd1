"""The router's composition root and HTTP surface.

``Router`` builds every piece from the config (discovery, prefix index, scheduler, request path, metrics), owns
their lifecycle, and answers ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and Anthropic's ``/v1/messages`` (each
routed as its chat request), ``/v1/messages/count_tokens``, ``/v1/models``, ``/health/live``, ``/health/ready``, ``/metrics`` and ``/openapi.json`` through the raw
HTTP/1.1 server (``router/server.py``).
``handle`` does what a middleware would: CORS (``pdpool.server.cors``), the request id, authentication, OpenAI errors,
the response counter. A client that disconnects cancels its request's task, which closes the upstream legs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from pdpool import __version__
from pdpool.config import auto_tool_parser
from pdpool.frontend import Frontend
from pdpool.logs import HEADER as REQUEST_ID_HEADER, request_id_from, request_id_var
from pdpool.router import openapi
from pdpool.router.endpoints import Pool
from pdpool.router.handoff import RequestPath, _PassThrough, pass_through
from pdpool.router.http1 import Http1Client, httptools
from pdpool.router.inflight import InflightTracker
from pdpool.router.metrics import CONTENT_TYPE, RouterMetrics
from pdpool.router.prefix_index import ApproxIndex, PrefixIndex
from pdpool.router.request import new_request_id, parse
from pdpool.router.scheduler import Scheduler
from pdpool.router.server import Exchange, Request
from pdpool.router.settings import SchedulerProfile
from pdpool.router.upstream import Upstream
from pdpool.server import anthropic_messages, json_body, protocol, tokenize
from pdpool.server.auth import bearer, check_api_key
from pdpool.server.cors import PLAIN_TEXT, CorsPolicy
from pdpool.server.errors import APIError

logger = logging.getLogger("pdpool.router")

PUBLIC = ("/health", "/metrics", "/openapi.json", "/version")
GENERATE = ("/v1/completions", "/v1/chat/completions", "/v1/responses", anthropic_messages.PATH)
# (method, path) -> handler name; GET routes answer HEAD too. /openapi.json lists what is here. MODEL_PATH stands
# for every path under /v1/models/ (OpenAI's retrieve: the rest of the path is the model's name, slashes and all).
MODEL_PATH = "/v1/models/{model}"
PRIORITY_KEY = protocol.PRIORITY_HEADER.lower()   # request.headers' keys are lower case
RETRY_AFTER = "1"      # seconds, on the router's own 429
ROUTES = {("POST", "/v1/completions"): "generate", ("POST", "/v1/chat/completions"): "generate",
          ("POST", "/v1/responses"): "generate", ("POST", anthropic_messages.PATH): "generate",
          ("POST", anthropic_messages.COUNT_TOKENS_PATH): "count_tokens_page",
          ("GET", "/v1/models"): "models", ("GET", MODEL_PATH): "model", ("GET", "/health/live"): "health_live",
          ("GET", "/health/ready"): "health_ready", ("GET", "/health"): "health_ready",
          ("GET", "/metrics"): "metrics_page", ("GET", "/openapi.json"): "openapi_page",
          ("POST", "/tokenize"): "tokenize_page", ("POST", "/detokenize"): "detokenize_page",
          ("GET", "/version"): "version_page"}
_ALLOWED: dict[str, list[str]] = {}
for _method, _path in ROUTES:
    _ALLOWED.setdefault(_path, []).extend([_method, "HEAD"] if _method == "GET" else [_method])


def _json(value, status: int = 200) -> tuple[int, bytes, str]:
    return status, json.dumps(value).encode(), "application/json"


class Router:
    def __init__(self, cfg, profile: SchedulerProfile, frontend: Frontend) -> None:
        self.cfg = cfg
        r = cfg.router
        self.frontend = frontend
        self.served_names = cfg.served_model_names   # the first: what the nodes serve (they may serve it alone)
        self.tool_parser = auto_tool_parser(r)   # tool_choice "auto": accepted and refused as the nodes do
        self.cors = CorsPolicy.from_config(r)
        self.created = int(time.time())
        self.pool = Pool(r.node_cooldown)
        self.inflight = InflightTracker()
        self.metrics = RouterMetrics(self.pool, self.inflight)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="router-redis")
        self.reader = None
        if r.redis:
            from pdpool.kv_index import IndexReader, PoolKeys, connect

            keys = PoolKeys(r.namespace or "default", r.pool)   # the nodes' default (no pod namespace)
            self.reader = IndexReader(connect(r.redis, r.redis_password, timeout=0.25), keys)
        self.index = PrefixIndex(self.reader, ApproxIndex(r.approx_index_entries), self.run_sync, self.metrics,
                                 recent_seconds=r.recent_seconds, lookup=r.index_lookup)
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

    async def start(self) -> None:
        r = self.cfg.router
        # the nodes' session (requests, probes): it presents the router's key, which a pool's nodes share
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
                                             auto_decompress=False, headers=bearer(r.api_key))
        if self.reader is not None:
            from pdpool.router.index_reader import AsyncIndexReader

            self.index.async_reader = AsyncIndexReader(r.redis, r.redis_password, self.reader.keys)
        self.http1 = Http1Client() if httptools is not None else None
        upstream = Upstream(self.session, connect_timeout=r.connect_timeout, request_timeout=r.request_timeout,
                            internal_token=r.internal_token, api_key=r.api_key, http1=self.http1)
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

    async def stop(self) -> None:
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

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until no generation request is in flight."""
        deadline = time.monotonic() + timeout
        while self.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---- HTTP ---------------------------------------------------------------------------------------------

    async def handle(self, request: Request, exchange: Exchange) -> None:
        """Request id, authentication, routing and OpenAI errors; counts the API's responses by status."""
        if "origin" in request.headers and self._cors(request, exchange):   # the one lookup when there is no CORS
            return
        header = request.headers.get(REQUEST_ID_HEADER)
        rid = request_id_from(header) if header else new_request_id()
        request_id_var.set(rid)       # this request's task has its own context
        try:
            if not request.path.startswith(PUBLIC):
                check_api_key(request.headers, self.cfg.router.api_key)
            path = MODEL_PATH if request.path.startswith("/v1/models/") else request.path
            name = ROUTES.get((request.method if request.method != "HEAD" else "GET", path))
            if name is None:
                allowed = _ALLOWED.get(path)
                if allowed is None:
                    raise APIError("Not Found", status=404)
                raise _MethodNotAllowed(allowed)
            if name == "generate":
                await self.generate(request, exchange, rid, rid == header)
            else:
                status, body, content_type = await getattr(self, name)(request)
                exchange.respond(status, body, content_type, {REQUEST_ID_HEADER: rid})
        except APIError as err:
            if err.status >= 500:
                logger.warning("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
            self._error(exchange, err, rid, request.path)
        except _MethodNotAllowed as exc:
            self._error(exchange, APIError("Method Not Allowed", status=405), rid, request.path,
                        {"Allow": ", ".join(exc.allowed)})
        except _PassThrough as exc:
            if not exchange.started:
                pass_through(exchange, exc, rid)
        except (asyncio.CancelledError, ConnectionResetError):
            logger.info("client disconnected from %s %s", request.method, request.path)
            raise
        except Exception as exc:  # noqa: BLE001 - the router must stay up
            logger.exception("internal error on %s %s", request.method, request.path)
            self._error(exchange, APIError(f"internal error: {type(exc).__name__}: {exc}", status=500), rid,
                        request.path)
        if not request.path.startswith(PUBLIC):   # probes and scrapes are not the API's answers (a not-ready 503)
            self.metrics.count_response(exchange.status)

    def _cors(self, request: Request, exchange: Exchange) -> bool:
        """A request from a browser's page (it has an ``Origin``): its preflight is answered here, before the API
        key (True); any other request is served as ever, its answer with the CORS headers (``pdpool.server.cors``)."""
        headers = request.headers
        origin = headers["origin"]
        if request.method == "OPTIONS" and "access-control-request-method" in headers:
            status, text, cors_headers = self.cors.preflight(origin, headers["access-control-request-method"],
                                                             headers.get("access-control-request-headers"))
            exchange.respond(status, text.encode(), PLAIN_TEXT, cors_headers)
            return True
        exchange.cors = self.cors.response_headers(origin, "cookie" in headers) or None
        return False

    @staticmethod
    def _error(exchange: Exchange, err: APIError, rid: str, path: str, headers: dict | None = None) -> None:
        if exchange.started:          # mid-stream: the request path already sent its error event
            return
        if err.status == 429:         # the router's own (--max-inflight): in flight requests end within seconds
            headers = {"Retry-After": RETRY_AFTER, **(headers or {})}
        exchange.respond(err.status, json.dumps(err.body_for(path)).encode(), "application/json",
                         {REQUEST_ID_HEADER: rid, **(headers or {})})

    async def generate(self, request: Request, exchange: Exchange, rid: str, client_id: bool) -> None:
        """``client_id``: ``rid`` is the client's X-Request-Id (``RoutedRequest.client_request_id``)."""
        limit = self.cfg.router.max_inflight
        if limit and self.num_inflight >= limit:
            raise APIError(f"too many requests in flight (--max-inflight {limit}); retry later", status=429,
                           code="too_many_requests")
        self.num_inflight += 1
        try:
            body = self._body(request)
            rr = parse(request.path, body, self.frontend, self.served_names, rid, request.body, self.tool_parser,
                       trust_chat_template=self.cfg.router.trust_request_chat_template)
            rr.client_request_id = client_id
            if PRIORITY_KEY in request.headers:   # vLLM's X-Vllm-Priority: the nodes honour it
                rr.headers = {protocol.PRIORITY_HEADER: request.headers[PRIORITY_KEY]}
            if len(self.served_names) > 1:
                rr.name_model(self.served_names[0])
            await self.path.serve(exchange, rr)
        finally:
            self.num_inflight -= 1

    def _model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "pdpool",
                "root": self.cfg.router.model, "parent": None}
        max_model_len = self.max_model_len()
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return card

    def max_model_len(self) -> int | None:
        """What every node accepts: the smallest limit the nodes advertise (their --max-model-len may be below the
        model's), else the model's own from the front end's config.json."""
        advertised = [e.max_model_len for e in self.pool.endpoints.values() if isinstance(e.max_model_len, int)]
        return min(advertised) if advertised else self.frontend.files.max_position_embeddings

    async def models(self, request: Request):
        return _json({"object": "list", "data": [self._model_card(n) for n in self.served_names]})

    async def model(self, request: Request):
        name = request.path[len("/v1/models/"):]
        if name not in self.served_names:
            raise protocol.model_not_found(name, self.served_names)
        return _json(self._model_card(name))

    def _body(self, request: Request) -> dict:
        if "content-encoding" in request.headers:   # decoded in place: the request path forwards the raw body too
            request.body = json_body.decode_content(request.body, request.headers["content-encoding"])
        return json_body.request_json(request.body, request.headers.get("content-type"))

    async def tokenize_page(self, request: Request):
        """vLLM's ``POST /tokenize``, from the router's own front end (no node is asked)."""
        return _json(tokenize.tokenize(self._body(request), self.frontend, self.served_names, self.max_model_len(),
                                       trust_chat_template=self.cfg.router.trust_request_chat_template))

    async def count_tokens_page(self, request: Request):
        """Anthropic's ``POST /v1/messages/count_tokens``, from the router's own front end (as ``/tokenize``)."""
        turn = anthropic_messages.translate(self._body(request), count_tokens=True)
        return _json(anthropic_messages.counted(tokenize.tokenize(
            anthropic_messages.count_tokens_body(turn), self.frontend, self.served_names, self.max_model_len(),
            trust_chat_template=self.cfg.router.trust_request_chat_template)))

    async def detokenize_page(self, request: Request):
        return _json(tokenize.detokenize(self._body(request), self.frontend, self.served_names))

    async def health_live(self, request: Request):
        return _json({"status": "alive", "pid": os.getpid()})  # with --workers: which one answered

    async def version_page(self, request: Request):
        return _json({"version": __version__})

    async def health_ready(self, request: Request):
        nodes = {e.node_id: e.role for e in self.pool.decode_candidates()}
        if not nodes:
            return _json({"status": "no ready node"}, 503)
        return _json({"status": "ready", "nodes": nodes})

    async def metrics_page(self, request: Request):
        return 200, self.metrics.render(), CONTENT_TYPE

    async def openapi_page(self, request: Request):
        return _json(openapi.spec(ROUTES, served_model_names=self.served_names, api_key=bool(self.cfg.router.api_key),
                                  vocab_size=self.frontend.vocab_size, max_model_len=self.max_model_len(),
                                  auto_tool_choice=self.tool_parser is not None,
                                  chat_template=self.cfg.router.trust_request_chat_template))


class _MethodNotAllowed(Exception):
    def __init__(self, allowed: list[str]) -> None:
        super().__init__("method not allowed")
        self.allowed = allowed
