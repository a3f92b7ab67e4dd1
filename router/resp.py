"""A lean Redis client for the router's one hot command, the prefix lookup (``EVALSHA``), on the event loop.

redis-py's asyncio client cost the router about 0.17 ms of CPU per lookup (connection pool, retry wrapper,
command packing, a stream reader); this one writes the command's bytes and parses the reply in an
``asyncio.Protocol``, pipelining concurrent lookups on one connection (Redis answers in order)::

    conn = RespConnection(host, port, password=..., username=..., db=..., timeout=0.25)
    reply = await conn.call([b"EVALSHA", sha, b"1", key, arg1, arg2])   # bulk -> bytes, int, array -> list

Any failure (no connection, a reply later than ``timeout``, a dropped connection) raises ``RespUnavailable`` for
every call in flight and closes the connection; the next call connects again. An error reply raises
``RespError`` and leaves the connection usable. RESP2 only, TCP only: other URLs (TLS, unix sockets) keep
redis-py (``router/index_reader.py`` decides).
"""

from __future__ import annotations

import asyncio
from collections import deque


class RespUnavailable(ConnectionError):
    """Redis could not answer: not reachable, too slow, or the connection broke."""


class RespError(Exception):
    """Redis answered with an error reply (``-ERR ...``, ``-NOSCRIPT ...``)."""


class _Incomplete(Exception):
    pass


def encode_command(args: list[bytes]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n" % len(a))
        out.append(a)
        out.append(b"\r\n")
    return b"".join(out)


def parse_reply(buf: bytes | bytearray, pos: int = 0):
    """``(reply, next position)`` of the RESP2 reply at ``pos``; raises ``_Incomplete`` when ``buf`` ends before
    it does. An error reply is returned as a ``RespError`` instance (raised by the caller)."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line = buf[pos:pos + 1], buf[pos + 1:end]
    pos = end + 2
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise _Incomplete
        return bytes(buf[pos:pos + n]), pos + n + 2
    if kind == b"*":
        n = int(line)
        if n < 0:
            return None, pos
        items = []
        for _ in range(n):
            item, pos = parse_reply(buf, pos)
            items.append(item)
        return items, pos
    if kind == b"+":
        return bytes(line), pos
    if kind == b"-":
        return RespError(bytes(line).decode(errors="replace")), pos
    raise ValueError(f"not a RESP2 reply: {bytes(buf[pos - len(line) - 3:pos])!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future] = deque()
        self.buf = bytearray()
        self.lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while self.waiting and pos < len(buf):
                reply, pos = parse_reply(buf, pos)
                fut = self.waiting.popleft()
                if not fut.done():
                    if isinstance(reply, RespError):
                        fut.set_exception(reply)
                    else:
                        fut.set_result(reply)
        except _Incomplete:
            pass
        except ValueError as exc:   # a stream we cannot read: drop it
            self.fail(RespUnavailable(f"unreadable reply from Redis: {exc}"))
            return
        del buf[:pos]

    def connection_lost(self, exc) -> None:
        self.fail(RespUnavailable(f"connection to Redis lost: {exc or 'closed'}"))

    def fail(self, exc: Exception) -> None:
        self.lost = self.lost or exc
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class RespConnection:
    def __init__(self, host: str, port: int, *, password: str | None = None, username: str | None = None,
                 db: int = 0, timeout: float = 0.25) -> None:
        self.host = host
        self.port = port
        self.password = password
        self.username = username
        self.db = db
        self.timeout = timeout
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(loop.create_connection(_Protocol, self.host, self.port), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise RespUnavailable(f"cannot connect to Redis at {self.host}:{self.port}: {exc or 'timeout'}") from exc
        hello = []
        if self.password is not None:
            auth = [b"AUTH", self.password.encode()]
            if self.username:
                auth.insert(1, self.username.encode())
            hello.append(auth)
        if self.db:
            hello.append([b"SELECT", str(self.db).encode()])
        try:
            for command in hello:
                await self._send(proto, command)
        except BaseException:
            proto.fail(RespUnavailable("Redis refused the connection's AUTH or SELECT"))
            raise
        return proto

    async def _ready(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.lost is None:
            return proto
        if self._connecting is None:   # one connect for every caller that finds no connection
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            proto = await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None
        self._proto = proto
        return proto

    async def _send(self, proto: _Protocol, args: list[bytes]):
        fut = asyncio.get_running_loop().create_future()
        proto.waiting.append(fut)
        proto.transport.write(encode_command(args))
        timer = fut.get_loop().call_later(self.timeout, _expire, proto, fut, self.timeout)
        try:
            return await fut
        finally:
            timer.cancel()

    async def call(self, args: list[bytes]):
        """Send one command, return its reply; raises ``RespUnavailable`` or ``RespError``."""
        proto = await self._ready()
        return await self._send(proto, args)

    def close(self) -> None:
        if self._proto is not None:
            self._proto.fail(RespUnavailable("closed"))
            self._proto = None


def _expire(proto: _Protocol, fut: asyncio.Future, timeout: float) -> None:
    """A reply later than the timeout: later replies would be misattributed, so the connection goes."""
    if not fut.done():
        proto.fail(RespUnavailable(f"no reply from Redis within {timeout} s"))
