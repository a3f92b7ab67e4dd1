"""Faults, made deterministic by the test hook that holds a transfer at a chosen point.

Nodes: ``pf`` prefill (lease 3 s), ``df`` decode with the default ``recompute`` policy. Every fault must end in a
correct answer (the colocated tokens), the recompute counter +1, and no leaked block or lease.
"""

from __future__ import annotations

import http.server
import socketserver
import threading

import httpx
import pytest
from cluster import assert_no_leaks, completion_body, internal_post, token_ids, wait_for
from proxy import DisaggProxy

LEASE_S = 3.0
FLAGS = ["--kv-lease-seconds", str(LEASE_S), "--kv-transfer-timeout", "3"]
PROMPT = "Once upon a time, in a small village at the edge of a dark forest, there lived a"


@pytest.fixture(scope="module")
def nodes(start_nodes):
    return start_nodes({"pf": ("prefill", FLAGS), "df": ("decode", FLAGS)})


@pytest.fixture(autouse=True)
def no_leaks(nodes):
    start = {n.name: n.kv()["free"] for n in nodes.values()}
    yield
    assert_no_leaks(nodes.values(), start)


@pytest.fixture(scope="module")
def expected(nodes):
    """Colocated greedy tokens of the prompts used here (on the decode node, without kv_transfer_params)."""
    cache: dict = {}

    def get(body: dict) -> list[int]:
        key = repr(body)
        if key not in cache:
            cache[key] = token_ids(nodes["df"].complete(body))
        return cache[key]

    return get


def held(point: str, seconds: float) -> dict:
    return {"pdpool_test_hold": {"point": point, "seconds": seconds}}


def recovers_by_recompute(nodes, expected, body: dict, handle: dict) -> dict:
    df = nodes["df"]
    before = df.kv()
    r = DisaggProxy(nodes["pf"].url, df.url).decode(body, handle)
    assert r.status_code == 200, r.text
    assert token_ids(r.json()) == expected(body)
    after = df.kv()
    assert after["recomputes"] == before["recomputes"] + 1
    assert after["ok"] == before["ok"]
    return after


def test_happy_path_then_lease_expires_before_the_pull(nodes, expected):
    pf, df = nodes["pf"], nodes["df"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT, 6)
    expected(body)
    before = df.kv()
    assert token_ids(proxy.complete(body)) == expected(body)  # warms the connection; counted ok
    assert df.kv()["ok"] == before["ok"] + 1
    handle = proxy.handle(body)
    pulled = df.kv()["pulled"]
    expiries = pf.kv()["expiries"]
    recovers_by_recompute(nodes, expected, body, {**handle, **held("before_transfer", LEASE_S + 0.5)})
    assert df.kv()["pulled"] == pulled  # the lease had run out: nothing was read
    wait_for(lambda: pf.kv()["expiries"] == expiries + 1, 5, "the lease expiry to be counted")


def test_lease_expires_during_the_pull(nodes, expected):
    pf, df = nodes["pf"], nodes["df"]
    body = completion_body(PROMPT + " wise", 6)
    handle = DisaggProxy(pf.url, df.url).handle(body)
    recovers_by_recompute(nodes, expected, body, {**handle, **held("after_transfer", LEASE_S + 0.5)})


