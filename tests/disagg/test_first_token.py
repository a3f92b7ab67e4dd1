"""The decode node's checks of what the prefill node hands over: its first token and its prompt.

Nodes: ``pe`` prefill, ``de`` decode with ``--kv-load-failure-policy fail`` (a transfer problem is an error).

* A request that the prefill node's first token already finishes (``max_tokens`` 1, a stop token id, EOS) ends at
  once on the decode node: exactly that token, the right finish reason, nothing pulled, the lease released (not
  left to expire).
* A handle is for one prompt exactly: every full block's hash and the trailing partial block are checked.
"""

from __future__ import annotations

import copy

import pytest
from cluster import assert_no_leaks, completion_body, token_ids, wait_for
from proxy import DisaggProxy

FLAGS = ["--kv-lease-seconds", "30", "--kv-transfer-timeout", "5"]
PROMPT = "The capital of France is a city that has many famous museums, such as the"  # 2 full blocks + a tail


@pytest.fixture(scope="module")
def nodes(start_nodes):
    return start_nodes({"pe": ("prefill", FLAGS), "de": ("decode", FLAGS + ["--kv-load-failure-policy", "fail"])})


@pytest.fixture(autouse=True)
def no_leaks(nodes):
    start = {n.name: n.kv()["free"] for n in nodes.values()}
    yield
    assert_no_leaks(nodes.values(), start)


def finished_by_first_token(nodes, body: dict) -> tuple[dict, dict]:
    """Hand ``body`` over and check that the decode node pulled nothing and released the lease at once."""
    pe, de = nodes["pe"], nodes["de"]
    proxy = DisaggProxy(pe.url, de.url)
    handle = proxy.handle(body)
    before, expiries = de.kv(), pe.kv()["expiries"]
    r = proxy.decode(body, handle)
    assert r.status_code == 200, r.text
    after = de.kv()
    assert after["pulled"] == before["pulled"] and after["ok"] == before["ok"]  # no transfer at all
    wait_for(lambda: pe.kv()["leases"] == 0, 5, "the decode node to release the lease")  # lease is 30 s
    assert pe.kv()["expiries"] == expiries
    return handle, r.json()


def test_max_tokens_1_returns_exactly_the_prefill_nodes_token(nodes):
    handle, out = finished_by_first_token(nodes, completion_body(PROMPT, 1))
    assert token_ids(out) == [handle["first_token_id"]]
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 1


def test_max_tokens_1_streamed(nodes):
    pe, de = nodes["pe"], nodes["de"]
    events = DisaggProxy(pe.url, de.url).stream(completion_body(PROMPT + " Louvre", 1))
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert len(streamed) == 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: pe.kv()["leases"] == 0, 5, "the decode node to release the lease")


def test_a_stop_token_id_as_first_token_ends_the_request(nodes):
    body = completion_body(PROMPT + " and", 6)
    first = token_ids(nodes["de"].complete({**body, "max_tokens": 1}))[0]  # colocated on the decode node
    handle, out = finished_by_first_token(nodes, {**body, "stop_token_ids": [first]})
    assert handle["first_token_id"] == first
    choice = out["choices"][0]
    assert token_ids(out) == [first] and choice["finish_reason"] == "stop" and choice["text"] == ""


def test_eos_as_first_token_ends_the_request(nodes):
    # An assistant turn that is complete: the demo model's greedy next token is its EOS (<|im_end|>).
    prompt = "<|im_start|>user\nReply with the word yes.<|im_end|>\n<|im_start|>assistant\nYes."
    body = completion_body(prompt, 6)
    colocated = nodes["de"].complete(body)["choices"][0]
    assert colocated["finish_reason"] == "stop" and colocated["stop_reason"] is None, colocated  # EOS, at once
    assert len(colocated["token_ids"]) == 1
    handle, out = finished_by_first_token(nodes, body)
    choice = out["choices"][0]
    assert token_ids(out) == colocated["token_ids"] == [handle["first_token_id"]]
    assert choice["finish_reason"] == "stop" and choice["text"] == ""


def refused(nodes, body: dict, handle: dict, match: str) -> None:
    pe, de = nodes["pe"], nodes["de"]
    r = DisaggProxy(pe.url, de.url).decode(body, handle)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and match in error["message"], error


def test_a_handle_without_block_hashes_is_refused(nodes):
    pe = nodes["pe"]
    body = completion_body(PROMPT + " Orsay", 4)
    handle = DisaggProxy(pe.url, nodes["de"].url).handle(body)
    refused(nodes, body, {**handle, "block_hashes": []}, "0 block_hashes for 1 full blocks")
    wait_for(lambda: pe.kv()["leases"] == 0, 5, "the refusing decode node to release the lease")


