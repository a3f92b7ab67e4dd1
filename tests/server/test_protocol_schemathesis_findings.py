"""Request-body rules (most of them found by schemathesis) broken against the nodes' and the router's /openapi.json (each test fails
on the code before the fix): the parser itself, no server."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from pdpool.server import json_body, protocol
from pdpool.server.errors import APIError

NAMES = ["demo"]


def render(messages, add_generation_prompt, continue_final_message, tools=None, chat_template=None,
           template_kwargs=None):
    return "".join(m["content"] for m in messages) or "x"


def test_integral_json_numbers_are_integers():
    """JSON Schema's integer (and vLLM's lax parsing) takes 350.0: a token-id list may carry it."""
    body = json_body.read_json_body(b'{"prompt": [350.0, 7171, 2838.0], "max_tokens": 2.0, "temperature": 1.0}')
    assert body["prompt"] == [350, 7171, 2838] and all(type(t) is int for t in body["prompt"])
    req = protocol.parse_completion(body, NAMES)
    assert req.prompts == [[350, 7171, 2838]]
    assert req.params.temperature == 1.0 and type(req.params.temperature) is float
    assert json_body.read_json_body(b'{"x": 1.5, "y": -0.0, "z": 1e3}') == {"x": 1.5, "y": 0, "z": 1000}
    with pytest.raises(APIError):
        json_body.read_json_body(b'{"x": 1e400}')


@pytest.mark.parametrize("value", ["x", 0, -3, True, [1]])
def test_chat_max_tokens_is_checked_even_beside_max_completion_tokens(value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "max_tokens": value}
    with pytest.raises(APIError) as err:
        protocol.parse_chat(body, NAMES, render)
    assert err.value.param == "max_tokens"
    ok = protocol.parse_chat({**body, "max_tokens": 9}, NAMES, render)
    assert ok.params.max_tokens == 2     # the new name wins


@pytest.mark.parametrize("value", [{}, 0, False, 3, {"a": 1}])
def test_bad_words_of_another_type_is_a_400(value):
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": "hi", "bad_words": value}, NAMES)
    assert err.value.param == "bad_words"


@pytest.mark.parametrize("value", [None, [], "", "word", ["a", "b"]])
def test_bad_words_null_empty_a_word_or_a_list(value):
    req = protocol.parse_completion({"prompt": "hi", "bad_words": value}, NAMES)
    assert req.params.bad_words == (None if not value else [value] if isinstance(value, str) else value)


@pytest.mark.parametrize("value", [["\ud800"], "a\udfffb", ["ok", "\ud800"]])
def test_bad_words_with_an_unpaired_surrogate_is_a_400(value):
    """Found by the node fuzzer (a 500: the tokenizer cannot take the word), not by schemathesis."""
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"model": "demo", "prompt": "x", "bad_words": value}, NAMES)
    assert err.value.param == "bad_words"


@given(st.text(alphabet=st.sampled_from(["a", "é", "@", "/", "\\", "\x00", "-"]), max_size=140))
def test_cache_salt_follows_vllms_rule(salt):
    """vLLM (0.32) refuses an empty salt, one over 128 characters, and one holding '@', '/', '\\' or NUL, with a 400
    naming cache_salt; pdpool took them all."""
    body = {"prompt": "hi", "cache_salt": salt}
    ok = 1 <= len(salt) <= 128 and not set(salt) & set("@/\\\x00")
    if ok:
        assert protocol.parse_completion(body, NAMES).cache_salt == salt
    else:
        with pytest.raises(APIError) as info:
            protocol.parse_completion(body, NAMES)
        assert info.value.param == "cache_salt"
