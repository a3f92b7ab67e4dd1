"""Requests that `pdpool serve` answered otherwise than `vllm serve` 0.32 on the same model, found by
benchmarks/vllm_api_diff.py (docs/openai_compat.md lists what still differs and why). None needs vLLM here."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpool.server import openapi, protocol, tokenize
from pdpool.server.errors import APIError

ROLES = ("system", "developer", "user", "assistant")
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12)


def node_tokens(server, messages: list[dict]) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": "demo", "messages": messages},
                   headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_developer_messages_render_as_system_ones_when_the_template_lacks_the_role(server):
    """OpenAI's ``developer`` role (what newer clients send for instructions): vLLM renders it as ``system`` for a
    template that does not name it (the demo model's), merging the system messages into one at the start when one
    is not first. pdpool passed ``<|im_start|>developer`` to the model, after the template's default system prompt."""
    user = {"role": "user", "content": "hi"}
    assert node_tokens(server, [{"role": "developer", "content": "be terse"}, user]) == \
        node_tokens(server, [{"role": "system", "content": "be terse"}, user])
    assert node_tokens(server, [user, {"role": "developer", "content": "be terse"}]) == \
        node_tokens(server, [{"role": "system", "content": "be terse"}, user])
    assert node_tokens(server, [{"role": "system", "content": "a"}, {"role": "developer", "content": "b"}, user]) == \
        node_tokens(server, [{"role": "system", "content": "a\n\nb"}, user])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ROLES), TEXT), min_size=1, max_size=6))
def test_a_template_without_the_developer_role_never_sees_it_and_loses_no_message(frontend, turns):
    messages = [{"role": role, "content": text} for role, text in turns]
    prompt = frontend.render_chat(messages)
    assert "<|im_start|>developer" not in prompt
    merged = any(role == "developer" for role, _ in turns)   # else the system messages stay where they are
    at = 0
    for role, text in turns:   # every other message in order; with a developer one, each instruction up front
        if role not in ("system", "developer"):
            at = prompt.index(f"<|im_start|>{role}\n{text}<|im_end|>", at) + 1
        elif merged:
            assert text in prompt[:prompt.index("<|im_end|>")]


def test_a_template_that_names_the_developer_role_gets_it(frontend):
    template = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}<{{ m.role }}>{{ m.content }}"
                "{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "developer", "content": "be terse"}]
    assert frontend.render_chat(messages, chat_template=template) == "<user>hi[dev]<developer>be terse"


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool", "robot"])
def test_null_content_is_refused_outside_an_assistant_message(role):
    """vLLM 0.32 (and OpenAI) refuse ``content: null`` but in an assistant message (one that only calls tools);
    pdpool read it as "" and answered."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}, {"role": role, "content": None}]}
    with pytest.raises(APIError) as err:
        protocol.parse_chat(body, ["demo"], lambda messages, *flags: "prompt")
    assert err.value.status == 400 and err.value.param == "messages" and "messages[1]" in err.value.message


def test_null_or_absent_content_is_taken_where_vllm_takes_it():
    for message in ({"role": "assistant", "content": None}, {"role": "user"}, {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}):
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}, message]}
        assert protocol.parse_chat(body, ["demo"], lambda messages, *flags: "prompt").prompts == ["prompt"]


def test_an_empty_model_name_is_the_served_model(frontend):
    """vLLM 0.32 takes ``"model": ""`` as it takes null or absent (some clients send an empty name); pdpool answered
    404 model_not_found. Another name is still a 404."""
    names = ["demo", "alias"]
    assert protocol.parse_completion({"model": "", "prompt": "hi"}, names).model == "demo"
    assert protocol.parse_chat({"model": "", "messages": [{"role": "user", "content": "hi"}]}, names,
                               lambda messages, *flags: "prompt").model == "demo"
    assert tokenize.tokenize({"model": "", "prompt": "hi"}, frontend, names, None)["tokens"]
    for call in (lambda: protocol.parse_completion({"model": "nope", "prompt": "hi"}, names),
                 lambda: tokenize.tokenize({"model": " ", "prompt": "hi"}, frontend, names, None)):
        with pytest.raises(APIError) as err:
            call()
        assert err.value.status == 404 and err.value.code == "model_not_found"
    spec = openapi.spec([("POST", "/v1/completions"), ("POST", "/v1/messages")], title="t", served_model_names=names,
                        api_key=False)
    model = {path: spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
             ["model"]["enum"] for path in ("/v1/completions", "/v1/messages")}
    assert "" in model["/v1/completions"] and "" not in model["/v1/messages"]   # Anthropic's API names its model
