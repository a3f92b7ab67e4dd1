"""A decode node that refuses a handed-over request (a 4xx) releases the prefill node's lease at once: the blocks
are not held for a decode that will never run, until the lease expires, counting against the prefill node's
``--max-leased-blocks`` (a 429 there for every later request) meanwhile.

Nodes: ``pr`` prefill; ``dr`` decode with a shorter context than the prefill node's and room for one waiting
request. Before the fix the lease stayed held after each refusal until its 30 s expiry.
"""

from __future__ import annotations

import threading

import pytest
from cluster import assert_no_leaks, completion_body, wait_for
from proxy import DisaggProxy

FLAGS = ["--kv-lease-seconds", "30"]
DECODE_FLAGS = FLAGS + ["--max-model-len", "256", "--max-waiting-requests", "1"]
PROMPT = "The capital of France is a city that has many famous museums, such as the"  # 2 full blocks + a tail


@pytest.fixture(scope="module")
def nodes(start_nodes):
    return start_nodes({"pr": ("prefill", FLAGS), "dr": ("decode", DECODE_FLAGS)})


@pytest.fixture(autouse=True)
def no_leaks(nodes):
    start = {n.name: n.kv()["free"] for n in nodes.values()}
    yield
    assert_no_leaks(nodes.values(), start)


def refused(nodes, body: dict, status: int, held_leases: float = 0) -> None:
    """Hand ``body`` over; the decode node answers ``status`` and the prefill node's lease ends well before expiry
    (``held_leases``: those other handoffs keep meanwhile)."""
    pr, dr = nodes["pr"], nodes["dr"]
    proxy = DisaggProxy(pr.url, dr.url)
    handle = proxy.handle(body)
    assert pr.kv()["leases"] == held_leases + 1
    r = proxy.decode(body, handle)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    wait_for(lambda: pr.kv()["leases"] == held_leases, 3, "the decode node to release the lease it refused")
    assert pr.kv()["expiries"] == 0


@pytest.mark.parametrize("body", [
    completion_body(" ".join([PROMPT] * 20), 4),  # the prompt alone fills the decode node's context
    completion_body(PROMPT, 1000),               # max_tokens beyond the decode node's context
], ids=["prompt-too-long", "max-tokens-too-many"])
def test_a_handoff_the_decode_node_refuses_ends_its_lease(nodes, body):
    refused(nodes, body, 400)


def test_a_handoff_refused_for_a_full_queue_ends_its_lease(nodes):
    """A handoff whose transfer is held counts as waiting (WAITING_FOR_REMOTE_KVS): the next one finds the queue
    full (--max-waiting-requests 1) and gets a 429."""
    pr, dr = nodes["pr"], nodes["dr"]
    proxy = DisaggProxy(pr.url, dr.url)
    body = completion_body(PROMPT + " Louvre", 4)
    handle = {**proxy.handle(body), "pdpool_test_hold": {"point": "before_transfer", "seconds": 8.0}}
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(proxy.decode(body, handle)))
    waiter.start()
    wait_for(lambda: dr.metrics().get("pdpool_num_requests_waiting") == 1, 30, "the held handoff to wait")
    pr_leases = pr.kv()["leases"]
    refused(nodes, completion_body(PROMPT, 4), 429, held_leases=pr_leases)
    waiter.join()
    assert answers[0].status_code == 200, answers[0].text
