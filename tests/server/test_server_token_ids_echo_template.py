"""vLLM's ``return_tokens_as_token_ids`` (and its server flag), chat's ``echo``, and a request's own
``chat_template`` (with ``--trust-request-chat-template``), through the official ``openai`` client where it can
send them (``extra_body``), whole and streamed; the shapes of vllm serve 0.32 (docs/openai_compat.md)."""

from __future__ import annotations

import re

import pytest

from test_return_token_ids import events, post
from test_server_errors import assert_error

CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"
TOKEN_NAME = re.compile(r"token_id:(\d+)")


@pytest.fixture(scope="module")
def flagged(launch_server):
    """A node with vLLM's two server flags these fields read."""
    srv = launch_server("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "64", "--max-num-seqs",
                        "4", "--return-tokens-as-token-ids")
    yield srv
    srv.stop()


def token_id(name: str) -> int:
    match = TOKEN_NAME.fullmatch(name)
    assert match, name
    return int(match.group(1))


# ---- return_tokens_as_token_ids -------------------------------------------------------------------

@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_name_token_ids(server, client, frontend, echo):
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                      echo=echo, extra_body={"return_token_ids": True})
    named = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                      echo=echo, extra_body={"return_token_ids": True,
                                                             "return_tokens_as_token_ids": True})
    a, b = plain.choices[0], named.choices[0]
    assert b.text == a.text
    assert b.logprobs.token_logprobs == pytest.approx(a.logprobs.token_logprobs, abs=1e-3)   # batch-mates differ
    ids = ([*a.prompt_token_ids] if echo else []) + [*a.token_ids]
    assert [token_id(t) for t in b.logprobs.tokens] == ids
    assert [frontend.tokenizer.decode([t]) for t in ids] == a.logprobs.tokens
    assert b.logprobs.text_offset == a.logprobs.text_offset   # offsets in the text, which is the same
    for top_a, top_b, t, lp in zip(a.logprobs.top_logprobs, b.logprobs.top_logprobs, ids, b.logprobs.token_logprobs,
                                   strict=True):
        if top_a is None:
            assert top_b is None and lp is None   # the echoed prompt's first token
            continue
        assert top_b[f"token_id:{t}"] == lp and all(TOKEN_NAME.fullmatch(k) for k in top_b)
        assert len(top_b) >= len(top_a)   # two ids that decode alike are one text key, two id keys


def test_chat_logprobs_name_token_ids_bytes_as_vllm(client, frontend):
    kwargs = dict(model="demo", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    named = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True,
                                                                 "return_tokens_as_token_ids": True})
    ids = plain.choices[0].token_ids
    for a, b, t in zip(plain.choices[0].logprobs.content, named.choices[0].logprobs.content, ids, strict=True):
        assert b.token == f"token_id:{t}" and b.logprob == pytest.approx(a.logprob, abs=1e-3)
        assert b.bytes == a.bytes == list(frontend.tokenizer.decode([t]).encode())   # the text's, as vLLM's
        assert [x.logprob for x in b.top_logprobs] == pytest.approx([x.logprob for x in a.top_logprobs], abs=1e-3)
        assert [frontend.tokenizer.decode([token_id(x.token)]) for x in b.top_logprobs] == \
            [x.token for x in a.top_logprobs]
        for x in b.top_logprobs:   # a top entry's bytes are its name's, as vLLM's
            assert x.bytes == list(x.token.encode())


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": PROMPT, "logprobs": 1, "echo": True}),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 1}),
])
def test_streamed_names_match_the_whole_answer(server, path, body):
    body = {"model": "demo", "max_tokens": 5, "temperature": 0, "return_tokens_as_token_ids": True, **body}
    whole = post(server, path, body).json()["choices"][0]["logprobs"]
    streamed = [c["choices"][0]["logprobs"] for c in events(server, path, {**body, "stream": True})
                if c["choices"] and c["choices"][0].get("logprobs")]
    if path == "completions":
        assert [t for lp in streamed for t in lp["tokens"]] == whole["tokens"]
        assert [k for lp in streamed for top in lp["top_logprobs"] for k in (top or {})] == \
            [k for top in whole["top_logprobs"] for k in (top or {})]
    else:
        assert [e for lp in streamed for e in lp["content"]] == whole["content"]
    assert all(TOKEN_NAME.fullmatch(t) for t in (whole["tokens"] if path == "completions"
                                                  else [e["token"] for e in whole["content"]]))


def test_the_server_flag_is_the_default_a_request_overrides(flagged):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1}
    by_flag = post(flagged, "completions", body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(TOKEN_NAME.fullmatch(t) for t in by_flag)
    as_text = post(flagged, "completions", {**body, "return_tokens_as_token_ids": False}).json()
    assert not any(TOKEN_NAME.fullmatch(t) for t in as_text["choices"][0]["logprobs"]["tokens"])


def test_return_tokens_as_token_ids_must_be_a_boolean(server):
    r = post(server, "completions", {"model": "demo", "prompt": PROMPT, "return_tokens_as_token_ids": "yes"})
    assert_error(r, 400, param="return_tokens_as_token_ids")
