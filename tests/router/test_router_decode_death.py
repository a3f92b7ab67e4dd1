"""The only decode node dies (SIGKILL) while Redis still lists it (its heartbeat key has not expired yet): the
request goes to the live prefill node, decode-only, as it would once the decode node dropped out of the list,
instead of a 503 "every decode node tried failed".

Real processes: redis-server, one prefill node (heartbeat 0.2 s), one decode node whose heartbeat period is long
(10 s: its key outlives it by 30 s, the window the test runs in), a router on Redis discovery.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from cluster import Node, completion_body, running_nodes, token_ids, wait_for  # noqa: E402
from routers import redis_flags  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def nodes(demo_model_dir, tmp_path_factory, redis_module):
    log_dir = tmp_path_factory.mktemp("nodes")
    with running_nodes({"p0": ("prefill", [])}, log_dir, redis_module.url) as live:
        d0 = Node("d0", "decode", ["--redis", redis_module.url, "--heartbeat-seconds", "10"], log_dir, None)
        try:
            d0.wait_ready()
            yield {**live, "d0": d0}
        finally:
            d0.stop()


def test_a_request_right_after_the_only_decode_node_died_goes_to_the_prefill_node(nodes, redis_module,
                                                                                   start_router):
    router = start_router(redis_flags(redis_module.url) + ["--node-cooldown", "30"], name="router-decode-death")
    wait_for(lambda: router.value('pdpool_router_nodes{role="decode",usable="true"}') == 1
             and router.value('pdpool_router_nodes{role="prefill",usable="true"}') == 1, 30, "the router's nodes")
    body = completion_body("The decode node is gone, and yet", max_tokens=6)
    expected = token_ids(nodes["p0"].complete(body))
    warm = router.post("/v1/completions", body)   # a pooled connection to d0, which the kill resets
    assert warm.status_code == 200, warm.text
    retries = router.value('pdpool_router_requests_total{decision="retry"}')

    nodes["d0"].kill()
    r = router.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert token_ids(r.json()) == expected
    m = router.metrics()
    assert m.get('pdpool_router_upstream_errors_total{kind="connect",node="d0"}', 0) + m.get(
        'pdpool_router_upstream_errors_total{kind="stream_broken",node="d0"}', 0) == 1, m
    assert m['pdpool_router_requests_total{decision="retry"}'] == retries + 1   # the prefill node's try
    assert router.value('pdpool_router_nodes{role="decode",usable="false"}') == 1   # d0 cools down still
    streamed = router.post("/v1/completions", {**body, "stream": True})   # d0 cools down: the prefill node
    assert streamed.status_code == 200 and "[DONE]" in streamed.text, streamed.text
