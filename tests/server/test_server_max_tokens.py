"""Absent and null ``max_tokens``, as vLLM reads them: a completion gets 16 tokens when the field is absent and the
rest of the context when it is null; a chat gets the rest of the context either way (``max_completion_tokens``
too). Prompts near ``max_model_len`` keep "the rest of the context" short, and tell it apart from 16."""

from __future__ import annotations

import httpx
import pytest

LEFT = 22   # tokens of context a prompt leaves


def post(server, path: str, **body) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json={"model": "demo", "temperature": 0, "ignore_eos": True, **body},
                   headers=server.headers(), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("fields, rest_of_context", [({}, False), ({"max_tokens": None}, True)])
def test_completion_max_tokens_absent_is_16_null_is_the_rest(server, fields, rest_of_context):
    prompt_ids = [100 + i % 50 for i in range(server.max_model_len - LEFT)]
    usage = post(server, "/completions", prompt=prompt_ids, **fields)["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == (LEFT if rest_of_context else 16)


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}, {"max_completion_tokens": None}])
def test_chat_max_tokens_absent_or_null_is_the_rest(server, fields):
    text = "hi " * (server.max_model_len - 4 * LEFT)
    usage = post(server, "/chat/completions", messages=[{"role": "user", "content": text}], **fields)["usage"]
    assert 16 < server.max_model_len - usage["prompt_tokens"] < 100
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server.max_model_len
