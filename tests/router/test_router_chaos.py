"""Chaos through the router, the moment of each fault drawn by hypothesis: clients that leave, nodes paused
(SIGSTOP), and a network that cuts, resets or garbles a node's answer (``tests/disagg/fault_proxy.py``).

Real processes: redis-server, one prefill and two decode nodes, routers. Every case ends with a correct answer
(the colocated tokens) or a clear error (an OpenAI error, or a stream's final error event), within the configured
timeouts; afterwards each live node is idle with all its blocks free and no lease (released, not expired), and
the router counts no request in flight on any node.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from cluster import assert_no_leaks, completion_body, running_nodes, token_ids, wait_for  # noqa: E402
from fault_proxy import Fault, FaultProxy  # noqa: E402
from hypothesis_profiles import scaled  # noqa: E402
from routers import redis_flags  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TRANSFER_TIMEOUT = 2.0       # the nodes' --kv-transfer-timeout: a pull from a paused prefill node gives up soon
PREFILL_TIMEOUT = 1.5        # the router's --prefill-timeout
REQUEST_TIMEOUT = 4.0        # the router's --request-timeout (a leg's wait for its head, then each gap in its body)
NUM_BLOCKS = 96              # every node's (tests/disagg/cluster.py); an idle node has them all free
WORDS = "amber birch cobalt delta ember fjord granite hollow indigo juniper kestrel lagoon".split()
_serial = itertools.count()


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory, redis_module):
    flags = ["--kv-transfer-timeout", str(TRANSFER_TIMEOUT)]
    spec = {"p0": ("prefill", flags), "d0": ("decode", flags), "d1": ("decode", flags)}
    with running_nodes(spec, tmp_path_factory.mktemp("nodes"), redis_module.url) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def router(cluster, redis_module, start_router):
    router = start_router(redis_flags(redis_module.url), name="router-chaos")
    wait_for(lambda: router.value('pdpool_router_nodes{role="decode",usable="true"}') == 2, 30, "the router")
    return router


def prompt(words: int) -> str:
    """A prompt no earlier case sent (so that the router hands it off rather than finding it cached)."""
    n = next(_serial)
    return f"Case {n}: " + " ".join(WORDS[(n + 5 * k) % len(WORDS)] + str(k) for k in range(words))


def inflight(router) -> float:
    return sum(v for k, v in router.metrics().items() if k.startswith("pdpool_router_inflight_requests"))


def expiries(cluster) -> float:
    return cluster["p0"].value("pdpool_kv_lease_expiries_total")


def settled(cluster, router, expired: float) -> None:
    """No leg in flight at the router, then every live node idle with all its blocks free and no lease (well
    before a lease would expire: none did)."""
    wait_for(lambda: inflight(router) == 0, 10, f"the router's in-flight count to return to 0: {router.metrics()}")
    live = [n for n in cluster.values() if n.alive]
    for node in live:
        wait_for(lambda: node.value("pdpool_num_requests_running") + node.value("pdpool_num_requests_waiting") == 0,
                 10, f"{node.name} to go idle")
    assert_no_leaks(live, {n.name: NUM_BLOCKS for n in live}, 8)
    assert expiries(cluster) == expired, "a lease expired instead of being released"


def raw_post(url: str, path: str, body: dict, leave: tuple[str, float] | None = None, timeout: float = 60.0) -> bytes:
    """POST over a plain socket; read until the server closes, or until ``leave`` (("seconds", s): that long;
    ("events", k): k SSE events received), then close: the client leaves at that moment. Returns the bytes
    received."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    kind, value = leave or ("seconds", timeout)
    deadline = time.monotonic() + (value if kind == "seconds" else timeout)
    got = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
            if kind == "events" and got.count(b"data: ") >= value:
                break
    except TimeoutError:
        if leave is None or kind != "seconds":
            raise
    finally:
        sock.close()
    return got


def phase(received: bytes) -> str:
    if not received:
        return "before the first byte"
    if b"text/event-stream" in received:
        return "mid-stream" if received.count(b"data: ") > 1 else "after the first event"
    return "after the answer"


# ---- clients that leave ----------------------------------------------------------------------------------------

MOMENTS = st.one_of(st.tuples(st.just("seconds"), st.floats(0.0, 1.0)), st.tuples(st.just("events"),
                                                                                  st.integers(1, 30)))


