"""A prompt of many megabytes is tokenized off the node's event loop: the node keeps answering others meanwhile.

Tokenizing 16 MB of text takes several seconds here. It used to run on the event loop, holding the GIL, so every
stream and /health stalled for that long (an HTTP-level red-team pass measured 10 s for 20 MB; a liveness probe
would fail on a 64 MiB body)."""

from __future__ import annotations

import threading
import time

import httpx

BIG = "The quick brown fox jumps over the lazy dog, again and again. " * 260_000   # about 16 MB


def _gaps_while(server, send) -> tuple[float, object]:
    """The longest /health round trip while ``send()`` runs, and what ``send`` returned."""
    result, done = {}, threading.Event()

    def run():
        try:
            result["reply"] = send()
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    longest = 0.0
    with httpx.Client(base_url=server.url, timeout=60) as client:
        while not done.is_set():
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            longest = max(longest, time.perf_counter() - t0)
            time.sleep(0.05)
    worker.join()
    return longest, result["reply"]


def test_a_huge_prompt_does_not_stall_the_node(server):
    def send():
        return httpx.post(server.url + "/v1/completions", timeout=300,
                          json={"model": "demo", "prompt": BIG, "max_tokens": 1}, headers=server.headers())

    longest, reply = _gaps_while(server, send)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text[:300]
    assert "maximum context length" in reply.json()["error"]["message"]
    assert longest < 2.0, f"/health took {longest:.2f} s while the prompt was tokenized"


def test_a_huge_text_to_tokenize_does_not_stall_the_node(server):
    def send():
        return httpx.post(server.url + "/tokenize", timeout=300, json={"model": "demo", "prompt": BIG[:12_000_000]},
                          headers=server.headers())

    longest, reply = _gaps_while(server, send)
    assert reply.status_code == 200 and reply.json()["count"] > 2_400_000
    assert longest < 2.0, f"/health took {longest:.2f} s while /tokenize ran"
