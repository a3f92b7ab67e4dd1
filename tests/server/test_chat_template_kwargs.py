"""``chat_template_kwargs``: more variables for the chat template, as vLLM 0.32 takes them. Only the variables the
template reads are passed; the messages, the tools and the two flags stay the request's own fields; the keys
``chat_template`` and ``tokenize`` are refused by name. Checked on a trusting node (a request's template that reads
a variable) and on the default node (the model's template, which reads none of these)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

CHAT = [{"role": "user", "content": "Name three colors."}]
THINKING = ("{% if enable_thinking %}<think>{% endif %}{% if style %}[{{ style }}]{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


def tokenize(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/tokenize", json={"model": "demo", "messages": CHAT, **body},
                      headers=server.headers(), timeout=60)


def rendered(server, body: dict) -> str:
    r = tokenize(server, body)
    assert r.status_code == 200, r.text
    return httpx.post(server.url + "/detokenize", json={"model": "demo", "tokens": r.json()["tokens"]},
                      headers=server.headers(), timeout=60).json()["prompt"]


def test_the_variables_a_template_reads_are_passed(permissive_server):
    plain = "<user>Name three colors.<a>"
    assert rendered(permissive_server, {"chat_template": THINKING}) == plain
    assert rendered(permissive_server, {"chat_template": THINKING,
                                        "chat_template_kwargs": {"enable_thinking": True, "style": "terse"}}) \
        == "<think>[terse]" + plain
    # Variables the template does not read change nothing; the request's own fields win over kwargs of their names.
    assert rendered(permissive_server, {"chat_template": THINKING, "chat_template_kwargs": {
        "unread": 1, "add_generation_prompt": False, "messages": [{"role": "x", "content": "y"}]}}) == plain


def test_a_chat_answer_uses_the_kwargs(permissive_server):
    client = permissive_server.client()
    kwargs = {"chat_template": THINKING, "chat_template_kwargs": {"enable_thinking": True}, "return_token_ids": True}
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3, temperature=0,
                                          extra_body=kwargs)
    assert chat.prompt_token_ids == tokenize(permissive_server, kwargs).json()["tokens"]
    same = client.completions.create(model="demo", prompt=chat.prompt_token_ids, max_tokens=3, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text


def test_the_models_template_ignores_what_it_does_not_read(server):
    own = tokenize(server, {}).json()["tokens"]
    assert tokenize(server, {"chat_template_kwargs": {"enable_thinking": False, "x": [1, {}]}}).json()["tokens"] \
        == own
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(), timeout=60,
                   json={"model": "demo", "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kwargs", [{"chat_template": "{{ 1 }}"}, {"tokenize": True}, [], "x", 5,
                                    {"chat_template": 5}])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_refused_by_name(server, path, kwargs):
    r = httpx.post(server.url + path, headers=server.headers(), timeout=60,
                   json={"model": "demo", "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_a_template_in_the_kwargs_is_the_requests_template_where_trusted(permissive_server):
    """vLLM's older way, still taken (on a trusting server): chat_template inside chat_template_kwargs renders as
    the request's chat_template, which wins when both are given."""
    other = "{% for m in messages %}{{ m.content }}!{% endfor %}"
    assert rendered(permissive_server, {"chat_template_kwargs": {"chat_template": THINKING, "style": "s"}}) \
        == rendered(permissive_server, {"chat_template": THINKING, "chat_template_kwargs": {"style": "s"}}) \
        == "[s]<user>Name three colors.<a>"
    assert rendered(permissive_server, {"chat_template": other, "chat_template_kwargs": {"chat_template": THINKING}}) \
        == "Name three colors.!"
    r = tokenize(permissive_server, {"chat_template_kwargs": {"chat_template": ["x"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=st.one_of(JSON, st.dictionaries(st.sampled_from(["enable_thinking", "style", "messages", "tools",
                                                               "add_generation_prompt", "bos_token", "tokenize",
                                                               "documents", "x"]), JSON, max_size=4)))
def test_any_kwargs_are_rendered_or_refused_by_name(permissive_server, kwargs):
    r = tokenize(permissive_server, {"chat_template": THINKING, "chat_template_kwargs": kwargs})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] in ("chat_template_kwargs", "chat_template", "messages"), r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_surrogate_from_a_template_variable_is_a_400(permissive_server, path):
    """JSON's \\ud800 escape passes the messages' checks inside a template variable: the rendered prompt is
    checked too (it was a 500, found by the fuzzer)."""
    body = {"model": "demo", "messages": CHAT, "max_tokens": 1, "chat_template": "{{ x }}{{ messages[0].content }}",
            "chat_template_kwargs": {"x": "\ud800"}}
    r = httpx.post(permissive_server.url + path, content=json.dumps(body).encode(), timeout=60,
                   headers={**permissive_server.headers(), "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"
