"""Bad input never breaks a node: hypothesis fuzzes both OpenAI endpoints of a live node (section 3 of issue 9).

Each example sends a few fuzz cases (``fuzz_strategies.fuzz_cases``) at once, together with valid requests that
share the node's steps with them. No answer may be a 5xx, every 4xx carries the OpenAI error object, every valid
request gets its 200 with the right usage, and after the run the node is ready, runs and queues nothing, and has
all its KV blocks free again.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fuzz_strategies import check_answer, fuzz_cases, send, valid_completion

MODEL = "demo"
EXAMPLES = int(os.environ.get("PDPOOL_FUZZ_EXAMPLES", "130"))  # x 4-5 cases each: at least 500 per run
PERMISSIVE_EXAMPLES = max(1, EXAMPLES // 3)
VALID_MAX_TOKENS = 2


def node_counters(server) -> dict[str, float]:
    m = server.metrics()
    return {k: m[k] for k in ("pdpool_num_requests_running", "pdpool_num_requests_waiting",
                              "pdpool_kv_cache_free_blocks")}


def settled(server, expected_free: float, timeout: float = 60.0) -> dict[str, float]:
    """The node's counters once nothing runs or waits and every block is free again (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        counters = node_counters(server)
        if (counters["pdpool_num_requests_running"] == 0 and counters["pdpool_num_requests_waiting"] == 0
                and counters["pdpool_kv_cache_free_blocks"] == expected_free) or time.monotonic() > deadline:
            return counters
        time.sleep(0.2)


@pytest.mark.timeout(1800)  # a few minutes on an idle 2-core machine; shrinking a failure takes longer
def test_fuzzed_requests_never_break_the_node(server):
    fuzz_node(server, EXAMPLES)


@pytest.mark.timeout(1800)
def test_fuzzed_requests_never_break_a_permissive_node(permissive_server):
    """The same on a node that renders clients' chat templates and parses tool calls from free text: what the
    default node refuses by name runs here, and must fail as cleanly. Its run is a third of the default one's, so
    it must cover answers and refusals; bad paths and methods (404, 405) are the default run's to cover."""
    fuzz_node(permissive_server, PERMISSIVE_EXAMPLES, must_see={200, 400})


def fuzz_node(server, examples: int, must_see=frozenset({200, 400, 404, 405})) -> None:
    api_key = server.api_key
    valid = valid_completion(MODEL, api_key, VALID_MAX_TOKENS)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        first = c.post(valid.path, content=valid.content, headers=valid.headers)
    assert first.status_code == 200, first.text
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    start = settled(server, server.num_kv_blocks)
    assert start["pdpool_kv_cache_free_blocks"] == server.num_kv_blocks, start
    seen = {"cases": 0, "valid": 0, "status": {}}

    async def exchange(cases) -> None:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            batch = [valid, *cases, valid]  # valid requests before and after the bad ones, all in flight at once
            answers = await asyncio.gather(*[send(client, case) for case in batch])
        for case, answer in zip(batch, answers):
            check_answer(case, answer)
            if answer is not None:
                seen["status"][answer.status] = seen["status"].get(answer.status, 0) + 1
            if case is valid:
                assert answer.status == 200, answer.body[:500]
                usage = json.loads(answer.body)["usage"]
                assert usage["completion_tokens"] == VALID_MAX_TOKENS, usage
                assert usage["prompt_tokens"] == prompt_tokens, usage
                seen["valid"] += 1
        seen["cases"] += len(cases)

    @settings(max_examples=examples, deadline=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(st.lists(fuzz_cases(MODEL, api_key), min_size=4, max_size=5))
    def fuzz(cases):
        asyncio.run(exchange(cases))

    fuzz()
    assert seen["cases"] >= min(500, 4 * examples), seen
    assert set(seen["status"]) >= must_see, seen  # the run really covered each kind of answer

    assert httpx.get(server.url + "/health/ready", timeout=30).status_code == 200
    end = settled(server, start["pdpool_kv_cache_free_blocks"])
    assert end == start, (end, start, seen)
    with httpx.Client(base_url=server.url, timeout=120) as c:  # and it still serves
        r = c.post(valid.path, content=valid.content, headers=valid.headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == VALID_MAX_TOKENS
