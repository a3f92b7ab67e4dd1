"""vLLM's ``/tokenize`` and ``/detokenize`` (``pdpool.server.tokenize``): the ids and text transformers gives for the
same tokenizer and chat template, any JSON body answered or refused with an OpenAI 4xx, and a real node serving
them (the router's are in ``tests/router/test_router_e2e.py``)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fuzz_strategies import json_values
from pdpool.server import tokenize
from pdpool.server.errors import APIError

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
SERVED = ["demo"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, add_special=st.booleans())
def test_prompt_ids_and_text_match_transformers(frontend, hf_tokenizer, text, add_special):
    got = tokenize.tokenize({"prompt": text, "add_special_tokens": add_special, "return_token_strs": True},
                            frontend, SERVED, 2048)
    want = hf_tokenizer(text, add_special_tokens=add_special)["input_ids"]
    assert got == {"count": len(want), "max_model_len": 2048, "tokens": want,
                   "token_strs": hf_tokenizer.convert_ids_to_tokens(want)}
    assert tokenize.detokenize({"tokens": want}, frontend, SERVED) == {"prompt": hf_tokenizer.decode(want)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                              "content": TEXT}), min_size=1, max_size=3),
       add_generation_prompt=st.booleans())
def test_chat_ids_match_transformers(frontend, hf_tokenizer, turns, add_generation_prompt):
    got = tokenize.tokenize({"messages": turns, "add_generation_prompt": add_generation_prompt}, frontend, SERVED,
                            None)
    want = hf_tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert got["tokens"] == hf_tokenizer(want, add_special_tokens=False)["input_ids"]
    assert got["token_strs"] is None and got["max_model_len"] is None


BODIES = st.one_of(
    st.fixed_dictionaries({}, optional={"prompt": st.one_of(TEXT, json_values()), "messages": json_values(),
                                        "model": st.one_of(st.sampled_from(["demo", "other"]), json_values()),
                                        "add_special_tokens": json_values(), "add_generation_prompt": json_values(),
                                        "continue_final_message": json_values(), "return_token_strs": json_values(),
                                        "tokens": st.one_of(st.lists(st.integers(-5, 60000), max_size=5),
                                                            json_values())}),
    st.dictionaries(st.text(max_size=8), json_values(), max_size=4))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
def test_any_body_is_answered_or_refused_with_a_4xx(frontend, body):
    for route in (lambda b: tokenize.tokenize(b, frontend, SERVED, 2048),
                  lambda b: tokenize.detokenize(b, frontend, SERVED)):
        try:
            answer = route(body)
        except APIError as err:
            assert 400 <= err.status < 500 and err.message
            continue
        json.dumps(answer)     # a JSON answer


def test_refusals_name_the_field(frontend):
    cases = [({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
             ({}, "prompt"), ({"prompt": 3}, "prompt"), ({"prompt": "a", "model": "gpt-9"}, "model"),
             ({"messages": []}, "messages"), ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens")]
    for body, param in cases:
        with pytest.raises(APIError) as err:
            tokenize.tokenize(body, frontend, SERVED, 2048)
        assert err.value.param == param, body
    for body in ({"tokens": [frontend.vocab_size]}, {"tokens": [-1]}, {"tokens": [1.5]}, {"tokens": "12"},
                 {"tokens": [True]}, {}):
        with pytest.raises(APIError) as err:
            tokenize.detokenize(body, frontend, SERVED)
        assert err.value.param == "tokens" and err.value.status == 400, body


def test_a_node_serves_them(server, hf_tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"model": "demo", "prompt": "Hello there, world"},
                   headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    ids = hf_tokenizer("Hello there, world")["input_ids"]
    assert r.json() == {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=server.headers(), timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": "Hello there, world"}
    r = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, headers=server.headers(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401   # API key
