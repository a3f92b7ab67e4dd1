"""``tool_choice: "auto"`` with ``--enable-auto-tool-choice --tool-call-parser NAME``, end to end with the demo
model and the official ``openai`` client: whatever the greedy model answers is read the same whole and streamed,
and a few-shot prompt in the parser's format makes it call the tool (``message.tool_calls``, ``finish_reason``
"tool_calls"). Without the flag, auto stays a 400 naming ``tool_choice``."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_errors import assert_error, post

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}}]
PLAIN = [{"role": "user", "content": "What is the weather in Paris?"}]


def rendered_call(parser: str, city: str) -> str:
    """A call to get_weather as a model trained for ``parser`` writes it."""
    if parser == "hermes":
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city
    if parser == "llama3_json":
        return '{"name": "get_weather", "parameters": {"city": "%s"}}' % city
    return '[get_weather(city="%s")]' % city


def few_shot(parser: str) -> list[dict]:
    """Two earlier answers in the parser's format: the greedy demo model answers the third the same way."""
    messages = [{"role": "system", "content": "You answer only with a tool call."}]
    for city in ("Paris", "Rome"):
        messages += [{"role": "user", "content": f"Weather in {city}?"},
                     {"role": "assistant", "content": rendered_call(parser, city)}]
    return messages + [{"role": "user", "content": "Weather in Berlin?"}]


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "pythonic"])
def auto_server(request, launch_server):
    srv = launch_server("--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8",
                        "--enable-auto-tool-choice", "--tool-call-parser", request.param)
    srv.parser = request.param
    yield srv
    srv.stop()


def accumulate(stream) -> dict:
    """Per choice: its content, calls (index -> id, name, arguments joined) and finish reason, from the chunks."""
    out: dict = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = got["calls"].setdefault(t.index, {"id": None, "name": None, "arguments": "", "pieces": 0})
                if t.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = t.id, t.function.name
                else:
                    assert call["id"] and t.type is None and not t.function.name, "id, type, name: first entry only"
                call["arguments"] += t.function.arguments or ""
                call["pieces"] += bool(t.function.arguments)
            got["finish"] = c.finish_reason or got["finish"]
    return {"choices": out, "usage": usage}


def whole_as_streamed(choice) -> dict:
    calls = {i: {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
             for i, t in enumerate(choice.message.tool_calls or [])}
    return {"content": choice.message.content or "", "calls": calls, "finish": choice.finish_reason}


def same_answer(whole: dict, streamed: dict) -> None:
    assert streamed["content"] == whole["content"]
    assert streamed["finish"] == whole["finish"]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == \
        [(c["name"], c["arguments"]) for c in whole["calls"].values()]   # the pieces join to the whole arguments
    for call in streamed["calls"].values():
        assert call["id"].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("messages", ["plain", "few_shot"])
def test_the_greedy_answer_reads_the_same_whole_and_streamed(auto_server, messages):
    client = auto_server.client()
    msgs = PLAIN if messages == "plain" else few_shot(auto_server.parser)
    kw = dict(model="demo", messages=msgs, tools=TOOLS, temperature=0, max_tokens=48)
    whole = client.chat.completions.create(**kw)
    streamed = accumulate(client.chat.completions.create(**kw, stream=True))
    same_answer(whole_as_streamed(whole.choices[0]), streamed["choices"][0])
    if messages == "few_shot":   # the call's arguments streamed in pieces, as they were generated
        [call] = streamed["choices"][0]["calls"].values()
        assert call["pieces"] > 1, call


def test_a_few_shot_prompt_makes_the_model_call_the_tool(auto_server):
    r = auto_server.client().chat.completions.create(model="demo", messages=few_shot(auto_server.parser),
                                                     tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None   # the answer is the call alone
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Berlin"}


def test_n_choices_stream_with_usage_as_their_whole_answers(auto_server):
    client = auto_server.client()
    kw = dict(model="demo", messages=few_shot(auto_server.parser), tools=TOOLS, temperature=1.0, seed=7, n=2,
              max_tokens=48)
    whole = client.chat.completions.create(**kw)
    streamed = accumulate(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert sorted(streamed["choices"]) == [0, 1]
    for choice in whole.choices:
        same_answer(whole_as_streamed(choice), streamed["choices"][choice.index])
    assert streamed["usage"].completion_tokens == whole.usage.completion_tokens


def test_tool_choice_none_and_required_are_unchanged(auto_server):
    client = auto_server.client()
    r = client.chat.completions.create(model="demo", messages=few_shot(auto_server.parser), tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=48)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    assert r.choices[0].message.content   # the call's text, as text
    r = client.chat.completions.create(model="demo", messages=PLAIN, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=48)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == ""
    assert "city" in json.loads(r.choices[0].message.tool_calls[0].function.arguments)


def test_auto_without_the_flag_is_a_400_naming_tool_choice(server):
    body = {"model": "demo", "messages": PLAIN, "tools": TOOLS, "max_tokens": 4}
    for extra in ({}, {"tool_choice": "auto"}):
        err = assert_error(post(server, "/v1/chat/completions", {**body, **extra}), 400, "tool_choice")
        assert "--enable-auto-tool-choice" in err["message"]


def test_openapi_lists_auto_only_where_it_is_served(auto_server, server):
    def choices(srv) -> list:
        body = httpx.get(srv.url + "/openapi.json", headers=srv.headers(), timeout=30).json()
        schema = body["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return schema["properties"]["tool_choice"]["anyOf"][0]["anyOf"][0]["enum"]
    assert "auto" in choices(auto_server) and "auto" not in choices(server)


@pytest.mark.parametrize("parser, skip", [("hermes", False), ("llama3_json", True), ("pythonic", True), (None, True)])
def test_hermes_reads_the_text_with_special_tokens_as_vllm(parser, skip):
    """vLLM's hermes parser turns skip_special_tokens off (some models' <tool_call> is a special token); the other
    parsers, and a request without tools, keep the request's own setting."""
    from pdpool.server import protocol

    body = {"model": "demo", "messages": PLAIN, **({"tools": TOOLS} if parser else {})}
    req = protocol.parse_chat(body, ["demo"], lambda messages, *flags: "x", parser)
    assert req.params.skip_special_tokens is skip


def test_special_tokens_kept_leave_the_stop_token_out_of_the_text(server):
    """With skip_special_tokens false (hermes' setting) an answer that ends on the end-of-turn token does not
    carry that token's text, as vLLM's does not: the stop token is no part of the content."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 40,
            "temperature": 0, "return_token_ids": True}
    kept = post(server, "/v1/chat/completions", {**body, "skip_special_tokens": False}).json()["choices"][0]
    skipped = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert kept["finish_reason"] == skipped["finish_reason"] == "stop", (kept, skipped)
    assert kept["message"]["content"] == skipped["message"]["content"]
    assert "<|im_end|>" not in kept["message"]["content"] and "<|endoftext|>" not in kept["message"]["content"]
