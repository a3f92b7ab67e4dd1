"""The router's lean HTTP/1.1 client (``router/http1.py``) against a real aiohttp upstream and raw sockets: bodies of
any size and chunking (Content-Length and chunked), the parser over any split of the bytes, request bodies,
keep-alive reuse, reconnection after the upstream closed, the one resend of a request the upstream cannot have
read (never of one it may have run),
timeouts, cancellation reaching the upstream, read-side back-pressure, malformed and read-until-close answers."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings, strategies as st

from threaded_app import ThreadedApp

from pdpool.router.http1 import (HIGH_WATER, IDLE_SECONDS, NODE_KEEPALIVE_SECONDS, VALIDATE_AFTER_SECONDS,
                                 ConnectError, ConnectionClosed, Http1Client, ProtocolError, Response, _Connection,
                                 reuse_limit)


def pattern(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]


class Upstream(ThreadedApp):
    """An aiohttp server on its own thread and loop; records the connections it served and the requests the
    client abandoned."""

    def __init__(self, keepalive_timeout: float = 75.0) -> None:
        self.peers: list = []
        self.abandoned = threading.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/body", self.body)
        app.router.add_post("/echo", self.echo)
        app.router.add_post("/sse", self.sse)
        app.router.add_post("/slow", self.slow)
        app.router.add_post("/stall", self.stall)
        super().__init__(app, handler_cancellation=True, access_log=None, keepalive_timeout=keepalive_timeout)

    def _seen(self, request: web.Request) -> None:
        self.peers.append(request.transport.get_extra_info("peername"))

    async def body(self, request: web.Request) -> web.StreamResponse:
        """``{"size", "cuts", "chunked"}``: the pattern of that size, written in pieces cut at ``cuts``."""
        self._seen(request)
        spec = await request.json()
        data = pattern(spec["size"])
        if not spec["chunked"]:
            return web.Response(body=data, content_type="application/octet-stream")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        cuts = sorted({c for c in spec["cuts"] if 0 < c < len(data)})
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            await resp.write(data[a:b])
        await resp.write_eof()
        return resp

    async def echo(self, request: web.Request) -> web.Response:
        self._seen(request)
        return web.Response(body=await request.read(), headers={"X-Echo-Request-Id": request.headers.get(
            "X-Request-Id", "")}, content_type="application/json")

    async def sse(self, request: web.Request) -> web.StreamResponse:
        self._seen(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(200):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.02)
        except (asyncio.CancelledError, ConnectionResetError):
            self.abandoned.set()
            raise
        await resp.write_eof()
        return resp

    async def stall(self, request: web.Request) -> web.StreamResponse:
        """One event, then nothing (a node that hangs mid-stream)."""
        self._seen(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 0\n\n")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.abandoned.set()
            raise
        return resp

    async def slow(self, request: web.Request) -> web.Response:
        self._seen(request)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.abandoned.set()
            raise
        return web.Response(body=b"{}")


@pytest.fixture(scope="module")
def upstream():
    server = Upstream()
    yield server
    server.stop()


def run(coro_fn, uv: bool = False):
    """Run ``coro_fn(client)`` on a fresh loop (uvloop's, as the router's, with ``uv``) with a fresh client."""
    async def main():
        client = Http1Client()
        try:
            return await coro_fn(client)
        finally:
            client.close()
    if uv:
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


async def post(client: Http1Client, url: str, body: bytes = b"{}", timeout: float = 10.0) -> Response:
    return await client.request(url, body, {"Content-Type": "application/json"}, timeout=timeout,
                                connect_timeout=2.0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 300_000), cuts=st.lists(st.integers(1, 300_000), max_size=12), chunked=st.booleans(),
       by_readany=st.booleans())
def test_bodies_of_any_size_and_chunking_arrive_whole_and_the_connection_is_reused(upstream, size, cuts, chunked,
                                                                                   by_readany):
    import json

    spec = json.dumps({"size": size, "cuts": cuts, "chunked": chunked}).encode()

    async def go(client):
        got = []
        for _ in range(2):
            r = await post(client, upstream.url + "/body", spec)
            assert r.status == 200
            if by_readany:
                parts = []
                while chunk := await r.readany():
                    parts.append(chunk)
                data = b"".join(parts)
            else:
                data = await r.read()
            r.close()
            got.append(data)
            assert client.num_idle() == 1
        return got

    before = len(upstream.peers)
    got = run(go)
    assert got == [pattern(size)] * 2
    assert upstream.peers[before] == upstream.peers[before + 1]  # one keep-alive connection for both


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 700_000), cuts=st.lists(st.integers(1, 700_000), max_size=12), chunked=st.booleans())
def test_on_complete_gets_the_whole_body_or_leaves_all_of_it_to_the_reader(upstream, size, cuts, chunked):
    """The router answers its client from ``on_complete`` (``router/handoff.py``'s ``_Relay``): called, it has
    the whole body; once the caller reads (a body over the read-pause mark, or one still arriving when the caller
    wakes) it is not called, and the reader gets everything."""
    import json

    spec = json.dumps({"size": size, "cuts": cuts, "chunked": chunked}).encode()

    async def go(client):
        relayed = []
        pending = client.request_now(upstream.url + "/body", spec, {"Content-Type": "application/json"},
                                     timeout=10.0, connect_timeout=2.0,
                                     on_complete=lambda r: relayed.append(r.take_body()))
        r = await pending
        read = await r.read()
        r.close()
        return relayed, read

    relayed, read = run(go)
    assert len(relayed) <= 1
    assert b"".join(relayed) + read == pattern(size)
    assert not (relayed and read)
    if size > 2 * HIGH_WATER:
        assert not relayed


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.aborted = False
        self.paused = False

    def writelines(self, data) -> None:
        self.written += b"".join(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def raw_response(body: bytes, chunk_sizes: list[int] | None, keep_alive: bool) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    if not keep_alive:
        head += b"Connection: close\r\n"
    if chunk_sizes is None:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    out, pos, i = [head + b"Transfer-Encoding: chunked\r\n\r\n"], 0, 0
    while pos < len(body):
        n = max(1, chunk_sizes[i % len(chunk_sizes)]) if chunk_sizes else len(body)
        out.append(b"%x\r\n" % len(body[pos:pos + n]) + body[pos:pos + n] + b"\r\n")
        pos += n
        i += 1
    return b"".join(out) + b"0\r\n\r\n"


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=3000), chunk_sizes=st.none() | st.lists(st.integers(1, 700), max_size=6),
       splits=st.lists(st.integers(1, 97), max_size=60), keep_alive=st.booleans())
def test_the_parser_gives_the_body_whatever_the_split_of_the_bytes(body, chunk_sizes, splits, keep_alive):
    async def go():
        client = Http1Client()
        conn = _Connection(client, ("h", 1))
        conn.connection_made(FakeTransport())
        r = conn.start(b"POST / HTTP/1.1\r\n\r\n", b"", client.loop.time() + 10)
        data = raw_response(body, chunk_sizes, keep_alive)
        pos, i = 0, 0
        while pos < len(data):
            n = splits[i % len(splits)] if splits else len(data)
            conn.data_received(data[pos:pos + n])
            pos += n
            i += 1
        await r._wait_headers()
        assert (r.status, r.content_type) == (200, "text/event-stream")
        assert await r.read() == body
        assert r.complete and r.keep_alive == keep_alive
        r.close()
        assert client.num_idle() == (1 if keep_alive else 0)

    asyncio.run(go())


def test_a_large_request_body_and_the_headers_reach_the_upstream(upstream):
    payload = pattern(5 * 1024 * 1024)

    async def go(client):
        r = await client.request(upstream.url + "/echo", payload, {"X-Request-Id": "req-1"}, timeout=30,
                                 connect_timeout=2)
        try:
            return r.headers.get("x-echo-request-id"), await r.read()
        finally:
            r.close()

    assert run(go) == ("req-1", payload)


def test_a_header_value_with_a_line_break_is_refused(upstream):
    async def go(client):
        with pytest.raises(ValueError):
            await client.request(upstream.url + "/echo", b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"}, timeout=5,
                                 connect_timeout=2)

    run(go)


def test_a_new_connection_after_the_upstream_closed_the_idle_one():
    server = Upstream(keepalive_timeout=0.2)
    try:
        async def go(client):
            for _ in range(2):
                r = await post(client, server.url + "/echo", b'{"a": 1}')
                assert await r.read() == b'{"a": 1}'
                r.close()
                await asyncio.sleep(0.6)   # the server closes the idle connection meanwhile
            return client.num_idle()

        run(go)
        assert len(server.peers) == 2 and server.peers[0] != server.peers[1]
    finally:
        server.stop()


class RawServer:
    """A socket server on a thread; ``handle(conn, index)`` serves the index-th accepted connection."""

    def __init__(self, handle) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.handle = handle
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            index = self.accepted
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn, index), daemon=True).start()

    def _one(self, conn: socket.socket, index: int) -> None:
        try:
            self.handle(conn, index)
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int([line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")][0])
    while len(rest) < length:
        rest += conn.recv(65536)
    return head


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"


@pytest.mark.parametrize("uv", [False, True], ids=["asyncio", "uvloop"])
def test_a_reused_connection_dropped_after_the_whole_request_went_out_is_an_error_not_a_resend(uv):
    """The node (or a proxy on the way) read the whole request, then the connection closed without a byte of the
    answer: the node may have run it (a proxy dropped the answer), so it is not sent again, as Go's net/http does
    not resend a POST it wrote; the caller decides (the router: the next decode node, or the prefill fallback).
    It was sent again, and ran twice."""
    received = []

    def handle(conn, index):
        while read_request(conn):
            received.append(index)
            if len(received) == 2:
                return           # run, and its answer lost
            conn.sendall(OK)

    server = RawServer(handle)
    try:
        async def go(client):
            r = await post(client, server.url + "/v1/completions")
            assert await r.read() == b"{}"
            r.close()
            with pytest.raises(ConnectionClosed):
                await post(client, server.url + "/v1/completions")

        run(go, uv)
        time.sleep(0.2)          # a resend would have reached the server by now
        assert received == [0, 0] and server.accepted == 1
    finally:
        server.close()


def two_posts_with_the_loop_blocked_after_each(server: "RawServer", uv: bool, seconds: float) -> list[bytes]:
    """Two requests, the loop blocked ``seconds`` after each: what the server did meanwhile (a close, a reset) is
    in the kernel, not yet read by the loop, when the second request takes the pooled connection."""
    async def go(client):
        bodies = []
        for _ in range(2):
            r = await post(client, server.url + "/v1/completions")
            bodies.append(await r.read())
            r.close()
            time.sleep(seconds)
        return bodies

    return run(go, uv)


@pytest.mark.parametrize("uv", [False, True], ids=["asyncio", "uvloop"])
def test_a_request_written_on_a_connection_the_node_had_reset_goes_out_again_on_a_new_one(uv):
    """The node reset an idle connection (here at once; a node closing idle connections) and the router's loop
    had not read that yet when a request took the connection: the write fails, nothing reached the node, and the
    request goes out once more on a new connection."""
    received = []

    def handle(conn, index):
        while read_request(conn):
            received.append(index)
            conn.sendall(OK)
            if index == 0:       # a reset (RST) right after the first answer
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return

    server = RawServer(handle)
    try:
        assert two_posts_with_the_loop_blocked_after_each(server, uv, 0.3) == [b"{}", b"{}"]
        assert received == [0, 1] and server.accepted == 2
    finally:
        server.close()


@pytest.mark.parametrize("uv", [False, True], ids=["asyncio", "uvloop"])
def test_a_connection_idle_a_while_that_the_node_closed_is_not_written_on(uv):
    """A connection idle over ``VALIDATE_AFTER_SECONDS`` is checked before reuse: the node's close (FIN) that the
    loop has not read yet is seen, and the request goes on a new connection, never on the closed one (where a
    write goes out, so that its failure could not be resent)."""
    late = []

    def handle(conn, index):
        while read_request(conn):
            conn.sendall(OK)
            if index == 0:       # closes its side of the idle connection, and tells what still arrives
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(3)
                try:
                    late.append(conn.recv(65536))
                except OSError as exc:
                    late.append(type(exc).__name__)
                return

    server = RawServer(handle)
    try:
        assert two_posts_with_the_loop_blocked_after_each(server, uv, VALIDATE_AFTER_SECONDS + 0.3) == [b"{}", b"{}"]
        assert server.accepted == 2
        time.sleep(0.2)
        assert late and late[0] in (b"", "ConnectionResetError"), late
    finally:
        server.close()


def test_a_connection_is_never_reused_near_the_nodes_keep_alive():
    assert IDLE_SECONDS <= NODE_KEEPALIVE_SECONDS - 10


@given(timeout=st.integers(0, 10_000), others=st.lists(st.sampled_from(["max=100", "foo", "bar=x y"]), max_size=3),
       at=st.integers(0, 3), spaces=st.sampled_from(["", " ", "  "]), upper=st.booleans())
def test_reuse_stops_short_of_any_advertised_keep_alive_timeout(timeout, others, at, spaces, upper):
    params = [*others]
    params.insert(min(at, len(params)), ("TIMEOUT" if upper else "timeout") + f"{spaces}={spaces}{timeout}")
    limit = reuse_limit(f",{spaces}".join(params))
    assert 0 <= limit <= IDLE_SECONDS
    assert timeout - limit >= min(1.0, timeout / 2)    # short of it by a second, or by half of a shorter one


@pytest.mark.parametrize("header", ["max=100", "timeout=", "timeout=soon", "timeout=-3", "timeout=nan", ""])
def test_a_keep_alive_header_without_a_usable_timeout_leaves_the_own_bound(header):
    assert reuse_limit(header) == IDLE_SECONDS


@pytest.mark.parametrize("header", ["timeout=1", "timeout=1, max=100", "Max=7,  TIMEOUT=1"])
def test_a_connection_is_not_reused_near_a_keep_alive_timeout_the_server_advertises(header):
    """A server that says ``Keep-Alive: timeout=1`` (Apache, nginx, Node's http) closes a connection idle for 1 s;
    its close may cross a request the router writes then, which is lost and never resent. Here the server's close
    lands just as the second request arrives, after 1.2 s idle (the validate-after check sees nothing yet): the
    router wrote it on the dying connection, and the request failed. It now goes on a new connection."""
    answer = OK.replace(b"\r\n\r\n", f"\r\nKeep-Alive: {header}\r\n\r\n".encode(), 1)
    received = []

    def handle(conn, index):
        while True:
            idle_from = time.monotonic()
            if not read_request(conn):
                return
            if time.monotonic() - idle_from > 1.0:   # past the advertised timeout: closed as the request came
                return
            received.append(index)
            conn.sendall(answer)

    server = RawServer(handle)
    try:
        assert two_posts_with_the_loop_blocked_after_each(server, False, 1.2) == [b"{}", b"{}"]
        assert received == [0, 1] and server.accepted == 2
    finally:
        server.close()


def test_a_new_connection_closed_before_answering_is_an_error_not_a_resend():
    server = RawServer(lambda conn, index: read_request(conn))
    try:
        async def go(client):
            with pytest.raises(ConnectionClosed):
                await post(client, server.url + "/v1/completions")

        run(go)
        assert server.accepted == 1
    finally:
        server.close()


def test_a_body_that_ends_when_the_upstream_closes_and_a_malformed_answer():
    def handle(conn, index):
        read_request(conn)
        if index == 0:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello ")
            conn.sendall(b"world")
        else:
            conn.sendall(b"HTTP/1.1 2x0 what\r\n\r\n")

    server = RawServer(handle)
    try:
        async def go(client):
            r = await post(client, server.url + "/a")
            assert (r.status, r.content_type, await r.read()) == (200, "text/plain", b"hello world")
            r.close()
            assert client.num_idle() == 0    # ended by a close: never reused
            with pytest.raises(ProtocolError):
                await post(client, server.url + "/b")

        run(go)
    finally:
        server.close()


def test_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # bound, not listening: connections are refused

        async def go(client):
            with pytest.raises(ConnectError):
                await post(client, f"http://127.0.0.1:{port}/x")

        run(go)


def test_a_timeout_closes_the_connection_and_the_upstream_sees_it(upstream):
    upstream.abandoned.clear()

    async def go(client):
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await post(client, upstream.url + "/slow", timeout=0.3)
        assert time.monotonic() - t0 < 2
        assert client.num_idle() == 0

    run(go)
    assert upstream.abandoned.wait(5)


def test_a_stream_that_keeps_coming_outlives_the_timeout_and_one_that_stalls_does_not(upstream):
    """The timeout bounds the wait for the head and then each gap in the body, not the whole answer: a long stream
    (here 4 s of events every 20 ms, under a 0.5 s timeout) was cut mid-way with an empty TimeoutError."""
    upstream.abandoned.clear()

    async def go(client):
        resp = await post(client, upstream.url + "/sse", timeout=0.5)
        body = await resp.read()
        assert body.count(b"data: ") == 200
        resp = await post(client, upstream.url + "/stall", timeout=0.5)
        t0 = time.monotonic()
        assert (await resp.readany()).startswith(b"data: 0")
        with pytest.raises(asyncio.TimeoutError, match="nothing more of its answer in 0.5 s"):
            while await resp.readany():
                pass
        assert time.monotonic() - t0 < 3

    run(go)
    assert upstream.abandoned.wait(5)


def test_cancelling_a_stream_closes_the_connection_and_the_upstream_sees_it(upstream):
    upstream.abandoned.clear()

    async def go(client):
        got = []

        async def reader():
            r = await post(client, upstream.url + "/sse")
            try:
                while chunk := await r.readany():
                    got.append(chunk)
            finally:
                r.close()

        task = asyncio.ensure_future(reader())
        while len(got) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.num_idle() == 0
        return got

    assert run(go)[0] == b"data: 0\n\n"
    assert upstream.abandoned.wait(5)


def test_cancelling_while_waiting_for_the_headers_closes_the_connection(upstream):
    upstream.abandoned.clear()

    async def go(client):
        task = asyncio.ensure_future(post(client, upstream.url + "/slow"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.num_idle() == 0

    run(go)
    assert upstream.abandoned.wait(5)


def test_reading_pauses_while_the_reader_lags_and_nothing_is_lost(upstream):
    import json

    size = 8 * 1024 * 1024
    spec = json.dumps({"size": size, "cuts": list(range(65536, size, 65536)), "chunked": True}).encode()

    async def go(client):
        r = await post(client, upstream.url + "/body", spec, timeout=60)
        await asyncio.sleep(0.5)   # the upstream writes meanwhile; the client stops reading above HIGH_WATER
        buffered = r._buffered
        data = await r.read()
        r.close()
        return buffered, data

    buffered, data = run(go)
    assert buffered <= HIGH_WATER + 1024 * 1024   # one socket read past the mark at most
    assert data == pattern(size)
