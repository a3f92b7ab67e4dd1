"""Prefill -> decode handoff, exact: tokens identical to a colocated node and to HF, bytes accounted, pull and push.

Nodes (shared by the module): ``p1`` prefill (pull, max 12 leased blocks), ``b1`` both (push; also the colocated
reference), ``d1`` decode with ``--kv-load-failure-policy fail`` (any transfer problem is an error, so a passing
test proves the KV came over), ``d32`` decode with another block size. Destination blocks are filled with random garbage before
every transfer (test hook), so a block not transferred cannot go unnoticed.
"""

from __future__ import annotations

import concurrent.futures
import copy

import httpx
import pytest
from cluster import BLOCK_SIZE, assert_no_leaks, completion_body, internal_post, token_ids, wait_for
from proxy import DisaggProxy

PROMPTS = [
    "The capital of France is a city that has many famous museums, such as",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
    "Water boils at",
    "List three primary colors: red,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Then the fox",
]
FLAGS = ["--kv-lease-seconds", "8", "--kv-transfer-timeout", "5"]


@pytest.fixture(scope="module")
def nodes(start_nodes):
    return start_nodes({
        "p1": ("prefill", FLAGS + ["--max-leased-blocks", "12"]),
        "b1": ("both", FLAGS + ["--kv-transfer-mode", "push"]),
        "d1": ("decode", FLAGS + ["--kv-load-failure-policy", "fail"]),
        "d32": ("decode", FLAGS + ["--block-size", "32"]),
    })


@pytest.fixture(autouse=True)
def no_leaks(nodes):
    start = {n.name: n.kv()["free"] for n in nodes.values()}
    yield
    assert_no_leaks(nodes.values(), start)


def pulled_blocks(handle: dict, decode_response: dict) -> int:
    cached = decode_response["usage"]["prompt_tokens_details"]["cached_tokens"]
    return len(handle["remote_block_ids"]) - cached // BLOCK_SIZE


def block_bytes(handle: dict) -> int:
    return handle["rank_layouts"][0]["block_bytes"]


def test_pull_is_token_identical_to_colocated_and_hf(nodes, hf_reference):
    p1, b1, d1 = nodes["p1"], nodes["b1"], nodes["d1"]
    proxy = DisaggProxy(p1.url, d1.url)
    before = d1.kv()
    expected_bytes = 0
    for prompt in PROMPTS:
        body = completion_body(prompt, 8)
        handle = proxy.handle(body)
        assert handle["do_remote_prefill"] and handle["remote_engine_id"] == "p1"
        assert handle["remote_port"] == p1.port and handle["transfer_mode"] == "pull"
        assert 0 < handle["lease_remaining_s"] <= 8
        r = proxy.decode(body, handle)
        assert r.status_code == 200, r.text
        disagg = r.json()
        colocated = b1.complete(body)
        prompt_ids = colocated["choices"][0]["prompt_token_ids"]
        assert token_ids(disagg) == token_ids(colocated), prompt
        assert token_ids(disagg) == hf_reference.greedy(prompt_ids, 8), prompt
        assert token_ids(disagg)[0] == handle["first_token_id"]
        assert "kv_transfer_params" not in disagg or disagg["kv_transfer_params"] is None
        expected_bytes += pulled_blocks(handle, disagg) * block_bytes(handle)
    after = d1.kv()
    assert after["recomputes"] == before["recomputes"]
    assert after["ok"] - before["ok"] == len(PROMPTS)
    assert after["pulled"] - before["pulled"] == expected_bytes > 0


