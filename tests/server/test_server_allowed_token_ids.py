"""vLLM's ``allowed_token_ids`` and ``bad_words`` through a node with the official openai client: both endpoints,
streamed and not; bad values are a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

ALLOWED = [28, 260, 314]


def test_completions_and_chat_generate_only_allowed_ids(client):
    extra = {"allowed_token_ids": ALLOWED, "return_token_ids": True, "ignore_eos": True}
    r = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=5, temperature=0.8,
                                  seed=1, extra_body=extra)
    assert set(r.choices[0].model_extra["token_ids"]) <= set(ALLOWED) and len(r.choices[0].model_extra["token_ids"]) == 5
    chunks = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True, extra_body=extra)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert ids and set(ids) <= set(ALLOWED)


@pytest.mark.parametrize("bad", [[], [10**9], [-1], ["28"], [1.5], "28", {"28": 1}, True])
def test_bad_values_are_a_400(server, bad):
    r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                   json={"model": "demo", "prompt": "hi", "max_tokens": 2, "allowed_token_ids": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_bad_words_through_a_node(client, server):
    """vLLM's bad_words: the word greedy decoding writes first is never written."""
    plain = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=6, temperature=0)
    word = plain.choices[0].text.split()[0]
    banned = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=6,
                                       temperature=0, extra_body={"bad_words": [word]})
    assert banned.choices[0].text.split()[:1] != [word]
    for bad in ([5], [None], [""], ["   "], 7):
        r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                       json={"model": "demo", "prompt": "hi", "max_tokens": 2, "bad_words": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", (bad, r.text)


def test_only_stop_tokens_allowed_under_min_tokens_is_a_400(server, frontend):
    """Nothing could be sampled before min_tokens is met, or every allowed id is a banned word: the client's own
    contradiction, a 400 (it was a 500: the request failed while generating)."""
    word = frontend.tokenizer.decode([28])
    r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                   json={"model": "demo", "prompt": "hi", "max_tokens": 3, "allowed_token_ids": [28],
                         "bad_words": [word]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    for extra in ({"stop_token_ids": [28]}, {}):
        allowed = [28] if extra else [2]   # the demo model's EOS, <|im_end|>
        r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                       json={"model": "demo", "prompt": "hi", "max_tokens": 3, "min_tokens": 2,
                             "allowed_token_ids": allowed, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    banned = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                        json={"model": "demo", "prompt": "hi", "max_tokens": 3, "allowed_token_ids": [28],
                              "bad_words": ["x"], "return_token_ids": True})
    assert banned.status_code == 200, banned.text           # "x" is not token 28: allowed
    ok = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                    json={"model": "demo", "prompt": "hi", "max_tokens": 3, "min_tokens": 2, "ignore_eos": True,
                          "allowed_token_ids": [2]})
    assert ok.status_code == 200, ok.text
