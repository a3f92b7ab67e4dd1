"""HTTP legs to the nodes, with failures classified for retries and metrics.

The generation legs (prefill, decode) of ``http://`` nodes go through the lean HTTP/1.1 client
(``router/http1.py``); ``https://`` nodes, lease releases, and every leg when ``httptools`` is missing go through
the shared aiohttp session. Both answer with the same small response interface (``status``, ``content_type``,
``readany()``, ``read()``, ``close()``), and their transport failures are ``TRANSPORT_ERRORS``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import quote

import aiohttp

from pdpool import internal_api
from pdpool.logs import HEADER as REQUEST_ID_HEADER
from pdpool.router.http1 import HTTPClientError, Http1Client
from pdpool.server.auth import bearer

TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, HTTPClientError)

logger = logging.getLogger("pdpool.router")


class ClientErrorReply(Exception):
    """A node refused the request itself (4xx other than 429): the client gets the node's answer as is.
    ``headers``: the node's that go with it (a 429's ``Retry-After``)."""

    def __init__(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        super().__init__(f"node answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


class UpstreamError(Exception):
    """A leg failed before the client saw anything: ``kind`` is connect, timeout, http_5xx, http_429 or
    stream_broken. ``reply``: a 429's answer, for the client when no other node answers."""

    def __init__(self, kind: str, message: str, status: int | None = None,
                 reply: ClientErrorReply | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.reply = reply


def busy_reply(resp, body: bytes, retry_after: str) -> ClientErrorReply:
    """A node's 429 as the client gets it: its body, and its ``Retry-After``, else ``retry_after``."""
    return ClientErrorReply(resp.status, body, resp.content_type,
                            {"Retry-After": resp.headers.get("retry-after") or retry_after})


def classify_status(status: int) -> str | None:
    if status == 429:
        return "http_429"
    if status >= 500:
        return "http_5xx"
    return None


class _AiohttpResponse:
    """An aiohttp response behind the lean client's response interface."""

    __slots__ = ("_resp", "status", "content_type", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.content_type
        self.headers = resp.headers

    async def readany(self) -> bytes:
        return await self._resp.content.readany()

    async def read(self) -> bytes:
        return await self._resp.read()

    def close(self) -> None:
        self._resp.close()


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, *, connect_timeout: float, request_timeout: float,
                 internal_token: str | None, api_key: str | None = None, http1: Http1Client | None = None) -> None:
        self.session = session
        self.http1 = http1
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.internal_token = internal_token
        # the router's own key: a pool's nodes hold the same one and ask every /v1 request for it
        self._headers = {"Content-Type": "application/json", **internal_api.headers(internal_token), **bearer(api_key)}

    def headers(self, request_id: str) -> dict[str, str]:
        return {REQUEST_ID_HEADER: request_id, **internal_api.headers(self.internal_token)}

    def timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        """The wait for each read, as the lean client's (``router/http1.py``): a stream that keeps coming is not cut."""
        return aiohttp.ClientTimeout(sock_read=total or self.request_timeout, sock_connect=self.connect_timeout)

    async def open(self, url: str, body: dict | bytes, request_id: str, timeout: float | None = None,
                   client_headers: dict | None = None):
        """POST (a dict, or JSON already serialized) and wait for the status line and headers; the caller reads
        (``readany()``, ``read()``) and closes the response."""
        return await self.send(url, body, request_id, timeout, client_headers=client_headers)

    def send(self, url: str, body: dict | bytes, request_id: str, timeout: float | None = None, on_complete=None,
             client_headers: dict | None = None):
        """``open``, with the request written now when a pooled connection to the node is idle (the lean
        client), so that the caller's bookkeeping overlaps the node's work; await the result for the response.
        ``on_complete(response)``: see ``Http1Client.request_now`` (the lean client only). ``client_headers``: the
        client's own that the node gets too (``RoutedRequest.headers``)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**self._headers, REQUEST_ID_HEADER: request_id}
        if client_headers:
            headers.update(client_headers)
        if self.http1 is not None and url.startswith("http://"):
            pending = self.http1.request_now(url, data, headers, timeout=timeout or self.request_timeout,
                                             connect_timeout=self.connect_timeout, on_complete=on_complete)
        else:
            pending = self.session.post(url, data=data, headers=headers, timeout=self.timeout(timeout))
        return self._opened(url, pending)

    async def _opened(self, url: str, pending):
        try:
            resp = await pending
        except asyncio.TimeoutError as exc:
            raise UpstreamError("timeout", f"{url}: no answer in time") from exc
        except (aiohttp.ClientError, HTTPClientError) as exc:
            raise UpstreamError("connect", f"{url}: {type(exc).__name__}: {exc}") from exc
        return resp if self.http1 is not None and url.startswith("http://") else _AiohttpResponse(resp)

    async def post_json(self, url: str, body: dict, request_id: str, timeout: float | None = None,
                        client_headers: dict | None = None) -> dict:
        """A whole JSON answer; 4xx -> ``ClientErrorReply``, 5xx/429/transport -> ``UpstreamError``."""
        resp = await self.open(url, body, request_id, timeout, client_headers)
        try:
            data = await resp.read()
        except asyncio.TimeoutError as exc:
            raise UpstreamError("timeout", f"{url}: body not read in time") from exc
        except TRANSPORT_ERRORS as exc:
            raise UpstreamError("stream_broken", f"{url}: {type(exc).__name__}: {exc}") from exc
        finally:
            resp.close()
        kind = classify_status(resp.status)
        if kind:
            raise UpstreamError(kind, f"{url} answered {resp.status}: {data[:300]!r}", resp.status)
        if resp.status != 200:
            raise ClientErrorReply(resp.status, data, resp.content_type)
        try:
            return json.loads(data)
        except ValueError as exc:
            raise UpstreamError("http_5xx", f"{url} answered malformed JSON") from exc

    async def release_lease(self, node_url: str, lease_id: str, request_id: str) -> None:
        """Tell a prefill node to free a lease's blocks now (best effort; the lease expires anyway)."""
        await self._release(f"{node_url}/internal/kv/leases/{quote(lease_id, safe='')}/notify", f"lease {lease_id}",
                            node_url, request_id)

    async def release_response(self, node_url: str, request_id: str) -> None:
        """Tell a prefill node to free the leases of response ``request_id``, if it has any: its client left while
        the prefill leg was on its way back, so a handle the node wrote may never have been read (best effort)."""
        await self._release(f"{node_url}/internal/kv/responses/{quote(request_id, safe='')}/release",
                            f"the leases of {request_id}", node_url, request_id)

    async def _release(self, url: str, what: str, node_url: str, request_id: str) -> None:
        try:
            async with self.session.post(url, json={"release": True}, headers=self.headers(request_id),
                                         timeout=self.timeout(5.0)) as resp:
                await resp.read()
                if resp.status != 200:
                    logger.warning("release of %s at %s answered %d", what, node_url, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.info("could not release %s at %s (leases expire on their own): %s", what, node_url, exc)
