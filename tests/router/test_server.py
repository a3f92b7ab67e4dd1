"""The router's raw HTTP/1.1 server (``router/server.py``) over real sockets: keep-alive, pipelining, any split of
the bytes (hypothesis), Content-Length and chunked request bodies, ``Expect: 100-continue``, too large and
malformed requests (OpenAI errors, then close), HTTP/1.0, streaming with chunked framing as it is written, and a
client that disconnects cancelling its request."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pdpool.router import server
from pdpool.router.server import start_server


class App:
    """Handlers on a server of its own thread and loop."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.started = threading.Event()
        self.release = None
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(start_server(self.handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.release = asyncio.Event()
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def handle(self, request, exchange) -> None:
        if request.path == "/echo":
            info = {"method": request.method, "path": request.path, "query": request.query, "size": len(request.body),
                    "sha": hashlib.sha256(request.body).hexdigest(), "x": request.headers.get("X-Test")}
            exchange.respond(200, json.dumps(info).encode(), headers={"X-Seen": request.headers.get("x-test", "")})
        elif request.path == "/stream":
            await exchange.start_stream(200, {"Content-Type": "text/event-stream"})
            for i in range(3):
                await exchange.write(b"data: %d\n\n" % i)
                if i == 0:
                    self.started.set()
                    await self.release.wait()
            await exchange.end_stream()
        elif request.path == "/hang":
            self.started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        elif request.path == "/boom":
            raise RuntimeError("a bug")
        else:
            exchange.respond(404, server.error_body("Not Found", 404))


@pytest.fixture(params=[False, True], ids=["plain-start", "eager-start"])
def app(request, monkeypatch):
    """Every test with request tasks started as Python 3.11 starts them here and as 3.12 does (router/eager.py)."""
    monkeypatch.setattr(server, "EAGER", request.param)
    a = App()
    yield a
    a.stop()


def connect(app: App) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", app.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def post(path: str, body: bytes, extra: str = "", chunked: bool = False) -> bytes:
    if chunked:
        framed = b"".join(b"%x\r\n%b\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
        return (f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n{extra}\r\n").encode() + framed \
            + b"0\r\n\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


class Reader:
    """HTTP/1.1 responses off a socket (Content-Length, chunked, or until close)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._more():
                raise EOFError(self.buf)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._more():
                raise EOFError(self.buf)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def chunked_body(self) -> bytes:
        body = b""
        while True:
            n = int(self._line(), 16)
            body += self._exactly(n)
            self._exactly(2)
            if n == 0:
                return body

    def response(self, head: bool = False) -> tuple[int, dict, bytes]:
        status = int(self._line().split()[1])
        headers = {}
        while True:
            line = self._line()
            if not line:
                break
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if status == 100 or head:
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, self._exactly(int(headers["content-length"]))
        if headers.get("transfer-encoding") == "chunked":
            return status, headers, self.chunked_body()
        while self._more():
            pass
        body, self.buf = self.buf, b""
        return status, headers, body

    def closed(self) -> bool:
        try:
            return not self.buf and not self._more()
        except ConnectionResetError:
            return True


def echo_ok(answer, body: bytes) -> None:
    status, _, data = answer
    assert status == 200
    info = json.loads(data)
    assert (info["size"], info["sha"]) == (len(body), hashlib.sha256(body).hexdigest())


def test_keep_alive_and_pipelining_answer_in_order(app):
    bodies = [b"", b"a", b"x" * 100_000, json.dumps({"k": "v" * 300}).encode()]
    with connect(app) as s:
        s.sendall(b"".join(post("/echo", b, f"X-Test: {i}\r\n") for i, b in enumerate(bodies)))
        r = Reader(s)
        for i, b in enumerate(bodies):
            answer = r.response()
            echo_ok(answer, b)
            assert answer[1]["x-seen"] == str(i) and "date" in answer[1]
        s.sendall(post("/echo", b"again"))       # the connection is still usable
        echo_ok(r.response(), b"again")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=3), chunked=st.lists(st.booleans(), min_size=3,
       max_size=3), cuts=st.lists(st.integers(0, 300_000), max_size=6))
def test_any_split_of_pipelined_requests(app, sizes, chunked, cuts):
    bodies = [bytes(range(256)) * (n // 256) + b"z" * (n % 256) for n in sizes]
    wire = b"".join(post("/echo?q=1", b, chunked=c) for b, c in zip(bodies, chunked))
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    with connect(app) as s:
        for a, b in zip(points, points[1:]):
            s.sendall(wire[a:b])
            time.sleep(0.001)
        r = Reader(s)
        for b in bodies:
            answer = r.response()
            echo_ok(answer, b)
            assert json.loads(answer[2])["query"] == "q=1"


def test_expect_100_continue_then_the_body(app):
    body = b"y" * 5000
    with connect(app) as s:
        s.sendall(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
                  .encode())
        r = Reader(s)
        assert r.response()[0] == 100
        s.sendall(body)
        echo_ok(r.response(), body)


@pytest.mark.parametrize("expect", ["100-continue", "teapot"])
def test_an_http_10_expectation_is_ignored(app, expect):
    """RFC 9110 (10.1.1): a server must ignore an HTTP/1.0 request's 100-continue; an HTTP/1.0 client reads an
    interim ``100 Continue`` as its answer. The router sent it (and refused another expectation with 417), where a
    node (aiohttp) answers the request."""
    with connect(app) as s:
        s.sendall(f"POST /echo HTTP/1.0\r\nContent-Length: 3\r\nExpect: {expect}\r\n\r\nabc".encode())
        echo_ok(Reader(s).response(), b"abc")


def test_an_absolute_form_target_is_served_by_its_path(app):
    """``POST http://host/echo?q=1`` (RFC 9112's absolute-form, which a server must take) is ``/echo``, as a node
    (aiohttp) serves it, where the router routed the whole URL: a 401 or 404."""
    body = b"abc"
    for target in ("http://x/echo?q=1", "https://x:8000/echo?q=1"):
        with connect(app) as s:
            s.sendall(post(target, body, "Connection: close\r\n"))
            answer = Reader(s).response()
            echo_ok(answer, body)
            info = json.loads(answer[2])
            assert (info["path"], info["query"]) == ("/echo", "q=1"), info


def test_another_expectation_is_417_then_close(app):
    """As a node answers it (aiohttp), where the router ignored the header and served the request."""
    with connect(app) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: teapot\r\n\r\n{}")
        r = Reader(s)
        status, headers, data = r.response()
        assert status == 417 and headers["connection"] == "close"
        assert json.loads(data)["error"] == {"message": "Unknown Expect: teapot", "type": "invalid_request_error",
                                             "param": None, "code": 417}
        assert r.closed()


def test_httpx_client_keeps_its_connection_and_sends_large_bodies(app):
    with httpx.Client(base_url=f"http://127.0.0.1:{app.port}") as client:
        for size in (0, 10, 3_000_000):
            echo_ok((lambda r: (r.status_code, r.headers, r.content))(client.post("/echo", content=b"q" * size)),
                    b"q" * size)


def test_too_large_a_body_is_413_then_close(app, monkeypatch):
    monkeypatch.setattr(server, "MAX_BODY", 1000)
    announced = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\nxx"   # refused unread
    for req in (post("/echo", b"x" * 1001), post("/echo", b"x" * 1001, chunked=True), announced):
        with connect(app) as s:
            s.sendall(req)
            r = Reader(s)
            status, headers, data = r.response()
            assert status == 413 and headers["connection"] == "close"
            assert set(json.loads(data)["error"]) == {"message", "type", "param", "code"}
            assert r.closed()


@pytest.mark.parametrize("garbage", [b"NOT HTTP AT ALL\r\n\r\n", b"POST /echo HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                                     b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
def test_malformed_request_is_an_openai_400_after_the_answers_before_it(app, garbage):
    with connect(app) as s:
        s.sendall(post("/echo", b"first") + garbage)
        r = Reader(s)
        echo_ok(r.response(), b"first")
        status, headers, data = r.response()
        assert status == 400 and json.loads(data)["error"]["message"]
        assert r.closed()


def test_http_10_and_connection_close(app):
    with connect(app) as s:
        s.sendall(b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
        r = Reader(s)
        status, headers, data = r.response()
        assert status == 200 and json.loads(data)["size"] == 2
        assert r.closed()
    with connect(app) as s:
        s.sendall(post("/echo", b"", "Connection: close\r\n"))
        r = Reader(s)
        assert r.response()[1]["connection"] == "close"
        assert r.closed()


def test_streaming_is_chunked_and_sent_as_written(app):
    with connect(app) as s:
        s.sendall(post("/stream", b""))
        assert app.started.wait(10)
        s.settimeout(10)
        got = b""
        while b"data: 0" not in got:     # the first event arrives while the handler still waits
            got += s.recv(65536)
        assert b"Transfer-Encoding: chunked" in got
        app.loop.call_soon_threadsafe(app.release.set)
        r = Reader(s)
        r.buf = got[got.index(b"\r\n\r\n") + 4:]
        body = r.chunked_body()
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_a_client_that_disconnects_cancels_its_request(app):
    s = connect(app)
    s.sendall(post("/hang", b"{}"))
    assert app.started.wait(10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()     # a reset
    assert app.cancelled.wait(10)


def test_a_handler_bug_is_a_500_and_the_server_stays_up(app):
    with connect(app) as s:
        s.sendall(post("/boom", b""))
        r = Reader(s)
        status, _, data = r.response()
        assert status == 500 and json.loads(data)["error"]["message"]
        s.sendall(post("/echo", b"after"))
        echo_ok(r.response(), b"after")


def test_an_idle_connection_is_closed_after_the_keep_alive_time(app, monkeypatch):
    monkeypatch.setattr(server, "KEEPALIVE_SECONDS", 0.3)
    with connect(app) as s:
        s.sendall(post("/echo", b"x"))
        r = Reader(s)
        echo_ok(r.response(), b"x")
        time.sleep(0.1)
        s.sendall(post("/echo", b"y"))     # within the time: still served
        echo_ok(r.response(), b"y")
        t0 = time.monotonic()
        assert r.closed() and time.monotonic() - t0 < 5


@pytest.mark.parametrize("partial", [b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le",
                                     b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"])
def test_a_request_left_unfinished_is_a_408_after_the_keep_alive_time(app, monkeypatch, partial):
    """A client that stops mid-head or mid-body (slowloris) does not hold its connection for ever."""
    monkeypatch.setattr(server, "KEEPALIVE_SECONDS", 0.3)
    with connect(app) as s:
        s.sendall(post("/echo", b"x") + partial)
        r = Reader(s)
        echo_ok(r.response(), b"x")
        t0 = time.monotonic()
        status, headers, data = r.response()
        assert status == 408 and headers["connection"] == "close" and json.loads(data)["error"]["message"]
        assert r.closed() and time.monotonic() - t0 < 5


def test_a_request_has_the_whole_keep_alive_time_from_its_first_byte(app, monkeypatch):
    """A connection idle for most of the keep-alive time, then a request sent slowly: served, not a 408 (the
    time counts from the request's first byte, not from when the connection became idle)."""
    monkeypatch.setattr(server, "KEEPALIVE_SECONDS", 0.6)
    with connect(app) as s:
        s.sendall(post("/echo", b"x"))
        r = Reader(s)
        echo_ok(r.response(), b"x")
        time.sleep(0.4)
        data = post("/echo", b"slow")
        for i in range(0, len(data), len(data) // 4 + 1):
            s.sendall(data[i:i + len(data) // 4 + 1])
            time.sleep(0.1)
        echo_ok(r.response(), b"slow")


def test_a_head_too_large_is_431_and_not_held_in_memory(app, monkeypatch):
    monkeypatch.setattr(server, "MAX_HEAD", 10_000)
    with connect(app) as s:     # a head that never ends, a read at a time: refused once past the limit
        s.sendall(post("/echo", b"first") + b"POST /echo HTTP/1.1\r\nX-Big: ")
        r = Reader(s)
        echo_ok(r.response(), b"first")
        status = 0
        for _ in range(100):
            try:
                s.sendall(b"a" * 1000)
            except OSError:
                break
            time.sleep(0.002)
        status, headers, data = r.response()
        assert status == 431 and headers["connection"] == "close" and json.loads(data)["error"]["message"]
        assert r.closed()
    with connect(app) as s:     # a head under the limit in many reads is served
        head = post("/echo", b"ok", "X-Big: " + "b" * 8000 + "\r\n")
        for i in range(0, len(head), 500):
            s.sendall(head[i:i + 500])
            time.sleep(0.001)
        echo_ok(Reader(s).response(), b"ok")


VALID = st.one_of(
    st.builds(lambda n, c: post("/echo?q=%d" % n, b"v" * n, chunked=c), st.integers(0, 1000), st.booleans()),
    st.just(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Test: t\r\n\r\n"),
    st.just(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n"),
    st.just(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"),
    st.just(post("/boom", b"{}")))
LAST = st.sampled_from([b"", b"NOT HTTP AT ALL\r\n\r\n", post("/echo", b"x" * 1001),
                        post("/echo", b"x" * 1001, chunked=True),
                        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                        b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])


def answers_of(app: App, wires: list[bytes], cuts: list[int]) -> list[tuple]:
    """(status, connection header, body) of each request sent on one connection as ``wires`` joined, cut at
    ``cuts``; an answer's Date and X-Request-Id are left out."""
    wire = b"".join(wires)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    out = []
    with connect(app) as s:
        for a, b in zip(points, points[1:]):
            try:
                s.sendall(wire[a:b])
            except OSError:         # closed after a refused request: the rest is not read
                break
            time.sleep(0.0005)
        r = Reader(s)
        for w in wires:
            status, headers, body = r.response(head=w.startswith(b"HEAD "))
            out.append((status, headers.get("connection"), headers.get("content-length"), body))
            if headers.get("connection") == "close":
                assert r.closed()
                break
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid=st.lists(VALID, max_size=6), last=LAST, cuts=st.lists(st.integers(0, 100_000), max_size=8))
def test_pipelined_valid_and_invalid_requests_answer_as_one_by_one(app, monkeypatch, valid, last, cuts):
    """Any split of a pipeline of valid requests, maybe ending with an invalid one (malformed, too large) or a
    Connection: close: the same answers, in order, as each request alone on its own connection."""
    monkeypatch.setattr(server, "MAX_BODY", 1000)
    wires = valid + ([last] if last else [])
    alone = [answers_of(app, [w], [])[0] for w in wires]
    assert answers_of(app, wires, cuts) == alone


H2C = post("/echo", b"hello", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                             "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n")     # what ``curl --http2 -d`` sends
WEBSOCKET = post("/echo", b"hello", "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n") + b"\x81\x85not-http"


@pytest.mark.parametrize("wire", [H2C, WEBSOCKET, post("/echo", b"first") + H2C], ids=["h2c", "websocket", "second"])
@pytest.mark.parametrize("cut", [None, "head", 3])
def test_an_upgrade_request_is_answered_as_plain_http_then_the_connection_closes(app, wire, cut):
    """A server may ignore Upgrade (RFC 9110 7.8): the request gets one answer, body read, with Connection: close,
    and what the client sends after it (another protocol's bytes) is not read as HTTP. Before, the router answered
    it without its body and then answered a 400 too."""
    cut = wire.index(b"\r\n\r\n", wire.index(b"Upgrade")) + 4 if cut == "head" else cut
    with connect(app) as s:
        if cut is None:
            s.sendall(wire)
        else:
            s.sendall(wire[:cut])
            time.sleep(0.05)
            s.sendall(wire[cut:])
        r = Reader(s)
        if wire.startswith(post("/echo", b"first")):
            echo_ok(r.response(), b"first")
        status, headers, data = r.response()
        echo_ok((status, headers, data), b"hello")
        assert headers["connection"] == "close"
        assert r.closed()


def test_connect_is_405_then_close(app):
    with connect(app) as s:
        s.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n\x16\x03\x01")
        r = Reader(s)
        status, headers, data = r.response()
        assert status == 405 and "CONNECT" in json.loads(data)["error"]["message"]
        assert r.closed()
