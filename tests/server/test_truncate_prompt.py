"""vLLM's ``truncate_prompt_tokens``: only the prompt's last k tokens are the prompt (-1: the last max_model_len),
for text, ids and chats; bad values are a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

PROMPT = ("A long time ago the river ran through the middle of the town, and every morning the baker carried "
          "bread across the old stone bridge to the market on the other side.")


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": "demo", "temperature": 0, "max_tokens": 5,
                                                    "return_token_ids": True, **body},
                      headers=server.headers(), timeout=120)


@pytest.mark.parametrize("keep", [1, 7, 16])
def test_the_last_k_tokens_are_the_prompt(server, hf_reference, keep):
    ids = hf_reference.encode(PROMPT)
    cut = post(server, "/completions", prompt=PROMPT, truncate_prompt_tokens=keep, echo=True).json()
    alone = post(server, "/completions", prompt=ids[-keep:]).json()
    assert cut["usage"]["prompt_tokens"] == keep
    assert cut["choices"][0]["prompt_token_ids"] == ids[-keep:]
    assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    echoed = hf_reference.tokenizer.decode(ids[-keep:], skip_special_tokens=True)
    assert cut["choices"][0]["text"] == echoed + alone["choices"][0]["text"]   # echo: what was kept
    by_ids = post(server, "/completions", prompt=ids, truncate_prompt_tokens=keep).json()
    assert by_ids["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_longer_than_the_prompt_or_minus_one_keeps_it_whole(server, hf_reference):
    ids = hf_reference.encode(PROMPT)
    whole = post(server, "/completions", prompt=PROMPT).json()
    for keep in (len(ids), len(ids) + 5, -1):
        r = post(server, "/completions", prompt=PROMPT, truncate_prompt_tokens=keep).json()
        assert r["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"], keep
        assert r["usage"]["prompt_tokens"] == len(ids)


def test_chat_and_stream(server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
    full = post(server, "/chat/completions", messages=messages).json()
    cut = post(server, "/chat/completions", messages=messages, truncate_prompt_tokens=10).json()
    assert full["usage"]["prompt_tokens"] > 10 and cut["usage"]["prompt_tokens"] == 10
    assert cut["prompt_token_ids"] == full["prompt_token_ids"][-10:]
    with httpx.stream("POST", server.base_url + "/completions", headers=server.headers(), timeout=120,
                      json={"model": "demo", "prompt": PROMPT, "max_tokens": 3, "truncate_prompt_tokens": 5,
                            "stream": True, "stream_options": {"include_usage": True}}) as s:
        import json

        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("value", [0, -2, "3", 1.5, True, [4]])
def test_bad_values_are_a_400(server, value):
    r = post(server, "/completions", prompt=PROMPT, truncate_prompt_tokens=value)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_above_the_context_length_is_a_400(server):
    r = post(server, "/completions", prompt=PROMPT, truncate_prompt_tokens=server.max_model_len + 1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_streamed_echo_is_the_whole_answers_echo(server):
    """Streamed or not, echo gives the same prompt text: the body's own when nothing was cut (a long enough k),
    the kept ids' when the prompt was cut."""
    import json

    for keep in (3, 10_000 if server.max_model_len > 10_000 else server.max_model_len):
        body = {"prompt": PROMPT, "echo": True, "max_tokens": 2, "truncate_prompt_tokens": keep}
        whole = post(server, "/completions", **body).json()["choices"][0]["text"]
        with httpx.stream("POST", server.base_url + "/completions", headers=server.headers(), timeout=120,
                          json={"model": "demo", "temperature": 0, **body, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole, keep