@settings(max_examples=scaled(5), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.booleans(), leave=MOMENTS, words=st.integers(10, 80))
def test_a_client_leaving_at_any_moment_leaves_nothing_behind(cluster, router, stream, leave, words):
    """Before the prefill answers, during the KV pull, after the first decode byte, mid-stream."""
    expired = expiries(cluster)
    body = completion_body(prompt(words), 40, ignore_eos=True, stream=stream)
    event(phase(raw_post(router.url, "/v1/completions", body, leave)))
    settled(cluster, router, expired)


# ---- a network that breaks a node's answer ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxied(cluster, start_router):
    """A router whose legs to every node pass a ``FaultProxy``: the prefill node's its own fault, the two decode
    nodes' one shared fault (the retry on the other node goes through)."""
    faults = {"prefill": Fault(), "decode": Fault()}
    proxies = [FaultProxy(cluster["p0"].port, faults["prefill"]), FaultProxy(cluster["d0"].port, faults["decode"]),
               FaultProxy(cluster["d1"].port, faults["decode"])]
    router = start_router(["--prefill", proxies[0].url, "--decode", proxies[1].url, "--decode", proxies[2].url],
                          name="router-proxied")
    wait_for(lambda: router.value('pdpool_router_nodes{role="decode",usable="true"}') == 2
             and router.value('pdpool_router_nodes{role="prefill",usable="true"}') == 1, 30, "the router")
    yield router, faults
    for proxy in proxies:
        proxy.close()


@settings(max_examples=scaled(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(leg=st.sampled_from(["prefill", "decode"]), kind=st.sampled_from(["truncate", "reset", "garbage"]),
       after=st.integers(0, 1200), stream=st.booleans())
@example(leg="prefill", kind="truncate", after=40, stream=False)   # the KV handle lost: its lease released
@example(leg="decode", kind="truncate", after=500, stream=True)    # mid-event, after the stream started
@example(leg="prefill", kind="reset", after=0, stream=False)       # the node ran it, not a byte came back:
@example(leg="decode", kind="truncate", after=0, stream=True)      # not sent to it again (router/http1.py)
def test_a_node_answer_cut_reset_or_garbled_on_the_way(cluster, proxied, leg, kind, after, stream):
    """``after`` 0: not one byte of the answer gets through, after the node ran the request; the router's client
    does not send it again on that node (``router/http1.py``): the prefill leg falls back, the decode leg goes to
    the next decode node."""
    router, faults = proxied
    expired = expiries(cluster)
    body = completion_body(prompt(30), 8, stream=stream)
    fired = faults[leg].fired
    faults[leg].arm(kind, after)
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    elapsed = time.monotonic() - t0
    faults[leg].disarm()
    want = cluster["d0"].complete({**body, "stream": False})
    reached = "fired" if faults[leg].fired > fired else "not reached"
    event(f"{leg} {kind} {reached}: {check_outcome(r, want, stream)}")
    assert elapsed < 30
    settled(cluster, router, expired)


# ---- nodes that stop answering -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def impatient(cluster, redis_module, start_router):
    """A router with short timeouts: a prefill leg is abandoned after PREFILL_TIMEOUT s, a decode leg after
    REQUEST_TIMEOUT s (then the next decode node is tried, if nothing reached the client yet)."""
    router = start_router(redis_flags(redis_module.url) + ["--prefill-timeout", str(PREFILL_TIMEOUT),
                                                           "--request-timeout", str(REQUEST_TIMEOUT)],
                          name="router-impatient")
    wait_for(lambda: router.value('pdpool_router_nodes{role="decode",usable="true"}') == 2, 30, "the router")
    return router


def answer(router, body: dict) -> tuple[httpx.Response | Exception, float]:
    t0 = time.monotonic()
    try:
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as exc:
        return exc, time.monotonic() - t0
    return r, time.monotonic() - t0


def sse_frames(raw: bytes) -> list[tuple[str | None, dict | str]]:
    """(event name, parsed data) of each event; "[DONE]" as is."""
    frames = []
    for block in raw.decode().split("\n\n"):
        name = data = None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        if data is not None:
            frames.append((name, data))
    return frames



def check_outcome(r: httpx.Response, want: dict, stream: bool) -> str:
    """The colocated answer, or a clear error: an OpenAI error (5xx) or a stream's final error event."""
    if not stream:
        if r.status_code == 200:
            assert token_ids(r.json()) == token_ids(want)
            return "answered"
        assert r.status_code in (502, 503, 504) and r.json()["error"]["message"], r.text
        return f"error {r.status_code}"
    assert r.status_code == 200, r.text
    assert r.content.endswith(b"\n\n"), r.content[-300:]
    frames = sse_frames(r.content)   # every event parses: half of one would end a client's stream before the error
    last = frames[-1][1]
    if last == "[DONE]":
        assert "".join(c["text"] for _, data in frames[:-1] for c in data["choices"]) == want["choices"][0]["text"]
        return "answered"
    assert last["error"]["code"] == "upstream_stream_broken", frames[-3:]
    return "stream error event"


@settings(max_examples=scaled(2), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(victim=st.sampled_from(["p0", "d0", "d1"]), delay=st.floats(0.0, 1.0),
       pause=st.floats(0.2, REQUEST_TIMEOUT + 1.0), stream=st.booleans())
def test_a_node_paused_at_any_moment_never_hangs_the_request(cluster, impatient, victim, delay, pause, stream):
    expired = expiries(cluster)
    body = completion_body(prompt(30), 12, stream=stream)
    node = cluster[victim]
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        pending = ex.submit(answer, impatient, body)
        time.sleep(delay)
        node.signal(signal.SIGSTOP)
        try:
            time.sleep(pause)
        finally:
            node.signal(signal.SIGCONT)
        r, elapsed = pending.result()
    assert not isinstance(r, Exception), r
    want = cluster["d0"].complete({**body, "stream": False})
    event(f"{victim} paused: {check_outcome(r, want, stream)}")
    assert elapsed < PREFILL_TIMEOUT + 3 * REQUEST_TIMEOUT + 5, elapsed   # max_retries 2: three decode legs at most
    settled(cluster, impatient, expired)



@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "Tell me a story about a lighthouse.", "max_output_tokens": 24}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24}),
])
def test_a_stream_broken_mid_way_ends_with_its_apis_error_event(cluster, proxied, path, body):
    """The router's final error event has the shape a node's own has on that API: a Responses stream's ``error``
    event (type, code, message, param, the next sequence_number), an Anthropic ``error`` event, a chat chunk's
    ``{"error": ...}``."""
    router, faults = proxied
    expired = expiries(cluster)
    faults["decode"].arm("truncate", 900)
    r = httpx.post(router.url + path, json={"model": "demo", "stream": True, "temperature": 0, **body}, timeout=60)
    faults["decode"].disarm()
    assert r.status_code == 200, r.text
    frames = sse_frames(r.content)
    name, error = frames[-1]
    if path == "/v1/responses":
        assert name == "error" and error["type"] == "error" and error["code"] == "upstream_stream_broken", error
        assert error["message"] and "param" in error
        assert [data["sequence_number"] for _, data in frames] == list(range(len(frames))), frames
    elif path == "/v1/messages":
        assert name == "error" and error["type"] == "error" and error["error"]["type"] == "api_error", error
    else:
        assert name is None and error["error"]["code"] == "upstream_stream_broken", error
    settled(cluster, router, expired)


