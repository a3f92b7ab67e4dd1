"""vLLM's ``return_token_ids``: where the prompt's and the output's token ids go, whole and streamed.

Whole answers: each choice has its ``token_ids`` (and its ``prompt_token_ids``); a chat answer also has the
prompt's ids at its top level, where vLLM puts them. Streams: the prompt's ids come once per choice, in its first
chunk (the chunk's top level for chat, the choice for completions), and every chunk carries its new ids, so that
their concatenation is the whole answer's."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "Name three colors."}]}
COMPLETION = {"prompt": "The capital of France is"}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, headers=server.headers(), timeout=120)


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/{path}", json=body, headers=server.headers(), timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path, prompt, n, echo", [
    ("chat/completions", CHAT, 1, False), ("chat/completions", CHAT, 2, False),
    ("completions", COMPLETION, 1, False), ("completions", COMPLETION, 2, False), ("completions", COMPLETION, 2, True),
])
def test_token_ids_whole_and_streamed(server, path, prompt, n, echo):
    body = {"model": "demo", "max_tokens": 5, "temperature": 0, "n": n, "return_token_ids": True, **prompt}
    if echo:
        body["echo"] = True
    whole = post(server, path, body)
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    prompt_ids = whole["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) == whole["usage"]["prompt_tokens"]
    assert sum(len(c["token_ids"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"]
    if path == "chat/completions":
        assert whole["prompt_token_ids"] == prompt_ids
    chunks = events(server, path, {**body, "stream": True})
    streamed: dict[int, list[int]] = {c["index"]: [] for c in whole["choices"]}
    prompt_seen: dict[int, int] = {i: 0 for i in streamed}
    for ev in chunks:
        if path == "chat/completions" and "prompt_token_ids" in ev:
            assert ev["prompt_token_ids"] == prompt_ids and len(ev["choices"]) == 1
            prompt_seen[ev["choices"][0]["index"]] += 1
            assert not streamed[ev["choices"][0]["index"]]         # before the choice's first token
        for choice in ev["choices"]:
            if "prompt_token_ids" in choice:
                assert choice["prompt_token_ids"] == prompt_ids
                prompt_seen[choice["index"]] += 1
                assert not streamed[choice["index"]]
            streamed[choice["index"]] += choice.get("token_ids") or []
    assert prompt_seen == {i: 1 for i in streamed}
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}   # greedy: the same tokens
