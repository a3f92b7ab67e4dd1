"""Cluster-level endpoints: discovery, /version, health, OpenAPI v3, and the emulator's write log."""

from __future__ import annotations

import json

from aiohttp import web

from . import discovery
from .errors import ApiError, not_implemented
from .handlers import json_response, status_response, unknown_resource

VERSION = {"major": "1", "minor": "35", "gitVersion": "v1.35.0-emulator", "gitCommit": "", "gitTreeState": "clean",
           "buildDate": "2026-01-01T00:00:00Z", "goVersion": "python", "compiler": "python",
           "platform": "linux/amd64"}


class Endpoints:
    def __init__(self, ctx):
        self.ctx = ctx

    # -- discovery, version, OpenAPI ------------------------------------------------------------

    def _aggregated(self, request, core: bool):
        if not discovery.wants_aggregated(request.headers.get("Accept", "")):
            return None
        body = json.dumps(discovery.aggregated(self.ctx.registry, core)).encode()
        return web.Response(body=body, headers={"Content-Type": discovery.AGGREGATED})

    async def api_root(self, request):
        return self._aggregated(request, True) or json_response(discovery.api_versions(request.host))

    async def apis_root(self, request):
        return self._aggregated(request, False) or json_response(discovery.api_group_list(self.ctx.registry))

    async def group(self, request):
        doc = discovery.api_group(self.ctx.registry, request.match_info["group"])
        return json_response(doc) if doc else status_response(unknown_resource())

    async def group_version(self, request):
        group = request.match_info.get("group", "")
        doc = discovery.api_resource_list(self.ctx.registry, group, request.match_info["version"])
        return json_response(doc) if doc else status_response(unknown_resource())

    async def version(self, request):
        return json_response(VERSION)

    async def openapi_v3_root(self, request):
        return json_response(self.ctx.openapi.root())

    async def openapi_v3_doc(self, request):
        doc = self.ctx.openapi.document(request.match_info["key"])
        if doc is None:
            return status_response(unknown_resource())
        return web.Response(body=doc, content_type="application/json")

    async def openapi_v2(self, request):
        return status_response(ApiError(404, "the emulator serves OpenAPI v3 only (/openapi/v3)"))

    async def health(self, request):
        return web.Response(text="ok")

    async def not_implemented(self, request):
        return status_response(not_implemented(f"{request.method} {request.path}"))

    # -- the write log ---------------------------------------------------------------------------

    async def writes(self, request):
        with self.ctx.store.lock:
            return json_response(list(self.ctx.store.writes))

    async def clear_writes(self, request):
        self.ctx.store.clear_writes()
        return json_response({"cleared": True})
