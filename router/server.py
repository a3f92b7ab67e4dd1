"""The router's HTTP/1.1 server: a raw asyncio protocol on httptools' request parser (llhttp).

    bytes -> HttpRequestParser -> Request (method, path, headers, whole body) -> a queue per connection
          -> one task per request, in arrival order, started eagerly -> handler(request, exchange)
          -> exchange.respond(status, body)                     head and body in one write
             or exchange.start_stream / write / end_stream      chunked (HTTP/1.0: until close), with back-pressure

Why not aiohttp's server: its request objects, middleware chain and response machinery cost about 0.4 ms of
the router's serial path per request at low load (docs/performance.md, round 4). The router needs little of it:
a body read whole (the handler parses JSON anyway), a small route table, JSON or SSE out.

Keep-alive per HTTP/1.1 (``Connection: close`` and HTTP/1.0 honoured); a connection with nothing to answer for
``KEEPALIVE_SECONDS`` is closed, with a 408 if a request was still arriving. Pipelined requests are answered in order,
one at a time; reading pauses while ``MAX_QUEUED`` wait. ``Expect: 100-continue`` gets its interim answer once the
request is next; any other expectation is a 417. A malformed request, a head over ``MAX_HEAD`` bytes or a body over
``MAX_BODY`` bytes gets its OpenAI error (400, 431, 413) after the answers before it, and the connection closes. A
client that disconnects cancels its request's task: the handler's ``CancelledError`` closes the node legs (the nodes
abort).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
from collections import deque
from email.utils import formatdate
from urllib.parse import unquote

import httptools

from pdpool.router.eager import start_eagerly
from pdpool.server.errors import APIError
from pdpool.server.json_body import MAX_BODY_BYTES as MAX_BODY, MAX_HEAD_BYTES as MAX_HEAD, REQUEST_SECONDS
from pdpool.utils import bind_sockets

logger = logging.getLogger("pdpool.router")

# A request's task starts eagerly on Python 3.12+ (asyncio's own eager_start, in C). On 3.11 the hand-made start
# of router/eager.py costs more than the loop iteration it saves (docs/performance.md, router overhead round 12).
EAGER = sys.version_info >= (3, 12)
MAX_QUEUED = 16                 # pipelined requests waiting before reading pauses
KEEPALIVE_SECONDS = REQUEST_SECONDS   # an idle connection is closed after this long (aiohttp's default)
REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large", 415: "Unsupported Media Type",
           417: "Expectation Failed", 422: "Unprocessable Entity", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout"}


def error_body(message: str, status: int) -> bytes:
    return json.dumps(APIError(message, status=status).body()).encode()


class Headers(dict):
    """Request headers by lower-case name; ``get`` takes any case. A repeated header's values are joined
    with ", "."""

    def get(self, name: str, default=None):
        return dict.get(self, name.lower(), default)


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "http_10", "_url", "_chunks",
                 "_size", "expect_continue", "error", "upgrade")

    def __init__(self) -> None:
        self.method = ""
        self.path = ""
        self.query = ""
        self.headers = Headers()
        self.body = b""
        self.keep_alive = True
        self.http_10 = False
        self._url = b""
        self._chunks: list[bytes] = []
        self._size = 0                # bytes read: of the head (see data_received), then of the body
        self.expect_continue = False
        self.error: tuple[int, str] | None = None   # answered with this error, then the connection closes
        self.upgrade = False          # asked for another protocol (``Upgrade``, ``CONNECT``): see _declined_upgrade


_date = ["", 0.0]


def _http_date() -> str:
    now = time.time()
    if now - _date[1] >= 1.0:
        _date[0], _date[1] = formatdate(now, usegmt=True), now
    return _date[0]


class Exchange:
    """One response to one request: whole (``respond``) or streamed (``start_stream``, ``write``, ``end_stream``)."""

    __slots__ = ("_conn", "_request", "status", "started", "finished", "_chunked", "cors")

    def __init__(self, conn: "HttpConnection", request: Request) -> None:
        self._conn = conn
        self._request = request
        self.status = 0
        self.started = False
        self.finished = False
        self._chunked = False
        self.cors: dict | None = None   # headers every answer carries, errors included (a CORS request's)

    def _head(self, status: int, headers: dict, framing: str) -> bytes:
        keep = self._request.keep_alive
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\nDate: {_http_date()}\r\n{framing}"]
        if self.cors is not None:
            headers = {**headers, **self.cors}
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n")
        if not keep:
            lines.append("Connection: close\r\n")
        elif self._request.http_10:
            lines.append("Connection: keep-alive\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def respond(self, status: int, body: bytes, content_type: str = "application/json",
                headers: dict | None = None) -> None:
        """The whole answer, head and body in one write."""
        if self.started:
            raise RuntimeError("a response was already started")
        self.started = self.finished = True
        self.status = status
        h = {"Content-Type": content_type, **(headers or {})}
        head = self._head(status, h, f"Content-Length: {len(body)}\r\n")
        self._conn.write(head if self._request.method == "HEAD" else head + body)

    async def start_stream(self, status: int, headers: dict) -> None:
        if self.started:
            raise RuntimeError("a response was already started")
        self.started = True
        self.status = status
        if self._request.http_10:           # no chunked encoding: the body ends when the connection does
            self._request.keep_alive = False
            self._conn.write(self._head(status, headers, ""))
        else:
            self._chunked = True
            self._conn.write(self._head(status, headers, "Transfer-Encoding: chunked\r\n"))
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._conn.write(data)
        await self._conn.drain()

    async def end_stream(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")


class HttpConnection(asyncio.Protocol):
    """One client connection. ``handler(request, exchange)`` must answer through the exchange."""

    def __init__(self, handler, loop: asyncio.AbstractEventLoop) -> None:
        self.handler = handler
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.incoming: Request | None = None
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task | None = None
        self.closing = False          # no request after the current ones: answer them, then close
        self.closed = False
        self._reading_paused = False
        self._writing_paused = False
        self._drain: asyncio.Future | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None   # when the connection last became idle; None while it serves
        self._upgrading: Request | None = None  # a request that asked for another protocol, its head parsed

    # ---- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._idle_since = self.loop.time()
        self._idle_timer = self.loop.call_later(KEEPALIVE_SECONDS, self._idle_close)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return                    # after a malformed request nothing more is read
        r = self.incoming
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._declined_upgrade(data[exc.args[0]:])
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")
        else:
            if r is not None and r is self.incoming and not r.method:   # MAX_HEAD: the request line and headers
                # a read wholly inside one head: llhttp keeps the head (with no limit of its own) until it ends. The
                # head's first and last reads are not counted (each at most a read's size, and shared with others).
                r._size += len(data)
                if r._size > MAX_HEAD:
                    self._refuse(431, f"the request line and headers are larger than {MAX_HEAD} bytes")

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.task is not None:
            self.task.cancel()        # the handler closes its node legs: the nodes abort
        self._wake_drain()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_drain()

    # ---- llhttp callbacks ------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.closing:              # after a refused request: nothing more is served
            self.incoming = None
            return
        self.incoming = Request()
        if self.task is None and not self.queue:   # idle until now: the request has its own full time to arrive
            self._idle_since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        if self.incoming is not None:
            self.incoming._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.incoming is None:
            return
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        h = self.incoming.headers
        h[key] = h[key] + ", " + text if key in h else text

    def on_headers_complete(self) -> None:
        r = self.incoming
        if r is None:
            return
        r.method = self.parser.get_method().decode("latin-1")
        r.http_10 = self.parser.get_http_version() == "1.0"
        r.keep_alive = self.parser.should_keep_alive()
        url = r._url.decode("latin-1")
        path, _, r.query = url.partition("?")
        if path[:1] != "/" and "://" in path:   # absolute-form (RFC 9112, 3.2.2: a server must take it): its path
            path = "/" + path.partition("://")[2].partition("/")[2]
        r.path = unquote(path) if "%" in path else path
        if "upgrade" in r.headers or r.method == "CONNECT":
            r.upgrade = self.parser.should_upgrade()
        length = r.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY:
            self._refuse(413, f"the request body is larger than {MAX_BODY} bytes")   # without reading it
            return
        expect = r.headers.get("expect")
        if expect is not None and not r.http_10:   # HTTP/1.0's is ignored (RFC 9110, 10.1.1), as a node does
            if expect.lower() != "100-continue":   # as a node answers (aiohttp)
                self._refuse(417, f"Unknown Expect: {expect}")
                return
            if self.task is None and not self.queue:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:
                r.expect_continue = True   # sent when the requests before it are answered

    def on_body(self, body: bytes) -> None:
        r = self.incoming
        if r is None:                 # refused: the rest of the bytes are dropped
            return
        r._size += len(body)
        if r._size > MAX_BODY:        # a chunked body past the limit
            self._refuse(413, f"the request body is larger than {MAX_BODY} bytes")
            return
        r._chunks.append(body)

    def on_message_complete(self) -> None:
        r = self.incoming
        if r is None:
            return
        self.incoming = None
        if r.upgrade:                 # llhttp ends the message at its head: _declined_upgrade reads it again
            self._upgrading = r
            return
        self._idle_since = None       # busy: the idle timer, left armed, finds that when it fires
        r.body = r._chunks[0] if len(r._chunks) == 1 else b"".join(r._chunks)
        r._chunks = []
        self.queue.append(r)
        if self.task is None:
            self._next()
        elif len(self.queue) >= MAX_QUEUED and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    # ---- serving ------------------------------------------------------------------------------------------------

    def _declined_upgrade(self, rest: bytes) -> None:
        """A request asked to switch protocols (``Upgrade: h2c`` from ``curl --http2``, a WebSocket handshake):
        llhttp stopped at the end of its head, as if everything after it were the new protocol's. The router
        speaks only HTTP/1.1 and may ignore the ask (RFC 9110, 7.8), so the request is read again as a plain one,
        body included, from its head without the upgrade, and answered with ``Connection: close``: a client still
        waiting for ``101`` learns that none comes, and nothing it sends after the request is read as HTTP."""
        r, self._upgrading = self._upgrading, None
        if r is None or r.method == "CONNECT":
            self._refuse(405 if r is not None else 400, "the CONNECT method is not supported" if r is not None
                         else "protocol upgrades are not supported")
            return
        drop = {"upgrade", "connection", "http2-settings", "keep-alive"}
        head = [f"{r.method} {r._url.decode('latin-1')} HTTP/{'1.0' if r.http_10 else '1.1'}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in r.headers.items() if name not in drop]
        head.append("Connection: close\r\n\r\n")
        self.parser = httptools.HttpRequestParser(self)
        self.data_received("".join(head).encode("latin-1") + rest)

    def _refuse(self, status: int, message: str) -> None:
        r = Request()
        r.keep_alive = False
        r.error = (status, message)
        self.closing = True
        self.incoming = None
        self.queue.append(r)
        if self.task is None:
            self._next()

    def _next(self) -> None:
        if self.closed:
            return
        if self.queue:
            r = self.queue.popleft()
            if r.error is not None:
                self._answer_error(r)
                return
            if EAGER and asyncio.current_task(self.loop) is None:   # from a callback: its first step runs now
                start_eagerly(self.loop, self._serve(r))   # (``_serve`` records its task)
            else:                     # from the task of the request before it: on the loop's next iteration
                self.task = self.loop.create_task(self._serve(r))
        else:                         # idle, or a request still arriving: either must be done in time
            self._idle_since = self.loop.time()
            if self._idle_timer is None:
                self._idle_timer = self.loop.call_later(KEEPALIVE_SECONDS, self._idle_close)
            incoming = self.incoming
            if incoming is not None and incoming.expect_continue:
                incoming.expect_continue = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self._reading_paused and len(self.queue) < MAX_QUEUED // 2:
            self._reading_paused = False
            self.transport.resume_reading()

    def _idle_close(self) -> None:
        """Closes a connection idle for ``KEEPALIVE_SECONDS``. One timer per connection, not one per request: a
        request that arrives meanwhile leaves it armed, and when it fires early (the connection became idle
        again since) it is set again for the rest of the new idle period. A request still arriving does not
        make the connection busy (a client that stops mid-head or mid-body would hold it for ever): it gets a
        408 if it is not whole by then."""
        self._idle_timer = None
        since = self._idle_since
        if since is None or self.closed:   # serving: _next sets the timer when the connection is idle again
            return
        rest = since + KEEPALIVE_SECONDS - self.loop.time()
        if rest > 0:
            self._idle_timer = self.loop.call_later(rest, self._idle_close)
            return
        if self.task is None and not self.queue and not self.closed:
            if self.incoming is not None:
                self._refuse(408, f"the request was not received within {KEEPALIVE_SECONDS:g} s")
                return
            self.transport.close()
            self.closed = True

    def _answer_error(self, r: Request) -> None:
        status, message = r.error
        r.keep_alive = False
        Exchange(self, r).respond(status, error_body(message, status))
        self.transport.close()
        self.closed = True

    async def _serve(self, r: Request) -> None:
        self.task = asyncio.current_task()
        ex = Exchange(self, r)
        try:
            await self.handler(r, ex)
        except asyncio.CancelledError:
            self.task = None
            if not self.closed:
                self.transport.abort()
            return
        except Exception:  # noqa: BLE001 - the handler answers its errors; this is a last resort
            logger.exception("unhandled error serving %s %s", r.method, r.path)
            if not ex.started:
                ex.respond(500, error_body("internal error", 500))
        self.task = None
        if self.closed:
            return
        if not ex.finished:           # a stream the handler left open: the client cannot know it ended
            self.transport.abort()
            self.closed = True
            return
        if not r.keep_alive or (self.closing and not self.queue):
            self.transport.close()
            self.closed = True
            return
        self._next()

    # ---- writing --------------------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._writing_paused:
            self._drain = self.loop.create_future()
            await self._drain
            if self.closed:
                raise ConnectionResetError("the client closed the connection")

    def _wake_drain(self) -> None:
        d, self._drain = self._drain, None
        if d is not None and not d.done():
            d.set_result(None)


class Listeners:
    """The router's servers, one per listening socket (``--host`` unset: IPv4 and IPv6), closed together."""

    def __init__(self, servers: list[asyncio.AbstractServer]) -> None:
        self.servers = servers

    @property
    def sockets(self) -> list[socket.socket]:
        return [sock for server in self.servers for sock in server.sockets]

    def close(self) -> None:
        for server in self.servers:
            server.close()


async def start_server(handler, host: str | None | list[str], port: int, *, reuse_port: bool = False) -> Listeners:
    """Serve on ``host:port``; ``host`` None or "": every address, IPv4 and IPv6 (``pdpool.utils.bind_sockets``,
    which leaves out a family this machine lacks, where uvloop's create_server fails); a list: each of them."""
    loop = asyncio.get_running_loop()
    sockets = [sock for one in (host if isinstance(host, list) else [host])
               for sock in bind_sockets(one, port, reuse_port=reuse_port)]
    servers = []
    try:
        for sock in sockets:
            servers.append(await loop.create_server(lambda: HttpConnection(handler, loop), sock=sock, backlog=1024))
    except BaseException:
        Listeners(servers).close()
        for sock in sockets:
            sock.close()
        raise
    return Listeners(servers)