def test_cancelled_decode_releases_the_lease(nodes, expected):
    pf, df = nodes["pf"], nodes["df"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT + " brave", 6)
    handle = proxy.handle(body)
    assert pf.kv()["leases"] == 1
    expiries = pf.kv()["expiries"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(df.base_url + "/completions", json={**body, "kv_transfer_params": {
            **handle, **held("before_transfer", 0.5)}}, timeout=0.2)
    wait_for(lambda: pf.kv()["leases"] == 0, LEASE_S - 0.3, "the cancelled decode to release the lease")
    assert pf.kv()["expiries"] == expiries  # ended by the decode node, not by expiry


def test_a_response_whose_handle_was_never_read_is_released_by_its_request_id(nodes):
    """The router's client left as the prefill answer went out: ``POST /internal/kv/responses/{X-Request-Id}/release``
    frees that response's lease (and needs the internal token); another id frees nothing."""
    pf = nodes["pf"]
    first = {**completion_body(PROMPT + " lost", 6), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(pf.url + "/v1/completions", json=first, headers={"X-Request-Id": "lost-answer-7"}, timeout=60)
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["lease_id"]
    assert pf.kv()["leases"] == 1
    assert internal_post(pf, "kv/responses/lost-answer-7/release", token=None).status_code in (401, 403)
    assert internal_post(pf, "kv/responses/lost-answer/release").json() == {"released": 0}
    assert pf.kv()["leases"] == 1
    assert internal_post(pf, "kv/responses/lost-answer-7/release").json() == {"released": 1}
    assert pf.kv()["leases"] == 0


def churn(node, num_prompts: int = 12) -> None:
    """Prefill other prompts on ``node`` until every block it freed has been taken again (96 blocks)."""
    for i in range(num_prompts):
        node.complete(completion_body(f"Number {i}: " + " ".join(f"w{i}x{j}" for j in range(60)), 1))


def test_a_replayed_handle_is_recomputed_not_read_from_reused_blocks(nodes, expected):
    """The first decode ended the lease and freed its blocks; a replay of the same handle read blocks that other
    prompts had taken since, and the prefill node answered the repeated notification as held (wrong tokens)."""
    pf, df = nodes["pf"], nodes["df"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT + " green", 6)
    expected(body)
    handle = proxy.handle(body)
    assert token_ids(proxy.decode(body, handle).json()) == expected(body)
    churn(pf)
    recovers_by_recompute(nodes, expected, body, handle)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_handle_edited_to_read_other_blocks_is_recomputed(nodes, expected, mode):
    """A client edits its own handle to read its lease's blocks in another order (or any other block of the prefill
    node): the prefill node held the lease, so it answered held and the decode node used the wrong KV."""
    pf = nodes["pf"]
    body = completion_body(PROMPT + " red", 6)
    expected(body)
    handle = DisaggProxy(pf.url, nodes["df"].url).handle(body)
    edited = {**handle, "transfer_mode": mode, "remote_block_ids": handle["remote_block_ids"][::-1]}
    recovers_by_recompute(nodes, expected, body, edited)


class Listener:
    """An HTTP server on a free local port that records what reaches it (path, internal token) and answers held."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                seen.append((self.path, self.headers.get("X-PDPool-Internal-Token")))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"held": true, "renewed": {}}')

            do_GET = do_POST

            def log_message(self, *args) -> None:
                pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_handle_naming_another_address_gets_no_call_and_no_token(nodes, expected):
    """A handle edited to name an address that is not its node's (the pool's index has the node elsewhere): the
    decode node recomputes without calling it, where it sent its internal token there (agent, notify)."""
    pf, df = nodes["pf"], nodes["df"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT + " blue", 6)
    expected(body)
    handle = proxy.handle(body)
    listener = Listener()
    try:
        for edit in ({"remote_port": listener.port}, {"remote_port": listener.port, "incarnation": "x" * 12,
                                                      "agent_name": "pf#" + "x" * 12}):
            recovers_by_recompute(nodes, expected, body, {**handle, **edit})
    finally:
        listener.close()
    assert listener.seen == []
    r = proxy.decode(body, handle)  # the real handle still works, and ends the lease
    assert r.status_code == 200 and token_ids(r.json()) == expected(body)


def test_prefill_killed_between_handle_and_pull(nodes, expected):
    pf = nodes["pf"]
    body = completion_body(PROMPT + " kind", 6)
    expected(body)
    handle = DisaggProxy(pf.url, nodes["df"].url).handle(body)
    pf.kill()
    recovers_by_recompute(nodes, expected, body, handle)
    pf.restart()


def test_a_stale_handle_after_a_crash_does_not_break_the_new_incarnation(nodes, expected):
    """The prefill node was killed and restarted; a handle of its old incarnation reached the decode node after one
    of the new: the old agent's metadata was still in Redis (no deregistration), loading it dropped the new agent,
    its warm-up failed, and the decode node went on naming the new agent as loaded, so every later handoff from that
    node recomputed."""
    pf, df = nodes["pf"], nodes["df"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT + " crashed", 6)
    expected(body)
    old = proxy.handle(body)
    pf.kill()
    pf.restart()

    def pulled_from_the_new_incarnation() -> None:
        ok = df.kv()["ok"]
        assert token_ids(proxy.complete(body)) == expected(body)
        assert df.kv()["ok"] == ok + 1

    pulled_from_the_new_incarnation()
    recovers_by_recompute(nodes, expected, body, old)
    pulled_from_the_new_incarnation()
    pulled_from_the_new_incarnation()


def test_old_incarnation_handle_is_never_pulled_from_the_new_agent(nodes, expected, redis_module):
    from pdpool.kv_index.keys import PoolKeys

    pf, df = nodes["pf"], nodes["df"]
    keys = PoolKeys("default", "default")
    body = completion_body(PROMPT + " tall", 6)
    expected(body)
    old = DisaggProxy(pf.url, df.url).handle(body)
    pf.restart()  # same node id and port, new incarnation (clean shutdown: deregistered)
    new = DisaggProxy(pf.url, df.url).handle(body)
    assert new["incarnation"] != old["incarnation"] and new["node_id"] == old["node_id"]
    client = redis_module.client()
    assert not client.exists(keys.nixl("pf", old["incarnation"]))  # the clean shutdown deregistered it
    assert client.exists(keys.nixl("pf", new["incarnation"]))
    pulled = df.kv()["pulled"]
    recovers_by_recompute(nodes, expected, body, old)
    assert df.kv()["pulled"] == pulled
    r = DisaggProxy(pf.url, df.url).decode(body, new)  # the new incarnation's own handle works
    assert r.status_code == 200 and token_ids(r.json()) == expected(body)


def test_redis_outage_keeps_serving_and_the_index_heals(nodes, expected, redis_module):
    from pdpool.kv_index.keys import PoolKeys

    pf, df = nodes["pf"], nodes["df"]
    keys = PoolKeys("default", "default")
    proxy = DisaggProxy(pf.url, df.url)
    redis_module.stop()
    bodies = [completion_body(PROMPT + w, 5) for w in (" old", " young")]
    handles = []
    for body in bodies:
        before = df.kv()
        handle = proxy.handle(body)
        handles.append(handle)
        assert token_ids(proxy.decode(body, handle).json()) == expected(body)
        assert df.kv()["ok"] == before["ok"] + 1
    pf.restart()  # readiness does not depend on Redis; the decode node gets the new agent from the node itself
    body = completion_body(PROMPT + " clever", 5)
    handle = proxy.handle(body)
    assert handle["incarnation"] != handles[0]["incarnation"]
    assert token_ids(proxy.decode(body, handle).json()) == expected(body)
    redis_module.start()
    client = redis_module.client()
    wanted = {bytes.fromhex(h) for h in handle["block_hashes"]}
    wait_for(lambda: client.exists(keys.heartbeat("pf"), keys.heartbeat("df")) == 2
             and wanted <= client.smembers(keys.blocks("pf")), 15, "the index to heal")
    assert client.exists(keys.nixl("pf", handle["incarnation"]))
    hb = client.get(keys.heartbeat("pf")).decode()
    assert handle["incarnation"] in hb


def test_push_into_an_expired_lease_is_recomputed(nodes, expected):
    """The handle's transfer mode decides; here the decode node trusts a (forged) long lease and asks for a push
    after the real one ran out: the prefill node refuses to push (held false), the decode node recomputes."""
    pf, df = nodes["pf"], nodes["df"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT + " quiet", 5)
    expected(body)
    pushed = pf.kv()["pushed"]
    handle = {**proxy.handle(body), "transfer_mode": "push"}
    before = df.kv()
    assert token_ids(proxy.decode(body, handle).json()) == expected(body)
    assert df.kv()["ok"] == before["ok"] + 1 and pf.kv()["pushed"] > pushed
    pushed = pf.kv()["pushed"]
    late = {**proxy.handle(body), "transfer_mode": "push", "lease_remaining_s": 60.0,
            **held("before_transfer", LEASE_S + 0.5)}
    recovers_by_recompute(nodes, expected, body, late)
    assert pf.kv()["pushed"] == pushed


def test_a_prefill_node_that_left_has_its_agent_dropped_and_loaded_again_when_it_returns(nodes, expected):
    """A prefill node that stops leaves the pool (its heartbeat goes): the decode node's peer sweep removes its NIXL
    agent (it kept every peer it ever loaded, and pods get new names at every rollout). The node comes back as a new
    incarnation: its handoffs are pulled again, cycle after cycle, and the decode node holds one agent at most."""
    pf, df = nodes["pf"], nodes["df"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT + " returns", 6)
    expected(body)

    def sweeps() -> list[str]:
        return [line for line in df.log_path.read_text(errors="replace").splitlines()
                if "peers that left the pool" in line]

    for _ in range(2):
        ok = df.kv()["ok"]
        assert token_ids(proxy.complete(body)) == expected(body)
        assert df.kv()["ok"] == ok + 1
        m = df.metrics()   # what an operator watches: the agents held, and those removed so far
        assert m["pdpool_kv_peers_loaded"] == 1
        removed_so_far = m["pdpool_kv_peers_removed_total"]
        before = len(sweeps())
        pf.stop()
        removed = wait_for(lambda: sweeps()[before:], 10.0, "the decode node's sweep to remove the prefill agent")
        assert "removed 1 peers that left the pool: pf#" in removed[0] and removed[0].endswith("; 0 loaded")
        m = df.metrics()
        assert m["pdpool_kv_peers_loaded"] == 0 and m["pdpool_kv_peers_removed_total"] == removed_so_far + 1
        pf.restart()
    ok = df.kv()["ok"]
    assert token_ids(proxy.complete(body)) == expected(body)
    assert df.kv()["ok"] == ok + 1
