"""Response fields a client written for vLLM reads, where pdpool answered differently from ``vllm serve`` 0.32 on
the same model (found by benchmarks/vllm_response_diff.py; docs/openai_compat.md lists what still differs and why):
``system_fingerprint``, ``stop_reason`` on every streamed completion choice, ``delta.content`` on every streamed chat
choice (the last one too, when a stop string leaves it empty)."""

from __future__ import annotations

import json

import httpx

GREEDY = {"model": "demo", "temperature": 0}
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json={**GREEDY, **body, "stream": True},
                      headers=server.headers(), timeout=300) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_system_fingerprint_names_the_server_and_stays_put(client):
    a = client.completions.create(prompt="The sky is", max_tokens=2, **GREEDY)
    b = client.chat.completions.create(messages=CHAT, max_tokens=2, **GREEDY)
    assert a.system_fingerprint.startswith("pdpool-") and a.system_fingerprint == b.system_fingerprint


def test_streamed_fingerprint_on_each_last_chunk_or_the_usage_chunk(server):
    """vLLM's places: each choice's last chunk; with include_usage, the usage chunk alone. Here each choice's last
    chunk has it with include_usage too (a router asks for the usage chunk and hides it from a client that did
    not: the client would otherwise get none; tests/router/test_router_differential.py found that)."""
    for path, body in (("/completions", {"prompt": "The sky is", "n": 2}), ("/chat/completions", {"messages": CHAT})):
        for usage in (False, True):
            chunks = stream_chunks(server, path, {**body, "max_tokens": 3,
                                                  "stream_options": {"include_usage": usage}})
            finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert len(finishing) == body.get("n", 1)
            marked = [c for c in chunks if "system_fingerprint" in c]
            assert marked == (finishing + [chunks[-1]] if usage else finishing)
            assert all(c["system_fingerprint"].startswith("pdpool-") for c in marked)
            assert (chunks[-1]["choices"] == []) == usage


def test_every_streamed_completion_choice_has_stop_reason(server):
    for extra in ({}, {"echo": True}, {"stop": [" "]}):
        chunks = stream_chunks(server, "/completions", {"prompt": "The capital of France is", "max_tokens": 8, **extra})
        choices = [ch for c in chunks for ch in c["choices"]]
        assert choices and all("stop_reason" in ch for ch in choices), choices
        assert all(ch["stop_reason"] is None for ch in choices[:-1])
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == " "


def test_the_last_streamed_chat_delta_has_content_after_a_stop_string(server):
    chunks = stream_chunks(server, "/chat/completions", {"messages": CHAT, "max_tokens": 32, "stop": ["."]})
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "."
    assert last["delta"] == {"content": ""}
    assert all("content" in c["choices"][0]["delta"] for c in chunks)


def test_the_openai_client_reads_the_stream_to_the_end(client):
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=CHAT, max_tokens=32, stop=["."], stream=True, **GREEDY))
    assert text and "." not in text
