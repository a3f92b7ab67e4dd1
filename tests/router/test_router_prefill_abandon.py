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
    wait_for(lambda: p0.value("vllm:num_requests_running") + p0.value("vllm:num_requests_waiting") == 0, 10,
             "the prefill node to drop the abandoned prefills")
    assert_no_leaks([p0, d0], start, 10)
    idle_after = time.monotonic() - left
    chunks = p0.value("pdpool_prefill_chunks_total") - chunks_before
    # Every prompt run to its end is 12 chunks that stop short of it: 96 for the burst, as before the fix.
    assert chunks < NUM_CLIENTS * 12 * 0.6, (chunks, idle_after)
    assert router.value('pdpool_router_requests_total{decision="disaggregated"}') == 0  # none reached decode
