"""Every 429 through the router says when to retry (``Retry-After``), as clients and gateways expect: the
router's own (``--max-inflight``), and a node's, passed through with the node's own ``Retry-After`` when it
gives one. A node's 429 that every decode node tried answered used to reach the client as a 503
("every decode node tried failed"), without its body or its ``Retry-After``.

Real router processes; the nodes are a real pdpool node with a one-slot queue, and an OpenAI server of another
make (an aiohttp app on a thread, as a vLLM server behind the router: it answers 429 with what the test sets)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import httpx
import openai
import pytest
from aiohttp import web

from cluster import wait_for  # noqa: E402  (tests/disagg, put on sys.path by conftest.py)
from threaded_app import ThreadedApp  # noqa: E402

BUSY = {"error": {"message": "the server is busy", "type": "rate_limit_error", "param": None, "code": "busy"}}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "demo",
              "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
              "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}


class ForeignServer(ThreadedApp):
    """An OpenAI server that is not pdpool, on its own thread: ``busy`` (None, or the ``Retry-After`` value of
    its 429, "" for none) decides its answer to ``/v1/completions`` (and a chat's: the same, a completion's 200 when
    not busy); ``hold`` keeps an answer back until set."""

    def __init__(self) -> None:
        self.busy: str | None = None
        self.hold = threading.Event()
        self.hold.set()
        self.seen = 0
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)   # its 429s only
        super().__init__(app, access_log=None)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "demo", "object": "model", "owned_by": "vllm"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")

    async def completions(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen += 1
        if self.busy is not None:
            return web.json_response(BUSY, status=429, headers={"Retry-After": self.busy} if self.busy else None)
        while not self.hold.is_set():
            await asyncio.sleep(0.01)
        return web.json_response(COMPLETION)


@pytest.fixture(scope="module")
def foreign():
    server = ForeignServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(foreign, start_router):
    return start_router(["--decode", foreign.url, "--max-inflight", "1"], name="router-retry-after")


def ready(router) -> None:
    """The node's cooldown after its 429 (the tests' routers: 0.5 s) is over."""
    wait_for(lambda: httpx.get(router.url + "/health/ready", timeout=5).status_code == 200, 10, "the router ready")


def seconds(retry_after: str | None) -> int:
    assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, retry_after
    return int(retry_after)


def test_the_routers_own_429_says_when_to_retry(router, foreign):
    ready(router)
    foreign.hold.clear()
    body = {"model": "demo", "prompt": "hi", "max_tokens": 1}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(router.post, "/v1/completions", body)
            before = foreign.seen
            wait_for(lambda: foreign.seen > before, 10, "the first request at the node")
            r = router.post("/v1/completions", body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests", r.text
            seconds(r.headers.get("Retry-After"))
            foreign.hold.set()
            assert held.result(30).status_code == 200
    finally:
        foreign.hold.set()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("retry_after", ["7", "", "Wed, 21 Oct 2026 07:28:00 GMT"])
def test_a_nodes_429_reaches_the_client_with_its_retry_after(router, foreign, retry_after, stream):
    """Through the official client: its RateLimitError, with the node's body and ``Retry-After`` (the router's
    when the node gave none)."""
    ready(router)
    foreign.busy = retry_after
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            router.client().completions.create(model="demo", prompt="hi", max_tokens=1, stream=stream)
    finally:
        foreign.busy = None
    err = caught.value
    assert err.status_code == 429 and err.body["code"] == "busy", err.body
    if retry_after:
        assert err.response.headers["Retry-After"] == retry_after
    else:
        seconds(err.response.headers.get("Retry-After"))


@pytest.fixture(scope="module")
def small_queue(launch_server):
    """A pdpool node that runs one request and queues one: the rest are its 429 (``queue_full``)."""
    srv = launch_server("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                        "--max-num-seqs", "1", "--max-waiting-requests", "1")
    yield srv
    srv.stop()


def test_a_pdpool_nodes_queue_full_429_through_the_router(small_queue, start_router):
    """The node's own 429 says when to retry, and the router passes it on (its cooldown, 3 s here, would be its
    own default); a request that comes while the node is left out for its 429 is the router's own 429, never a
    503 (it was "no ready node", though the node was up and only full)."""
    router = start_router(["--both", small_queue.url, "--node-cooldown", "3"], name="router-small-queue")
    body = {"model": "demo", "prompt": "Count to one hundred:", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0}

    def burst(url: str) -> list[httpx.Response]:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            return list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=300), range(6)))

    for url in (small_queue.url, router.url):
        ready(router)
        replies = burst(url)
        assert {r.status_code for r in replies} == {200, 429}, [(r.status_code, r.text) for r in replies]
        for r in replies:
            if r.status_code == 429 and r.json()["error"]["code"] == "pool_at_capacity":
                assert url == router.url and 1 <= seconds(r.headers.get("Retry-After")) <= 3, r.headers
            elif r.status_code == 429:
                assert r.json()["error"]["code"] == "queue_full", r.text
                assert r.headers.get("Retry-After") == "1", (url, r.headers)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_request_while_every_node_is_left_out_for_its_429_is_a_429(foreign, start_router, path, body):
    """The router leaves a node that answered 429 out for --node-cooldown (5 s here); a request meanwhile was a
    503 "no ready node" without Retry-After, though the node was up and only full. It is a 429 that says when the
    node may be tried again; a node that is down still makes a 503 (test_router_e2e.py)."""
    router = start_router(["--decode", foreign.url, "--node-cooldown", "5"], name=f"router-cooldown-{path[4:8]}")
    body = {"model": "demo", "max_tokens": 1, **body}
    foreign.busy = "2"
    try:
        first = router.post(path, body)
        assert first.status_code == 429 and first.json()["error"]["code"] == "busy", first.text
        then = router.post(path, body)
    finally:
        foreign.busy = None
    assert then.status_code == 429 and then.json()["error"]["code"] == "pool_at_capacity", then.text
    assert 4 <= seconds(then.headers.get("Retry-After")) <= 5, then.headers
    wait_for(lambda: router.post(path, body).status_code == 200, 10, "the node's cooldown to end")
