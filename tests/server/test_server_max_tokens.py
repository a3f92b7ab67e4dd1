"""``max_tokens`` as vLLM 0.32 reads it (checked against ``vllm serve`` by benchmarks/vllm_response_diff.py): a
completion gets 16 tokens when the field is absent or null; a chat gets the rest of the context when it is absent or
null (``max_completion_tokens`` too); any budget is capped at what the context leaves after the prompt, where the
choice ends with ``finish_reason`` "length" (not a 400). A 400 only when ``max_tokens`` alone exceeds the context,
or the prompt leaves no room. Prompts near ``max_model_len`` keep "the rest of the context" short, and tell it apart
from 16."""

from __future__ import annotations

import json

import httpx
import pytest

LEFT = 22   # tokens of context a prompt leaves


def post(server, path: str, status: int = 200, **body) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json={"model": "demo", "temperature": 0, "ignore_eos": True, **body},
                   headers=server.headers(), timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def near_full_prompt(server) -> list[int]:
    return [100 + i % 50 for i in range(server.max_model_len - LEFT)]


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}])
def test_completion_max_tokens_absent_or_null_is_16(server, fields):
    prompt_ids = near_full_prompt(server)
    usage = post(server, "/completions", prompt=prompt_ids, **fields)["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == 16


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}, {"max_completion_tokens": None}])
def test_chat_max_tokens_absent_or_null_is_the_rest(server, fields):
    text = "hi " * (server.max_model_len - 4 * LEFT)
    usage = post(server, "/chat/completions", messages=[{"role": "user", "content": text}], **fields)["usage"]
    assert 16 < server.max_model_len - usage["prompt_tokens"] < 100
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server.max_model_len


@pytest.mark.parametrize("stream", [False, True])
def test_completion_max_tokens_past_the_context_is_capped_with_length(server, stream):
    prompt_ids = near_full_prompt(server)
    if not stream:
        answer = post(server, "/completions", prompt=prompt_ids, max_tokens=100)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == LEFT
        return
    body = {"model": "demo", "prompt": prompt_ids, "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=server.headers(),
                      timeout=300) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == LEFT
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_chat_max_tokens_past_the_context_is_capped_with_length(server):
    text = "hi " * (server.max_model_len - 4 * LEFT)
    answer = post(server, "/chat/completions", messages=[{"role": "user", "content": text}], max_tokens=500)
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server.max_model_len
    assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body", [("/completions", {"prompt": "hi"}),
                                        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_max_tokens_above_the_context_is_400(server, path, body):
    err = post(server, path, 400, max_tokens=server.max_model_len + 1, **body)["error"]
    assert err["param"] == "max_tokens" and "maximum context length" in err["message"]


def test_prompt_filling_the_context_is_400(server):
    err = post(server, "/completions", 400, prompt=[100] * server.max_model_len, max_tokens=1)["error"]
    assert err["param"] == "prompt" and str(server.max_model_len) in err["message"]
