"""A lean HTTP/1.1 client for the router's legs to the nodes: raw asyncio protocol, pooled keep-alive
connections, the ``httptools`` (llhttp) response parser.

    Http1Client.request(url, body, headers, timeout=, connect_timeout=) -> Response   (status and headers read)
        an idle connection to host:port (most recently used first), else a new one
        one write: request line + headers + body
        Response.readany() -> the next body bytes as they arrive (b"" at the end); Response.read() -> the body
        Response.close() -> the connection goes back to the pool when the response ended cleanly and both sides
                            keep it alive; otherwise it is closed (a node sees the disconnect and aborts)

Why not aiohttp's client: it was 13% of the router's CPU per request (its request/response objects, payload
registry, cookie jar, tracing hooks, timers per read). This client does what the legs need and nothing else.
Chunked and Content-Length bodies are decoded by llhttp; a body is handed on chunk by chunk, never buffered
whole unless ``read()`` asks; reading pauses above ``HIGH_WATER`` buffered bytes (a slow client slows the node's
socket, not the router's memory). One timer per request bounds the wait for the answer's head, and then each
gap between two pieces of its body (``timeout``): a stream that keeps coming is never cut, one that stalls is.

A node closes a keep-alive connection idle for its keep-alive timeout. A request written on a connection the
node closed as it went out gets no answer, and neither does one whose answer a proxy on the way dropped after the
node ran it: the two look the same, so a request written whole is never sent again (as Go's net/http, which
resends a POST only when nothing of it was written); the caller decides (the router: the next decode node, or
the prefill fallback). The race is kept away instead: a connection idle for ``IDLE_SECONDS`` (well under our
node's keep-alive), or near the timeout a server advertises (``Keep-Alive: timeout=N``: ``reuse_limit``), is not
reused; one idle over ``VALIDATE_AFTER_SECONDS`` is checked first (a poll: a close the loop has not read yet shows
as readable), as HttpClient's validate-after-inactivity does; a busy connection costs no check. A request whose
write failed at once (the node's reset already in the kernel: nothing of it went out) is sent once more on a new
connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from functools import lru_cache
import select
from urllib.parse import urlsplit

from pdpool.server.json_body import REQUEST_SECONDS as NODE_KEEPALIVE_SECONDS   # our node's idle close
from pdpool.utils import url_host

try:
    import httptools
except ImportError:  # the router then keeps aiohttp's client for every leg (router/upstream.py)
    httptools = None

IDLE_SECONDS = min(15.0, NODE_KEEPALIVE_SECONDS - 10)  # an idle pooled connection older than this is not reused
VALIDATE_AFTER_SECONDS = 1.0  # one idle longer is checked before reuse (a close the loop has not read yet)
MAX_IDLE_PER_HOST = 256
HIGH_WATER = 256 * 1024      # buffered body bytes above which reading from the node pauses
LOW_WATER = 64 * 1024


def reuse_limit(keep_alive: str) -> float:
    """How long a connection may idle before reuse, given the server's ``Keep-Alive`` header (``timeout=5,
    max=100``): short of its timeout by a margin (its clock starts as it sends the answer, before this side reads
    it), never over ``IDLE_SECONDS``; ``IDLE_SECONDS`` when the header names no usable timeout."""
    for param in keep_alive.split(","):
        name, _, value = param.partition("=")
        if name.strip().lower() == "timeout":
            try:
                seconds = float(value.strip().strip('"'))
            except ValueError:
                return IDLE_SECONDS
            if not seconds >= 0:    # negative, NaN
                return IDLE_SECONDS
            return max(0.0, min(IDLE_SECONDS, seconds - min(1.0, seconds / 2)))
    return IDLE_SECONDS


class HTTPClientError(Exception):
    """A transport failure: the connection could not be made, broke, or carried a malformed response."""


class ConnectError(HTTPClientError):
    pass


class ConnectionClosed(HTTPClientError):
    """The node closed the connection before the response ended."""


class ProtocolError(HTTPClientError):
    pass


@lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, int, str, str]:
    """(host, port, path with query, Host header) of an ``http://`` URL."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"not an http:// URL: {url!r}")
    port = u.port or 80
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return u.hostname, port, path, f"{url_host(u.hostname)}:{port}"


