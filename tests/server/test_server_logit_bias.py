"""``logit_bias`` through the OpenAI surface: any JSON value parses into params or is a 400 naming it, and the
official ``openai`` client gets biased answers on both endpoints, streamed or not."""

from __future__ import annotations

import re

import openai
import pytest
from hypothesis import given, settings, strategies as st

from fuzz_strategies import LOGIT_BIASES, json_values
from pdpool.server.errors import APIError
from pdpool.server.protocol import parse_chat, parse_completion

NAMES = ["demo"]
CHAT = [{"role": "user", "content": "Name three colors."}]
FORCED = 1234  # a token the demo model does not pick for these prompts unbiased


def _ids(choice) -> list[int]:
    """vLLM's ``token_ids`` of a choice (``return_token_ids``), an extra field to the ``openai`` client."""
    return (choice.model_extra or {}).get("token_ids") or []


def _render(messages, add_generation_prompt, continue_final_message, tools=None, chat_template=None,
            template_kwargs=None) -> str:
    return "".join(m["content"] for m in messages)


@settings(max_examples=400, deadline=None)
@given(bias=st.one_of(LOGIT_BIASES, json_values(), st.dictionaries(st.integers(-5, 10**6), json_values(),
                                                                    max_size=3)),
       kind=st.sampled_from(["completion", "chat"]))
def test_any_logit_bias_parses_or_is_a_400_naming_it(bias, kind):
    body = {"model": "demo", "max_tokens": 2, "logit_bias": bias}
    want = _expected(bias)
    try:
        if kind == "completion":
            req = parse_completion({**body, "prompt": "hi"}, NAMES)
        else:
            req = parse_chat({**body, "messages": CHAT}, NAMES, _render)
    except APIError as exc:
        assert exc.status == 400 and exc.param == "logit_bias", (exc.status, exc.param, str(exc))
        assert want is INVALID, f"refused a valid logit_bias: {exc}"
        return
    assert want is not INVALID, f"accepted {bias!r} as {req.params.logit_bias!r}"
    assert req.params.logit_bias == want
    assert all(type(v) is float for v in (want or {}).values())


INVALID = object()


def _expected(bias):
    """The oracle: ``{id: clamped bias}``, None for no bias, ``INVALID`` for a 400 (vLLM's rules, written out)."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        return INVALID
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and re.fullmatch(r"[+-]?[0-9]{1,19}", key):  # ASCII decimal, as vLLM's int(key)
            token = int(key)
        elif type(key) is int:
            token = key
        else:
            return INVALID
        if token < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
                or value in (float("inf"), float("-inf")):
            return INVALID
        out[token] = float(max(-100, min(100, value)))
    return out


def test_the_openai_client_gets_biased_answers(client):
    free = client.completions.create(model="demo", prompt="The sky is", max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    assert FORCED not in _ids(free.choices[0])
    bias = {str(FORCED): 100}
    done = client.completions.create(model="demo", prompt="The sky is", max_tokens=4, temperature=0,
                                     logit_bias=bias, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert _ids(done.choices[0]) == [FORCED] * 4
    streamed = [t for c in client.completions.create(model="demo", prompt="The sky is", max_tokens=4,
                                                     temperature=0, logit_bias=bias, stream=True,
                                                     extra_body={"return_token_ids": True, "ignore_eos": True})
                if c.choices for t in _ids(c.choices[0])]
    assert streamed == [FORCED] * 4
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4, temperature=0,
                                          logit_bias=bias, extra_body={"return_token_ids": True,
                                                                       "ignore_eos": True})
    assert _ids(chat.choices[0]) == [FORCED] * 4
    chunks = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4, temperature=0,
                                            logit_bias=bias, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [t for c in chunks if c.choices for t in _ids(c.choices[0])] == [FORCED] * 4


def test_a_banned_token_is_never_generated(client):
    kw = dict(model="demo", messages=CHAT, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    free = _ids(client.chat.completions.create(**kw).choices[0])
    banned = _ids(client.chat.completions.create(**kw, logit_bias={str(free[0]): -100}).choices[0])
    assert banned != free and free[0] not in banned


@pytest.mark.parametrize("bias, why", [({"49152": 1}, "vocab size"), ({"-1": 1}, "token ids must be in"),
                                       ({"x": 1}, "integers"), ({"1": True}, "must be a number"),
                                       ({"1": "2"}, "must be a number"), ([1, 2], "must be an object"),
                                       ({"1": None}, "must be a number")])
def test_bad_logit_bias_is_a_400_naming_it_and_why(client, bias, why):
    for create in (lambda: client.completions.create(model="demo", prompt="hi", max_tokens=2, logit_bias=bias),
                   lambda: client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2,
                                                          logit_bias=bias)):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        assert err.value.body["param"] == "logit_bias", err.value.body
        assert re.search(why, err.value.body["message"]), err.value.body