@pytest.mark.parametrize("edit,match", [
    ({"extra": "x"}, "extra must be an object"),
    ({"first_token_logprobs": {}}, "first_token_logprobs.logprob must be a number"),
    ({"first_token_logprobs": {"logprob": -0.5, "top": [["a"]]}}, "first_token_logprobs.top must be a list"),
    ({"pdpool_version": 1}, "KV handle version 1, this node speaks 2"),
])
def test_a_malformed_handle_field_is_a_400_not_a_500_and_releases_the_lease(nodes, edit, match):
    """A handle that is no valid handle still names its lease: the refusing decode node releases it, where the prefill
    node held the blocks for the lease's whole 30 s."""
    pe = nodes["pe"]
    body = completion_body(PROMPT + " Cluny", 4, logprobs=2)
    handle = DisaggProxy(pe.url, nodes["de"].url).handle(body)
    refused(nodes, body, {**handle, **edit}, match)
    wait_for(lambda: pe.kv()["leases"] == 0, 5, "the refusing decode node to release the lease")


def test_a_first_token_outside_the_vocabulary_is_a_400_not_a_500(nodes):
    """It was appended as the request's first output token, and the engine step failed on it (a 500)."""
    pe = nodes["pe"]
    body = completion_body(PROMPT + " Giverny", 4, logprobs=2)
    handle = DisaggProxy(pe.url, nodes["de"].url).handle(body)
    refused(nodes, body, {**handle, "first_token_id": 10**9}, "outside this model's vocabulary")
    lp = handle["first_token_logprobs"]
    refused(nodes, body, {**handle, "first_token_logprobs": {**lp, "top": [[10**9, -0.1]]}}, "outside")
    wait_for(lambda: pe.kv()["leases"] == 0, 5, "the refusing decode node to release the lease")


def test_a_handle_for_another_trailing_partial_block_is_refused(nodes):
    pe = nodes["pe"]
    ids = [2000 + 7 * i for i in range(40)]   # 2 full blocks of 16, then 8 tokens
    other = ids[:-1] + [4321]                 # the same full blocks; only the last (partial) block differs
    handle = DisaggProxy(pe.url, nodes["de"].url).handle(completion_body(ids, 4))
    refused(nodes, completion_body(other, 4), copy.deepcopy(handle), "different prompt")
    wait_for(lambda: pe.kv()["leases"] == 0, 5, "the refusing decode node to release the lease")


def test_a_seeded_sampled_answer_is_the_colocated_one(nodes):
    """The prefill node's first token took the first draw of the request's seeded generator: the decode node's
    generator starts past it, so a seeded request gives the same tokens disaggregated as on one node (whichever
    way a router sends it)."""
    pe, de = nodes["pe"], nodes["de"]
    proxy = DisaggProxy(pe.url, de.url)
    for seed in (1, 42, 2**40):
        body = completion_body(PROMPT, 8, temperature=1.2, top_p=0.95, seed=seed, ignore_eos=True)
        colocated = token_ids(de.complete(body))
        assert token_ids(proxy.complete(body)) == colocated, seed
        streamed = [t for e in proxy.stream(body) for c in e["choices"] for t in c.get("token_ids") or []]
        assert streamed == colocated, seed


@pytest.mark.parametrize("prefill_logprobs, logprobs", [(None, 2), (1, 3), (3, 1), (None, 0), (2, 0)])
def test_logprobs_the_prefill_leg_did_not_ask_for_are_the_colocated_ones(nodes, prefill_logprobs, logprobs):
    """The first token's logprobs come with the handle, as many as the prefill leg asked for. A decode request asking
    for other ones (a proxy that sends the legs different fields) got a first token without logprobs (one entry short:
    the tokens and text offsets no longer matched the text) or with the prefill leg's number of top logprobs."""
    pe, de = nodes["pe"], nodes["de"]
    body = completion_body(PROMPT + " Rodin", 4, logprobs=logprobs)
    prefill = {**body, "logprobs": prefill_logprobs} if prefill_logprobs is not None else \
        {k: v for k, v in body.items() if k != "logprobs"}
    handle = DisaggProxy(pe.url, de.url).handle(prefill)
    r = DisaggProxy(pe.url, de.url).decode(body, handle)
    assert r.status_code == 200, r.text
    disagg = r.json()["choices"][0]
    colocated = de.complete(body)["choices"][0]
    assert disagg["text"] == colocated["text"] and disagg["token_ids"] == colocated["token_ids"]
    got, want = disagg["logprobs"], colocated["logprobs"]
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"], (got, want)
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-3)
    assert [sorted(t) for t in got["top_logprobs"]] == [sorted(t) for t in want["top_logprobs"]]
    wait_for(lambda: pe.kv()["leases"] == 0, 5, "the decode node to end the lease")
