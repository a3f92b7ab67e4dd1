"""The aiohttp application, and `Emulator`: a server on a loopback port in a background thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

from aiohttp import web

from .api import Api
from .client import Client
from .endpoints import Endpoints
from .handlers import Handlers
from .openapi import OpenApiCache
from .resources import Registry
from .routing import path_for
from .store import Store


@dataclass
class Context:
    store: Store
    registry: Registry
    api: Api
    openapi: OpenApiCache
    bookmark_interval: float


def make_app(ctx: Context) -> web.Application:
    h, e = Handlers(ctx), Endpoints(ctx)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/version", e.version)
    app.router.add_get("/healthz", e.health)
    app.router.add_get("/readyz", e.health)
    app.router.add_get("/livez", e.health)
    app.router.add_get("/api", e.api_root)
    app.router.add_get("/apis", e.apis_root)
    app.router.add_get("/api/{version}", e.group_version)
    app.router.add_get("/apis/{group}", e.group)
    app.router.add_get("/apis/{group}/{version}", e.group_version)
    app.router.add_get("/openapi/v3", e.openapi_v3_root)
    app.router.add_get("/openapi/v3/{key:.+}", e.openapi_v3_doc)
    app.router.add_get("/openapi/v2", e.openapi_v2)
    app.router.add_get("/_emulator/writes", e.writes)
    app.router.add_delete("/_emulator/writes", e.clear_writes)
    for prefix in ("/api/{tail:.+}", "/apis/{tail:.+}"):
        app.router.add_route("*", prefix, h.resource)
    app.router.add_route("*", "/{tail:.*}", e.not_implemented)
    return app


class Emulator:
    """An in-memory Kubernetes API server. `with Emulator() as k8s:` serves at `k8s.url`.

    `k8s.api` is the in-process API (same semantics as HTTP, no write-log entries);
    `k8s.writes()` is the log of mutating HTTP requests.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, bookmark_interval: float = 5.0,
                 watch_history: int = 10000):
        store, registry = Store(watch_history), Registry()
        self.ctx = Context(store, registry, Api(store, registry), OpenApiCache(registry), bookmark_interval)
        self.host, self.port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def api(self) -> Api:
        return self.ctx.api

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def registry(self) -> Registry:
        return self.ctx.registry

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Emulator":
        ready = threading.Event()
        errors: list[BaseException] = []

        def serve():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._start_site())
            except BaseException as e:  # reported to the starting thread
                errors.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="k8s-emulator", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        return self

    async def _start_site(self) -> None:
        self._runner = web.AppRunner(make_app(self.ctx), shutdown_timeout=0.5,
                                     access_log=logging.getLogger("k8s_emulator.access"),
                                     handler_cancellation=True)  # a closed watch ends its handler
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def stop(self) -> None:
        if self._loop and self._thread:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = self._thread = None

    def __enter__(self) -> "Emulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the write log ---------------------------------------------------------------------------

    def writes(self, **where) -> list[dict]:
        """Logged mutating requests whose fields equal `where`, e.g. `writes(kind="Deployment", method="PATCH")`."""
        with self.store.lock:
            return [dict(w) for w in self.store.writes if all(w.get(k) == v for k, v in where.items())]

    def clear_writes(self) -> None:
        self.store.clear_writes()

    def requests(self, **where) -> list[dict]:
        """Every resource request (reads and watches too) with its RBAC verb, group, resource, subresource,
        namespace and user agent, e.g. `requests(verb="watch")`: what a client's Role must allow."""
        with self.store.lock:
            return [dict(r) for r in self.store.requests if all(r.get(k) == v for k, v in where.items())]

    def resource(self, api_version: str, plural: str):
        """The served type, for the in-process API: `k8s.api.get(k8s.resource("apps/v1", "deployments"), ns, n)`."""
        group, _, version = api_version.rpartition("/")
        rt = self.registry.get(group, version, plural)
        if rt is None:
            raise KeyError(f"{plural} is not served at {api_version}")
        return rt

    def set_status(self, api_version: str, plural: str, namespace: str | None, name: str, status: dict) -> dict:
        """Merge-patches `status` through the status subresource, as envtest tests do for children."""
        reply = self.client().patch(path_for(api_version, plural, namespace, name, "status"), {"status": status})
        if reply.status != 200:
            raise RuntimeError(f"setting the status of {plural}/{name} failed: {reply.body}")
        return reply.body

    def client(self, user_agent: str = "emulator-test-client") -> Client:
        return Client(self.url, user_agent)