@pytest.mark.parametrize("stream", [False, True])
def test_a_handle_the_decode_node_refuses_falls_back_to_decode_only(cluster, proxied, stream):
    """A prefill node of another version (its KV handle's ``pdpool_version``, as in a rolling upgrade) hands over a
    handle the decode node refuses with a 400 naming ``kv_transfer_params``: a field the client never sent (the
    router owns it). The client gets its answer, decode-only, not that 400; the lease is released."""
    router, faults = proxied
    expired = expiries(cluster)
    body = completion_body(prompt(30), 8, stream=stream)
    counted = ['pdpool_router_requests_total{decision="%s"}' % d for d in ("disaggregated", "fallback", "retry")] + [
        'pdpool_router_%s_total{role="prefill"}' % m
        for m in ("prompt_tokens", "prefix_predicted_hit_tokens", "prefix_realized_hit_tokens")]
    # an earlier case's fault may have left a node in its cooldown (0.5 s): the router would then plan this one
    # decode-only, and no handle would be refused
    wait_for(lambda: router.value('pdpool_router_nodes{role="decode",usable="true"}') == 2
             and router.value('pdpool_router_nodes{role="prefill",usable="true"}') == 1, 30, "every node usable")
    before = {name: router.value(name) for name in counted}
    faults["prefill"].arm_rewrite(b'"pdpool_version": 2', b'"pdpool_version": 9')
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    faults["prefill"].disarm()
    want = cluster["d0"].complete({**body, "stream": False})
    assert check_outcome(r, want, stream) == "answered"
    settled(cluster, router, expired)
    # Counted as the fallback it is, once: no disaggregated decision, no retry (the same node's decode-only leg is
    # the fallback itself), and no prefill leg's (predicted, realized) hits for KV that served nothing.
    grew = {name: router.value(name) - before[name] for name in counted}
    assert grew == {name: 1 if "fallback" in name else 0 for name in counted}, grew
