"""A decode node that refuses a handed-over request (a 4xx) releases the prefill node's lease at once: the blocks
are not held for a decode that will never run, until the lease expires, counting against the prefill node's
``--max-leased-blocks`` (a 429 there for every later request) meanwhile.

Nodes: ``pr`` prefill; ``dr`` decode with a shorter context than the prefill node's and room for one waiting
request. Before the fix the lease stayed held after each refusal until its 30 s expiry.
"""

from __future__ import annotations

import dataclasses
import threading

import httpx
import pytest
from cluster import assert_no_leaks, completion_body, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy import DisaggProxy

from pdpool.kv_transfer.handle import KVHandle

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


# ---- refusals at the decode node's HTTP edge (pdpool.server.app), before the engine sees the request -----------

HANDOFF = completion_body(PROMPT, 4)   # what the handles below come from
LEASE_FIELDS = ("do_remote_prefill", "node_id", "remote_host", "remote_port", "lease_id")   # what a release reads
CHAT = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def edge_refused(nodes, path: str, body: dict, status: int, params=lambda handle: handle) -> None:
    """A handle from the prefill node, sent (as ``params(handle)``) with ``body``, which the decode node's HTTP
    edge refuses with ``status``: the lease ends well before its expiry."""
    pr, dr = nodes["pr"], nodes["dr"]
    handle = DisaggProxy(pr.url, dr.url).handle(HANDOFF)
    assert pr.kv()["leases"] == 1
    r = httpx.post(dr.url + path, json={**body, "kv_transfer_params": params(handle)}, timeout=60)
    assert r.status_code == status, r.text
    wait_for(lambda: pr.kv()["leases"] == 0, 3, "the decode node to release the lease its edge refused")
    assert pr.kv()["expiries"] == 0


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", completion_body(PROMPT, 4, temperature=-1), 400),
    ("/v1/completions", completion_body(PROMPT, 4, model="nope"), 404),
    ("/v1/completions", completion_body(PROMPT, 4, pdpool_prompt_token_ids="x"), 400),
    ("/v1/chat/completions", {**CHAT, "top_p": 7}, 400),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400),
    ("/v1/responses", {"model": "nope", "input": PROMPT}, 404),
    ("/v1/messages", {**CHAT, "temperature": -1}, 400),
], ids=["temperature", "model", "token-ids", "chat-top-p", "chat-messages", "responses-model", "messages-temperature"])
def test_a_handoff_refused_at_the_http_edge_ends_its_lease(nodes, path, body, status):
    edge_refused(nodes, path, body, status)


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(KVHandle)
                                              if f.name not in LEASE_FIELDS]) | st.text(max_size=6),
                             JSON, max_size=4))
def test_a_real_handle_refused_at_the_edge_is_released_whatever_else_it_carries(nodes, extra):
    edge_refused(nodes, "/v1/completions", completion_body(PROMPT, 4, model="nope"), 404,
                 lambda handle: {**handle, **{k: v for k, v in extra.items() if k not in LEASE_FIELDS}})


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=JSON | st.dictionaries(st.sampled_from(LEASE_FIELDS) | st.text(max_size=6), JSON, max_size=6))
def test_any_kv_transfer_params_refused_at_the_edge_get_a_4xx(nodes, params):
    """Whatever ``kv_transfer_params`` hold (no handle, or a malformed one), a body refused at the edge is a 4xx,
    never a 500 from ending a lease they do not name."""
    body = {**completion_body(PROMPT, 4, temperature=-1), "kv_transfer_params": params}
    r = httpx.post(nodes["dr"].url + "/v1/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text


def test_a_handoff_whose_client_leaves_while_its_prompt_is_tokenized_ends_its_lease(nodes):
    """A long prompt is tokenized off the loop; a client that leaves meanwhile cancels the handler there, before the
    engine sees the request. The cancellation passed the refusal by (it caught ``Exception`` only), so the prefill
    node's lease was held until its 30 s expiry."""
    pr, dr = nodes["pr"], nodes["dr"]
    handle = DisaggProxy(pr.url, dr.url).handle(HANDOFF)
    long_prompt = PROMPT + " " + "The capital of France is a city that has many famous museums. " * 60000   # ~2 s
    with pytest.raises(httpx.TimeoutException):
        httpx.post(dr.url + "/v1/completions", json={**completion_body(long_prompt, 4), "kv_transfer_params": handle},
                   timeout=httpx.Timeout(60, read=0.5))
    wait_for(lambda: pr.kv()["leases"] == 0, 3, "the decode node to release the lease of the request that left")
    assert pr.kv()["expiries"] == 0


@pytest.mark.parametrize("body", [HANDOFF, completion_body(PROMPT, 4, temperature=-1)], ids=["role", "edge"])
def test_a_handoff_sent_to_a_prefill_node_is_a_400_and_ends_its_lease(nodes, body):
    """A proxy that sends the decode leg to a prefill node (a Service over every node of the pool, say): the node
    has no decode side to take the handle, and refused it without ending its lease, held to its expiry."""
    pr, dr = nodes["pr"], nodes["dr"]
    handle = DisaggProxy(pr.url, dr.url).handle(HANDOFF)
    assert pr.kv()["leases"] == 1
    r = DisaggProxy(pr.url, pr.url).decode(body, handle)
    assert r.status_code == 400 and r.json()["error"]["param"] in ("kv_transfer_params", "temperature"), r.text
    wait_for(lambda: pr.kv()["leases"] == 0, 3, "the prefill node to release the lease it refused")
    assert pr.kv()["expiries"] == 0
