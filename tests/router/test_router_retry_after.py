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

BUSY = {"error": {"message": "the server is busy", "type": "rate_limit_error", "param": None, "code": "busy"}}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "demo",
              "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
              "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}


class ForeignServer:
    """An OpenAI server that is not pdpool, on its own thread: ``busy`` (None, or the ``Retry-After`` value of
    its 429, "" for none) decides its answer to ``/v1/completions``; ``hold`` keeps an answer back until set."""

    def __init__(self) -> None:
        self.busy: str | None = None
        self.hold = threading.Event()
        self.hold.set()
        self.seen = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

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

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


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
    own default)."""
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
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "queue_full", r.text
                assert r.headers.get("Retry-After") == "1", (url, r.headers)