class Response:
    """One response, read as it arrives. ``status``, ``headers`` (lower-case names) and ``content_type`` (the
    media type alone) are set when ``Http1Client.request`` returns."""

    __slots__ = ("status", "headers", "content_type", "keep_alive", "complete", "_conn", "_chunks", "_buffered",
                 "_waiter", "_exc", "_timer", "_paused", "_until_eof", "_got_bytes", "_headers_done", "_released",
                 "_on_complete", "_idle", "_last", "_unsent")

    def __init__(self, conn: "_Connection", on_complete=None) -> None:
        self._conn = conn
        self._on_complete = on_complete
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content_type = ""
        self.keep_alive = False
        self.complete = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._exc: BaseException | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._until_eof = False       # neither Content-Length nor chunked: the body ends when the node closes
        self._got_bytes = False
        self._headers_done = False
        self._released = False
        self._idle = 0.0              # the timeout: the longest wait for the head, then between body pieces
        self._last = 0.0              # when the head or the latest body piece arrived (loop time)
        self._unsent = False          # the request's write failed at once: nothing of it reached the node

    # ---- the connection feeds these -----------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._last = self._conn.loop.time()
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._cancel_timer()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self.complete:
            self._exc = exc
        self._cancel_timer()
        self._wake()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self._headers_done:   # answering: the timeout runs from the latest piece (one re-arm per gap, not per piece)
            resume = self._last + self._idle
            if resume > self._conn.loop.time():
                self._timer = self._conn.loop.call_at(resume, self._timed_out)
                return
            what = "nothing more of its answer"
        else:
            what = "no answer"
        self._fail(asyncio.TimeoutError(f"the node sent {what} in {round(self._idle, 1):g} s"))
        self._conn.abort()

    # ---- the caller reads ---------------------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _wait_headers(self) -> None:
        while not self._headers_done:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def readany(self) -> bytes:
        """The body bytes received so far and not yet read, waiting for some; b"" once the body ended."""
        self._on_complete = None      # the caller reads the body itself
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self.complete:
                return b""
            await self._wait()
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._take())
        self._buffered -= len(data)
        if self._paused and self._buffered < LOW_WATER:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    def _take(self):
        while self._chunks:
            yield self._chunks.popleft()

    def take_body(self) -> bytes:
        """The body bytes buffered and not read yet, read now (for ``on_complete``: the whole body)."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        """The whole body (what is left of it)."""
        parts = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        """Hand the connection back when this response ended cleanly and may be reused, else close it."""
        if self._released:
            return
        self._released = True
        self._cancel_timer()
        self._conn.done(reusable=self.complete and self.keep_alive and self._exc is None)


class _Connection(asyncio.Protocol):
    def __init__(self, client: "Http1Client", key: tuple[str, int]) -> None:
        self.client = client
        self.key = key
        self.loop = client.loop
        self.transport: asyncio.Transport | None = None
        self.parser = None
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.max_idle = IDLE_SECONDS    # the server's advertised keep-alive timeout may shorten it (reuse_limit)
        self.reuse_until = 0.0          # idle_since + max_idle

    # ---- asyncio.Protocol --------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None or self.parser is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        r._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            r._fail(ProtocolError("the node switched protocols"))
            self.abort()
        except httptools.HttpParserError as exc:
            r._fail(ProtocolError(f"malformed response: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False   # close the transport; connection_lost settles the response

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        r = self.response
        if r is not None and not r.complete:
            if r._headers_done and r._until_eof and exc is None:
                r._finish()
            else:
                r._fail(ConnectionClosed("the node closed the connection before the response ended"
                                         + (f": {exc}" if exc else "")))

    # ---- llhttp callbacks ----------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.response
        status = self.parser.get_status_code()
        if 100 <= status < 200:   # informational: the real response follows
            r.headers.clear()
            return
        r.status = status
        h = r.headers
        r.content_type = h.get("content-type", "application/octet-stream").split(";", 1)[0].strip().lower()
        r._until_eof = "content-length" not in h and "chunked" not in h.get("transfer-encoding", "").lower()
        r._last = self.loop.time()
        r._headers_done = True
        r._wake()

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)

    def on_message_complete(self) -> None:
        r = self.response
        if not r._headers_done:   # the end of an informational response
            self.parser = httptools.HttpResponseParser(self)
            return
        r.keep_alive = self.parser.should_keep_alive()
        if "keep-alive" in r.headers:   # the server's idle timeout (Keep-Alive: timeout=N): reuse stops short of it
            self.max_idle = reuse_limit(r.headers["keep-alive"])
        self.parser = None        # anything after this message is unsolicited
        r.complete = True
        if r._on_complete is not None and r._exc is None:
            r._on_complete(r)     # before the waiting task wakes (the router answers its client from here)
        r._finish()

    # ---- the client's side ------------------------------------------------------------------------------------

    def start(self, head: bytes, body: bytes, deadline: float, on_complete=None) -> Response:
        r = Response(self, on_complete)
        self.response = r
        self.parser = httptools.HttpResponseParser(self)
        r._idle = max(0.0, deadline - self.loop.time())
        r._timer = self.loop.call_at(deadline, r._timed_out)
        self.transport.writelines((head, body))
        if self.transport.is_closing():   # the write failed (a reset already in the kernel): nothing went out
            r._unsent = True
        return r

    def stale(self) -> bool:
        """Whether this idle connection has something to read: the node's close (or reset) that the loop has not
        read yet, or bytes nobody asked for; either way it cannot take a request."""
        poll = select.poll()
        try:
            poll.register(self.transport.get_extra_info("socket").fileno(), select.POLLIN)
            return bool(poll.poll(0))
        except (OSError, ValueError, AttributeError):
            return True

    def done(self, reusable: bool) -> None:
        self.response = None
        self.parser = None
        if reusable and not self.closed:
            self.client._release(self)
        else:
            self.abort()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.abort()   # no lingering: a node reads the disconnect at once


class Http1Client:
    """Pooled keep-alive HTTP/1.1 connections, per host and port. Lives on one event loop."""

    def __init__(self) -> None:
        if httptools is None:
            raise RuntimeError("the lean HTTP/1.1 client needs httptools")
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}

    async def request(self, url: str, body: bytes, headers: dict[str, str], *, timeout: float,
                      connect_timeout: float, method: str = "POST") -> Response:
        """Send the request and wait for the response's status and headers (``ConnectError``,
        ``ConnectionClosed``, ``ProtocolError``, ``asyncio.TimeoutError``). The caller reads the body and closes
        the response."""
        return await self.request_now(url, body, headers, timeout=timeout, connect_timeout=connect_timeout,
                                      method=method)

    def request_now(self, url: str, body: bytes, headers: dict[str, str], *, timeout: float,
                    connect_timeout: float, method: str = "POST", on_complete=None):
        """``request``, with the request written before this returns when an idle pooled connection is there
        (else it is written once a new connection is made, when awaited). Returns an awaitable of the response,
        which must be awaited. ``on_complete(response)``, when given, is called from the connection's callback
        once the whole response is read, before the awaiting task wakes."""
        host, port, path, host_header = _target(url)
        lines = [f"{method} {path} HTTP/1.1\r\nHost: {host_header}\r\nContent-Length: {len(body)}\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} has a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        deadline = self.loop.time() + timeout
        key = (host, port)
        conn = self._take_idle(key)
        first = conn.start(head, body, deadline, on_complete) if conn is not None else None
        return self._exchange(key, head, body, deadline, connect_timeout, first, on_complete)

    async def _exchange(self, key, head: bytes, body: bytes, deadline: float, connect_timeout: float,
                        first: Response | None, on_complete=None) -> Response:
        for attempt in range(2):
            r, reused = (first, True) if attempt == 0 and first is not None else (None, False)
            if r is None:
                conn = self._take_idle(key)
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(key, min(connect_timeout, max(0.0, deadline - self.loop.time())))
                r = conn.start(head, body, deadline, on_complete)
            try:
                await r._wait_headers()
            except ConnectionClosed:
                r.close()
                if reused and r._unsent and attempt == 0:
                    continue   # the node had reset this idle connection: the request never went out
                raise
            except BaseException:
                r.close()
                raise
            return r
        raise AssertionError("not reached")

    async def _connect(self, key: tuple[str, int], timeout: float) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self, key), key[0], key[1]), timeout)
        except asyncio.TimeoutError:
            raise ConnectError(f"no connection to {key[0]}:{key[1]} in {timeout:.2f} s") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return conn

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        checked = now - VALIDATE_AFTER_SECONDS
        while idle:
            conn = idle.pop()                 # most recently used: the least likely to be closed by the node
            if not conn.closed and conn.reuse_until >= now and (conn.idle_since >= checked or not conn.stale()):
                return conn
            conn.abort()
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        now = time.monotonic()
        while idle and (idle[0].closed or idle[0].reuse_until < now):  # the oldest first
            idle.popleft().abort()
        if len(idle) >= MAX_IDLE_PER_HOST:
            conn.abort()
            return
        conn.idle_since = now
        conn.reuse_until = now + conn.max_idle
        idle.append(conn)

    def num_idle(self, key: tuple[str, int] | None = None) -> int:
        if key is not None:
            return len(self._idle.get(key, ()))
        return sum(len(d) for d in self._idle.values())

    def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().abort()
        self._idle.clear()
