"""Node-to-node HTTP calls (``/internal/*``): the internal token, presented and checked.

The token (``--internal-token`` / ``PDPOOL_INTERNAL_TOKEN``) travels in ``X-PDPool-Internal-Token``; when a
node has one configured, every ``/internal/*`` request must present it.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from pdpool.server.errors import APIError
from pdpool.utils import http_url

HEADER = "X-PDPool-Internal-Token"
PREFIX = "/internal/"


def headers(token: str | None) -> dict[str, str]:
    return {HEADER: token} if token else {}


def check(request: web.Request, token: str | None) -> None:
    if not token:
        return
    given = request.headers.get(HEADER, "")
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise APIError("internal endpoint: missing or wrong internal token", status=403, code="invalid_internal_token")


def url(host: str, port: int, path: str) -> str:
    return http_url(host, port, PREFIX + path)