def test_decode_prefix_cache_hit_is_not_pulled(nodes):
    p1, b1, d1 = nodes["p1"], nodes["b1"], nodes["d1"]
    shared = [2000 + 7 * i for i in range(40)]  # token ids: exactly 2 full blocks shared, then a partial one
    d1.complete(completion_body(shared + [42], 2))  # d1 now caches the shared prefix's full blocks
    body = completion_body(shared + [3000 + i for i in range(30)], 6)
    proxy = DisaggProxy(p1.url, d1.url)
    before = d1.kv()
    handle = proxy.handle(body)
    disagg = proxy.decode(body, handle).json()
    cached = disagg["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 2 * BLOCK_SIZE
    num_pulled = len(handle["remote_block_ids"]) - cached // BLOCK_SIZE
    assert 0 < num_pulled < len(handle["remote_block_ids"])
    assert d1.kv()["pulled"] - before["pulled"] == num_pulled * block_bytes(handle)
    assert token_ids(disagg) == token_ids(b1.complete(body))


def test_push_is_token_identical(nodes):
    b1, d1 = nodes["b1"], nodes["d1"]
    proxy = DisaggProxy(b1.url, d1.url)
    b_before, d_before = b1.kv(), d1.kv()
    expected = 0
    for prompt in PROMPTS[:3]:
        body = completion_body(prompt + " and", 6)
        handle = proxy.handle(body)
        assert handle["transfer_mode"] == "push"
        disagg = proxy.decode(body, handle).json()
        assert token_ids(disagg) == token_ids(b1.complete(body)), prompt
        expected += pulled_blocks(handle, disagg) * block_bytes(handle)
    assert b1.kv()["pushed"] - b_before["pushed"] == expected > 0
    d_after = d1.kv()
    assert d_after["pulled"] == d_before["pulled"] and d_after["recomputes"] == d_before["recomputes"]
    assert d_after["ok"] - d_before["ok"] == 3


def test_streamed_decode_matches(nodes):
    p1, b1, d1 = nodes["p1"], nodes["b1"], nodes["d1"]
    body = completion_body(PROMPTS[2] + " always", 8)
    events = DisaggProxy(p1.url, d1.url).stream(body)
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed == token_ids(b1.complete(body))
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_requests_without_kv_transfer_params_are_served_on_every_role(nodes):
    body = completion_body(PROMPTS[3], 5)
    expected = token_ids(nodes["b1"].complete(body))
    for name in ("p1", "d1"):
        assert token_ids(nodes[name].complete(body)) == expected


def test_lease_cap_answers_429(nodes):
    p1, d1 = nodes["p1"], nodes["d1"]
    proxy = DisaggProxy(p1.url, d1.url)
    # 40-token prompts: 3 blocks each; 4 leases fill the cap of 12.
    bodies = [completion_body([1000 + 50 * i + j for j in range(40)], 2) for i in range(5)]
    # the 4 prefills at once (one engine step on the prefill node), so no lease can run out before the 4th is issued
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        handles = list(pool.map(proxy.handle, bodies[:4]))
    assert p1.value("pdpool_kv_leased_blocks") == 12
    r = proxy.prefill(bodies[4])
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    for body, handle in zip(bodies, handles):
        assert proxy.decode(body, handle).status_code == 200
    r = proxy.prefill(bodies[4])  # room again
    assert r.status_code == 200
    assert proxy.decode(bodies[4], r.json()["kv_transfer_params"]).status_code == 200
    wait_leases_gone(p1)


def wait_leases_gone(node, timeout: float = 10.0) -> None:
    from cluster import wait_for

    wait_for(lambda: node.kv()["leases"] == 0, timeout, "leases to end")


def test_fail_policy_gives_a_clear_error(nodes):
    p1, d1 = nodes["p1"], nodes["d1"]
    proxy = DisaggProxy(p1.url, d1.url)
    body = completion_body([5000 + 3 * i for i in range(20)], 3)  # not cached on d1: a block must be pulled
    handle = proxy.handle(body)
    forged = copy.deepcopy(handle)
    forged["lease_id"] = "0" * 32  # the prefill node never held it: it cannot confirm
    before = d1.kv()
    r = proxy.decode(body, forged)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_transfer_failed" and "lease" in error["message"]
    assert d1.kv()["fail"] == before["fail"] + 1
    assert proxy.decode(body, handle).status_code == 200  # the real handle still works (and ends the lease)


def test_incompatible_block_size_is_a_clear_error(nodes):
    p1, d32 = nodes["p1"], nodes["d32"]
    body = completion_body(PROMPTS[1], 3)
    proxy = DisaggProxy(p1.url, d32.url)
    expiries = p1.kv()["expiries"]
    handle = proxy.handle(body)
    r = proxy.decode(body, handle)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert "block_size is 16 there and 32 here" in error["message"]
    wait_leases_gone(p1)  # the refusing decode node released the lease
    assert p1.kv()["expiries"] == expiries


def test_internal_endpoints_require_the_token(nodes):
    p1 = nodes["p1"]
    assert internal_post(p1, "kv/leases/abc/notify", token=None, json={}).status_code == 403
    assert internal_post(p1, "kv/leases/abc/notify", token="wrong", json={}).status_code == 403
    r = internal_post(p1, "kv/leases/abc/notify", json={})
    assert r.status_code == 200 and r.json() == {"held": False}
    assert httpx.get(p1.url + "/internal/kv/agent", timeout=5).status_code == 403


def test_nodes_publish_to_redis(nodes, redis_module):
    from pdpool.kv_index.heartbeat import NodeInfo
    from pdpool.kv_index.keys import PoolKeys

    p1, d1 = nodes["p1"], nodes["d1"]
    keys = PoolKeys("default", "default")
    client = redis_module.client()
    body = completion_body(PROMPTS[5], 3)
    proxy = DisaggProxy(p1.url, d1.url)
    handle = proxy.handle(body)
    proxy.decode(body, handle)
    held = client.smembers(keys.blocks("p1"))
    assert {bytes.fromhex(h) for h in handle["block_hashes"]} <= held
    for node in nodes.values():
        info = NodeInfo.from_json(client.get(keys.heartbeat(node.name)))
        assert info.role == node.role and info.url.endswith(str(node.port))
        assert client.exists(keys.nixl(node.name, info.incarnation))
    assert NodeInfo.from_json(client.get(keys.heartbeat("p1"))).incarnation == handle["incarnation"]


def test_chat_handoff_matches_colocated(nodes):
    p1, b1, d1 = nodes["p1"], nodes["b1"], nodes["d1"]
    body = {"model": "demo", "messages": [{"role": "user", "content": "Name a planet of the solar system."}],
            "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    disagg = DisaggProxy(p1.url, d1.url).complete(body, "/v1/chat/completions")
    colocated = httpx.post(b1.base_url + "/chat/completions", json=body, timeout=120).json()
    assert disagg["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"]
    assert disagg["choices"][0]["message"]["content"] == colocated["choices"][0]["message"]["content"]


def test_logprobs_include_the_prefill_nodes_first_token(nodes):
    p1, b1, d1 = nodes["p1"], nodes["b1"], nodes["d1"]
    body = completion_body(PROMPTS[4], 4, logprobs=2)
    disagg = DisaggProxy(p1.url, d1.url).complete(body)["choices"][0]["logprobs"]
    colocated = b1.complete(body)["choices"][0]["logprobs"]
    assert disagg["tokens"] == colocated["tokens"] and len(disagg["token_logprobs"]) == 4
    assert disagg["token_logprobs"] == pytest.approx(colocated["token_logprobs"], abs=1e-3)
    assert [sorted(t) for t in disagg["top_logprobs"]] == [sorted(t) for t in colocated["top_logprobs"]]


def test_concurrent_handoffs(nodes):
    from concurrent.futures import ThreadPoolExecutor

    p1, b1, d1 = nodes["p1"], nodes["b1"], nodes["d1"]
    proxy = DisaggProxy(p1.url, d1.url)
    bodies = [completion_body(p + " Indeed,", 5) for p in PROMPTS[:4]]
    before = d1.kv()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(proxy.complete, bodies))
    for body, result in zip(bodies, results):
        assert token_ids(result) == token_ids(b1.complete(body))
    assert d1.kv()["ok"] == before["ok"] + 4 and d1.kv()["recomputes"] == before["recomputes"]


def test_a_pushing_node_drops_the_agent_of_a_decode_node_that_left(nodes):
    """Push mode: the prefill side loads each decode node's agent. A decode node that stops leaves the pool; the
    pushing node's peer sweep removes its agent, and pushes to its next incarnation work."""
    b1, d1 = nodes["b1"], nodes["d1"]
    proxy = DisaggProxy(b1.url, d1.url)
    body = completion_body(PROMPTS[3] + " then", 6)
    expected = token_ids(b1.complete(body))

    def sweeps() -> list[str]:
        return [line for line in b1.log_path.read_text(errors="replace").splitlines()
                if "peers that left the pool" in line]

    assert token_ids(proxy.complete(body)) == expected
    before = len(sweeps())
    d1.stop()
    removed = wait_for(lambda: sweeps()[before:], 10.0, "the pushing node's sweep to remove the decode agent")
    assert "removed 1 peers that left the pool: d1#" in removed[0]
    d1.restart()
    pushed = b1.kv()["pushed"]
    assert token_ids(proxy.complete(body)) == expected
    assert b1.kv()["pushed"] > pushed
