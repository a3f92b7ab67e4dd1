"""Requests that carry the same client ``X-Request-Id`` stay apart at the nodes: a client that leaves frees its own
prefill lease, never another's. Real processes: redis-server, a prefill and a decode node, a router."""

from __future__ import annotations

import concurrent.futures
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from cluster import completion_body, running_nodes, token_ids, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(600)

WORDS = "amber birch cobalt delta ember fjord granite hollow indigo juniper kestrel lagoon".split()


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory, redis_module):
    spec = {"p0": ("prefill", []), "d0": ("decode", [])}
    with running_nodes(spec, tmp_path_factory.mktemp("nodes"), redis_module.url) as nodes:
        yield nodes


def test_a_client_leaving_frees_its_own_lease_not_that_of_another_with_its_request_id(cluster, start_router):
    """B's prefill is done and its lease waits for the decode node (paused); A, sent with the same X-Request-Id,
    leaves during its prefill, so the router asks the prefill node to free the leases of A's response by its id.
    B's lease must stay: with the client's id on the prefill leg, the node freed B's too, and B's decode node
    found no KV to pull (it recomputed the prompt)."""
    p0, d0 = cluster["p0"], cluster["d0"]
    router = start_router(["--prefill", p0.url, "--decode", d0.url, "--discovery-seconds", "30",
                           "--node-cooldown", "0", "--disagg-min-tokens", "1"], name="router-ids")
    headers = {"X-Request-Id": "the-same-id"}
    body_b = completion_body("Shared id, first: " + " ".join(WORDS), 4)
    want = token_ids(d0.complete(body_b))
    recomputes = d0.value("pdpool_kv_recomputes_total")
    slow = " ".join(WORDS[(7 * i) % len(WORDS)] + str(i) for i in range(110))   # ~20 blocks: a slow prefill
    d0.signal(signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            b = ex.submit(httpx.post, router.url + "/v1/completions", json=body_b, headers=headers, timeout=120)
            wait_for(lambda: p0.value("pdpool_kv_leases") == 1, 30, "B's lease on the prefill node")
            with pytest.raises(httpx.TimeoutException):
                httpx.post(router.url + "/v1/completions", json=completion_body(slow, 50, ignore_eos=True),
                           headers=headers, timeout=0.3)
            time.sleep(2.0)   # the router's release of A's response has reached the prefill node by now
            held = p0.value("pdpool_kv_leases")
            d0.signal(signal.SIGCONT)
            r = b.result()
    finally:
        d0.signal(signal.SIGCONT)
    assert held == 1, "B's lease was released by A's leaving"
    assert r.status_code == 200 and token_ids(r.json()) == want
    assert r.headers["X-Request-Id"] == "the-same-id"          # the client's id, as sent
    assert d0.value("pdpool_kv_recomputes_total") == recomputes
    wait_for(lambda: p0.value("pdpool_kv_leases") == 0, 10, "no lease left")
    log = router.log_tail(50000)
    assert "[the-same-id]" in log and "the-same-id." not in log   # the router's lines name the client's id
