"""Clients that leave during the prefill leg: the router closes that leg too, so the prefill node aborts prefills
nobody waits for. Before, the router let every abandoned prefill finish (then released its lease): a burst of
clients that gave up left the prefill node computing their prompts, holding blocks, for tens of seconds (measured
with ``pdpool up``: 24 clients gone after at most 4 s, the prefill node busy for 55 s more).
Real processes: redis-server, one prefill node (small prefill chunks, so a burst queues), one decode node, the
router."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from cluster import assert_no_leaks, completion_body, running_nodes, wait_for  # noqa: E402
from routers import redis_flags  # noqa: E402

WORDS = ["river", "stone", "lamp", "orbit", "maple", "cloud", "anchor", "violet", "signal", "harbor"]
NUM_CLIENTS = 8
CHUNK = 32
PROMPT_WORDS = 120  # about 400 tokens: 13 chunks of 32 tokens each


@pytest.fixture(scope="module")
def pair(demo_model_dir, tmp_path_factory, redis_module):
    spec = {"p0": ("prefill", ["--max-num-batched-tokens", str(CHUNK)]), "d0": ("decode", [])}
    with running_nodes(spec, tmp_path_factory.mktemp("nodes"), redis_module.url) as nodes:
        yield nodes


def prompt(i: int) -> str:
    return f"Client {i}: " + " ".join(WORDS[(i * 3 + 7 * k) % len(WORDS)] + str(k) for k in range(PROMPT_WORDS))


def test_clients_leaving_during_prefill_stop_the_prefill_work(pair, redis_module, start_router):
    router = start_router(redis_flags(redis_module.url), name="router-abandon")
    p0, d0 = pair["p0"], pair["d0"]
    wait_for(lambda: router.value('pdpool_router_nodes{role="prefill",usable="true"}') == 1, 30, "the router")
    start = {n.name: n.kv()["free"] for n in (p0, d0)}
    chunks_before = p0.value("pdpool_prefill_chunks_total")

    async def leave_early(client: httpx.AsyncClient, i: int) -> None:
        with pytest.raises(httpx.TimeoutException):
            await client.post(router.url + "/v1/completions", json=completion_body(prompt(i), 20),
                              timeout=httpx.Timeout(0.5))

    async def burst() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(leave_early(client, i) for i in range(NUM_CLIENTS)))

    asyncio.run(burst())
    left = time.monotonic()
    wait_for(lambda: p0.value("pdpool_num_requests_running") + p0.value("pdpool_num_requests_waiting") == 0, 10,
             "the prefill node to drop the abandoned prefills")
    assert_no_leaks([p0, d0], start, 10)
    idle_after = time.monotonic() - left
    chunks = p0.value("pdpool_prefill_chunks_total") - chunks_before
    # Every prompt run to its end is 12 chunks that stop short of it: 96 for the burst, as before the fix.
    assert chunks < NUM_CLIENTS * 12 * 0.6, (chunks, idle_after)
    assert router.value('pdpool_router_requests_total{decision="disaggregated"}') == 0  # none reached decode


class HalfAnsweringPrefill:
    """Two stub pdpool nodes on one thread's loop: a prefill node whose answer (a KV handle) stops halfway for
    ``pause`` seconds, as when the client leaves just as a real node's answer is on its way, and a decode node.
    Records the release calls it gets, and the request id each prefill request carried."""

    def __init__(self, pause: float = 3.0) -> None:
        import threading

        from aiohttp import web

        self.pause = pause
        self.released: list[str] = []
        self.notified: list[str] = []
        self.prefill_ids: list[str] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.urls: list[str] = []

        async def ok(request):
            return web.json_response({"status": "ok"})

        async def models(request):
            return web.json_response({"object": "list", "data": [{"id": "demo", "object": "model",
                                                                   "owned_by": "pdpool"}]})

        async def metrics(request):
            return web.Response(text="")

        async def completions(request):
            self.prefill_ids.append(request.headers.get("X-Request-Id", ""))
            await request.read()
            body = (b'{"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "demo", "choices": '
                    b'[{"index": 0, "text": "x", "finish_reason": "length", "logprobs": null}], "usage": '
                    b'{"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}, "kv_transfer_params": '
                    b'{"lease_id": "lease-1", "remote_block_ids": [1]}}')
            resp = web.StreamResponse(headers={"Content-Type": "application/json",
                                               "Content-Length": str(len(body))})
            await resp.prepare(request)
            await resp.write(body[:len(body) // 2])
            await asyncio.sleep(self.pause)
            await resp.write(body[len(body) // 2:])
            return resp

        async def release(request):
            self.released.append(request.match_info["request_id"])
            return web.json_response({"released": 1})

        async def notify(request):
            self.notified.append(request.match_info["lease_id"])
            return web.json_response({"held": True})

        def run():
            asyncio.set_event_loop(self.loop)
            app = web.Application()
            app.router.add_get("/health/ready", ok)
            app.router.add_get("/v1/models", models)
            app.router.add_get("/metrics", metrics)
            app.router.add_post("/v1/completions", completions)
            app.router.add_post("/internal/kv/responses/{request_id}/release", release)
            app.router.add_post("/internal/kv/leases/{lease_id}/notify", notify)
            self.runner = web.AppRunner(app, handler_cancellation=True)
            self.loop.run_until_complete(self.runner.setup())
            for _ in range(2):
                site = web.TCPSite(self.runner, "127.0.0.1", 0)
                self.loop.run_until_complete(site.start())
                self.urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_client_leaving_while_the_prefill_answer_arrives_has_its_lease_released(start_router):
    """The prefill node has written (part of) its answer, the KV handle in it, when the client leaves: the node
    takes the handle as delivered, so the closed connection frees nothing there, and the router never read the
    lease id. Before, the lease was held until it expired (1 in about 280 mid-prefill disconnects in a soak of
    ``pdpool up``); now the router has the node free that response's leases by request id."""
    nodes = HalfAnsweringPrefill()
    try:
        prefill, decode = nodes.urls
        router = start_router(["--prefill", prefill, "--decode", decode], name="router-half-answer")
        wait_for(lambda: router.value('pdpool_router_nodes{role="prefill",usable="true"}') == 1, 30, "the router")
        with pytest.raises(httpx.TimeoutException):
            httpx.post(router.url + "/v1/completions", json=completion_body("a prompt of some words", 5),
                       headers={"X-Request-Id": "abandon-1"}, timeout=httpx.Timeout(1.0))
        wait_for(lambda: nodes.released, 5, "the router to release the response's leases")
        # by the id the prefill leg carried: the client's made unique (28bdd29), so that requests sharing a client's
        # X-Request-Id never free each other's leases
        assert nodes.released == nodes.prefill_ids and nodes.released[0].startswith("abandon-1."), nodes.released
        assert nodes.notified == []   # the lease id itself was never read
    finally:
        nodes.stop()
