"""vLLM's ``return_tokens_as_token_ids`` (and its server flag), chat's ``echo``, and a request's own
``chat_template`` (with ``--trust-request-chat-template``), through the official ``openai`` client where it can
send them (``extra_body``), whole and streamed; the shapes of vllm serve 0.32 (docs/openai_compat.md). The server
flags' tests run on the package's ``permissive_server``, which has both flags."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_return_token_ids import events, post
from test_server_errors import assert_error

CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"
TOKEN_NAME = re.compile(r"token_id:(\d+)")


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


def test_the_server_flag_is_the_default_a_request_overrides(permissive_server):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1}
    by_flag = post(permissive_server, "completions", body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(TOKEN_NAME.fullmatch(t) for t in by_flag)
    as_text = post(permissive_server, "completions", {**body, "return_tokens_as_token_ids": False}).json()
    assert not any(TOKEN_NAME.fullmatch(t) for t in as_text["choices"][0]["logprobs"]["tokens"])


def test_return_tokens_as_token_ids_must_be_a_boolean(server):
    r = post(server, "completions", {"model": "demo", "prompt": PROMPT, "return_tokens_as_token_ids": "yes"})
    assert_error(r, 400, param="return_tokens_as_token_ids")


# ---- chat echo ------------------------------------------------------------------------------------

PARTIAL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]


def chat_text(server, body: dict) -> tuple[list[str], list[dict]]:
    """Each choice's content, whole; and the stream's chunks of the same body."""
    whole = post(server, "chat/completions", body)
    assert whole.status_code == 200, whole.text
    return [c["message"]["content"] for c in whole.json()["choices"]], events(server, "chat/completions",
                                                                              {**body, "stream": True})


@pytest.mark.parametrize("extra", [{}, {"add_generation_prompt": False, "continue_final_message": True}])
def test_chat_echo_prepends_the_assistant_message(server, extra):
    body = {"model": "demo", "messages": PARTIAL, "max_tokens": 4, "temperature": 0, **extra}
    plain = post(server, "chat/completions", body).json()["choices"][0]["message"]["content"]
    texts, chunks = chat_text(server, {**body, "echo": True})
    assert texts == [PARTIAL[-1]["content"] + plain]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": PARTIAL[-1]["content"]}   # the echo's own chunk, right after the role's
    assert "".join(d.get("content") or "" for d in deltas) == texts[0]


def test_chat_echo_with_n_and_usage(server):
    body = {"model": "demo", "messages": PARTIAL, "max_tokens": 3, "n": 2, "seed": 1, "echo": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    texts, chunks = chat_text(server, {k: v for k, v in body.items() if k != "stream_options"})
    assert all(t.startswith(PARTIAL[-1]["content"]) for t in texts)
    chunks = events(server, "chat/completions", {**body, "stream": True})
    echoed = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content") == PARTIAL[-1]["content"]]
    assert sorted(c["choices"][0]["index"] for c in echoed) == [0, 1]
    assert all(c["usage"]["completion_tokens"] == 0 for c in echoed)
    assert chunks[-1]["usage"]["completion_tokens"] <= 6


def test_chat_echo_needs_the_answers_role(server):
    """The last message is the user's: with a generation prompt the answer is the assistant's, nothing is echoed;
    without one the answer goes on with the user's message, in its role, as vLLM's does."""
    ask = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    body = {"model": "demo", "messages": ask, "max_tokens": 3, "temperature": 0}
    plain = post(server, "chat/completions", body).json()["choices"][0]["message"]["content"]
    assert chat_text(server, {**body, "echo": True})[0] == [plain]
    body["add_generation_prompt"] = False
    whole = post(server, "chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    unechoed = post(server, "chat/completions", body).json()["choices"][0]["message"]
    assert whole == {"role": "user", "content": "Hi\nthere" + unechoed["content"]}   # parts joined as vLLM's


def test_chat_echo_with_a_tool_call_keeps_the_calls(server):
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 10}}}}}]
    body = {"model": "demo", "messages": PARTIAL, "max_tokens": 30, "temperature": 0, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "capital"}}}
    plain = post(server, "chat/completions", body).json()["choices"][0]["message"]
    echoed = post(server, "chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed["tool_calls"][0]["function"] == plain["tool_calls"][0]["function"]
    assert echoed["content"] == PARTIAL[-1]["content"] + (plain["content"] or "")


def test_chat_echo_must_be_a_boolean(server):
    r = post(server, "chat/completions", {"model": "demo", "messages": PARTIAL, "echo": "yes"})
    assert_error(r, 400, param="echo")


ROLES = st.sampled_from(["user", "assistant", "system", "tool"])
FLAG = st.sampled_from([None, True, False])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(roles=st.lists(ROLES, min_size=1, max_size=3), echo=FLAG, add_generation_prompt=FLAG,
       continue_final_message=FLAG, content=st.text(max_size=12), n=st.integers(1, 2), stream=st.booleans())
def test_any_echo_combination_is_answered_or_refused_by_name(server, roles, echo, add_generation_prompt,
                                                              continue_final_message, content, n, stream):
    messages = [{"role": role, "content": content or "x"} for role in roles]
    body = {"model": "demo", "messages": messages, "max_tokens": 1, "n": n, "seed": 0, "stream": stream}
    for name, value in (("echo", echo), ("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if value is not None:
            body[name] = value
    r = post(server, "chat/completions", body)
    generation_prompt = add_generation_prompt is not False
    if continue_final_message and (generation_prompt or roles[-1] != "assistant"):
        assert_error(r, 400, param="add_generation_prompt" if generation_prompt else "messages")
        return
    assert r.status_code == 200, r.text
    role = "assistant" if generation_prompt else roles[-1]
    echoed = messages[-1]["content"] if echo and roles[-1] == role else ""
    if stream:
        chunks = [c for c in events(server, "chat/completions", {**body, "stream": True}) if c["choices"]]
        for i in range(n):
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == i]
            assert deltas[0] == {"role": role, "content": ""}
            assert "".join(d.get("content") or "" for d in deltas).startswith(echoed)
            if echoed:
                assert deltas[1] == {"content": echoed}
    else:
        for choice in r.json()["choices"]:
            assert choice["message"]["role"] == role and choice["message"]["content"].startswith(echoed)


# ---- a request's chat_template ------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_request_template_is_refused_unless_trusted(server):
    r = post(server, "chat/completions", {"model": "demo", "messages": CHAT, "chat_template": TEMPLATE})
    assert_error(r, 400, param="chat_template")
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    r = post(server, "chat/completions", {"model": "demo", "messages": CHAT, "chat_template": ""})
    assert_error(r, 400, param="chat_template")   # vLLM's rule: any string, "" too
    r = post(server, "chat/completions", {"model": "demo", "messages": CHAT, "max_tokens": 1, "chat_template": None})
    assert r.status_code == 200, r.text


def test_a_trusted_template_renders_the_prompt(permissive_server, frontend):
    client = permissive_server.client()
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4, temperature=0,
                                          extra_body={"chat_template": TEMPLATE, "return_token_ids": True})
    rendered = "<user>Name three colors.</user>\n<assistant>"
    assert chat.prompt_token_ids == frontend.tokenizer.encode(rendered, add_special_tokens=False)
    same = client.completions.create(model="demo", prompt=chat.prompt_token_ids, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text
    stream = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"chat_template": TEMPLATE})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    model_own = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=1, temperature=0,
                                               extra_body={"chat_template": "", "return_token_ids": True})
    assert model_own.prompt_token_ids == frontend.tokenizer.encode(
        frontend.render_chat(CHAT), add_special_tokens=False)   # "": the model's own, as in vLLM


def test_a_trusted_template_goes_on_with_the_final_message(permissive_server):
    messages = [*CHAT, {"role": "assistant", "content": "Red,"}]
    body = {"model": "demo", "messages": messages, "max_tokens": 1, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template": TEMPLATE, "return_token_ids": True, "echo": True}
    r = post(permissive_server, "chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("Red,")


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}", "endfor"),                      # a syntax error
    ("{{ raise_exception('no system prompt') }}", "no system prompt"),
    ("{{ 1 / 0 }}", "division"),
    ("{{ messages[0].content.__class__.__mro__ }}", "unsafe"),  # the sandbox's refusal
    ("{{ messages.__class__ }}", ""),                           # the sandbox: undefined, so an empty prompt
])
def test_a_template_error_is_a_400_naming_chat_template(permissive_server, template, words):
    r = post(permissive_server, "chat/completions", {"model": "demo", "messages": CHAT, "chat_template": template})
    assert_error(r, 400, param="chat_template" if words else "prompt")
    assert words in r.json()["error"]["message"]


JINJA = st.lists(st.sampled_from(list("{}%#-+*/() []|.,'\"\n~x10") + [
    "{{", "}}", "{%", "%}", "for ", "if ", " in ", "endfor", "endif", "messages", "m.content", "m.role", "loop.",
    "range", "raise_exception", "add_generation_prompt", "tojson", "set ", "macro ", "endmacro"]),
    max_size=24).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(template=JINJA | st.text(max_size=30), stream=st.booleans())
def test_any_template_is_answered_or_a_400(permissive_server, template, stream):
    r = post(permissive_server, "chat/completions", {"model": "demo", "messages": CHAT, "max_tokens": 1,
                                                     "stream": stream, "chat_template": template})
    if r.status_code != 200:
        assert_error(r, 400, param="chat_template" if r.json()["error"]["param"] == "chat_template" else "prompt")
