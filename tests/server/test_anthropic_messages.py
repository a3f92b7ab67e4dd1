"""``POST /v1/messages`` (Anthropic's Messages API) on a node, with the official ``anthropic`` client: the greedy text
is the same chat request's, stop reasons and usage map as vLLM maps them, the stream's events come in Anthropic's
order and add up to the whole answer, tool_use rides on the chat tools machinery, and errors come in Anthropic's
shape."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_errors import post
from test_server_tool_calls import CUT_IN_CITY, cut_inside_the_city

anthropic = pytest.importorskip("anthropic")

QUESTION = "Name three colors."
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                                "parameters": WEATHER}}]
GREEDY = {"temperature": 0}   # the SDK's create() takes no sampling fields any more: in the body
TEXT_EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
               "message_stop"]


def claude(server, **kw):
    """The anthropic client on ``server``: its key as x-api-key (the SDK's api_key), or as a bearer token."""
    key = {"auth_token": server.api_key} if kw.pop("bearer", False) else {"api_key": server.api_key or "unused"}
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=300, **key, **kw)


def chat(server, messages: list[dict], max_tokens: int, **extra) -> dict:
    r = post(server, "/v1/chat/completions", {"model": "demo", "messages": messages, "max_tokens": max_tokens,
                                              "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def squeeze(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def sse_events(r: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for block in r.text.split("\n\n"):
        if block:
            kind, data = block.split("\n", 1)
            assert kind.startswith("event: ") and data.startswith("data: ")
            out.append((kind[7:], json.loads(data[6:])))
    return out


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def test_text_equals_the_same_chat_requests(server):
    want = chat(server, [{"role": "system", "content": "You answer briefly."},
                         {"role": "user", "content": QUESTION}], 24)
    m = claude(server).messages.create(model="demo", system="You answer briefly.", max_tokens=24, extra_body=GREEDY,
                                        messages=[{"role": "user", "content": QUESTION}])
    assert m.content[0].type == "text" and m.content[0].text == want["choices"][0]["message"]["content"]
    assert m.id.startswith("msg_") and (m.type, m.role, m.model) == ("message", "assistant", "demo")
    assert m.stop_reason == ("max_tokens" if want["choices"][0]["finish_reason"] == "length" else "end_turn")
    assert m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == want["usage"]["completion_tokens"]


def test_blocks_and_history_are_the_chat_messages(server):
    messages = [{"role": "system", "content": "Be brief. Answer in English."},
                {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a color.\nThen a fruit."}]
    want = chat(server, messages, 12)["choices"][0]["message"]["content"]
    m = claude(server, bearer=True).messages.create(
        model="demo", max_tokens=12, extra_body=GREEDY,
        system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Answer in English."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Name a color."},
                                               {"type": "text", "text": "Then a fruit."}]}])
    assert m.content[0].text == want


def test_stop_sequence_and_max_tokens(server):
    client = claude(server)
    m = client.messages.create(model="demo", max_tokens=2, extra_body=GREEDY,
                               messages=[{"role": "user", "content": QUESTION}])
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 2)
    full = client.messages.create(model="demo", max_tokens=24, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": QUESTION}]).content[0].text
    word = full.split()[1]
    m = client.messages.create(model="demo", max_tokens=24, extra_body=GREEDY, stop_sequences=[word],
                               messages=[{"role": "user", "content": QUESTION}])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == full[:full.index(word)]


def test_stream_events_in_order_and_add_up(server):
    client = claude(server)
    kwargs = dict(model="demo", max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    r = post(server, "/v1/messages", {**kwargs.pop("extra_body"), **kwargs, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert squeeze([kind for kind, _ in events]) == TEXT_EVENTS
    assert all(data["type"] == kind for kind, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert all(data["index"] == 0 for kind, data in events if kind.startswith("content_block"))
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


def test_tool_use_required_and_named_and_the_round_trip(server):
    client = claude(server)
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        kwargs = dict(model="demo", max_tokens=60, extra_body=GREEDY, tools=TOOLS, tool_choice=choice,
                      messages=[{"role": "user", "content": "Weather in Paris?"}])
        m = client.messages.create(**kwargs)
        calls = [b for b in m.content if b.type == "tool_use"]
        assert calls and calls[0].name == "get_weather" and "city" in calls[0].input and calls[0].id
        assert m.stop_reason == "tool_use"
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        streamed = [b for b in final.content if b.type == "tool_use"]
        assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in calls]
        assert final.stop_reason == "tool_use"
    # the call and its result go back as the chat's assistant tool_calls and tool message
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"}]
    want = chat(server, history, 16, tools=CHAT_TOOLS, tool_choice="none")["choices"][0]["message"]["content"]
    m = client.messages.create(model="demo", max_tokens=16, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "none"},
                               messages=[{"role": "user", "content": "Weather in Paris?"},
                                         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                                            "name": "get_weather",
                                                                            "input": {"city": "Paris"}}]},
                                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                       "content": "Sunny, 21 C"}]}])
    assert m.content[0].text == want


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_call_cut_by_max_tokens(server, choice):
    """A forced call cut by max_tokens: the whole answer's arguments so far come as text (a tool_use input must be
    an object; vLLM 0.32 answers a 400 for a named call, nothing for "any"), the stream's as the tool_use block's
    partial_json, as vLLM streams it; stop_reason "max_tokens" both ways."""
    chat_choice = "required" if choice["type"] == "any" else {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    n = cut_inside_the_city(server, messages=messages, tools=CHAT_TOOLS, tool_choice=chat_choice)
    body = {"model": "demo", "max_tokens": n, "temperature": 0, "tools": TOOLS, "tool_choice": choice,
            "messages": messages}
    m = post(server, "/v1/messages", body).json()
    assert m["stop_reason"] == "max_tokens" and [b["type"] for b in m["content"]] == ["text"]
    assert CUT_IN_CITY.search(m["content"][0]["text"])
    events = sse_events(post(server, "/v1/messages", {**body, "stream": True}))
    start, = [data["content_block"] for kind, data in events if kind == "content_block_start"]
    assert (start["type"], start["name"]) == ("tool_use", "get_weather")
    assert "".join(data["delta"]["partial_json"] for kind, data in events if kind == "content_block_delta") == \
        m["content"][0]["text"]
    assert [data["delta"]["stop_reason"] for kind, data in events if kind == "message_delta"] == ["max_tokens"]


def test_auto_tool_choice_with_a_parser(permissive_server):
    """tools without tool_choice are "auto" (vLLM's), read by the node's hermes parser: a few-shot history makes the
    greedy model call the tool; whole and streamed give the same call."""
    def call(city: str) -> str:
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city

    messages = []
    for city in ("Paris", "Rome"):
        messages += [{"role": "user", "content": f"Weather in {city}?"}, {"role": "assistant", "content": call(city)}]
    kwargs = dict(model="demo", system="You answer only with a tool call.", tools=TOOLS, max_tokens=60,
                  extra_body=GREEDY, messages=messages + [{"role": "user", "content": "Weather in Berlin?"}])
    client = claude(permissive_server)
    whole = client.messages.create(**kwargs)
    assert [(b.name, b.input) for b in whole.content if b.type == "tool_use"] == [("get_weather", {"city": "Berlin"})]
    assert whole.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        pieces = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather", {"city": "Berlin"})]
    assert final.stop_reason == "tool_use"
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Berlin"}   # streamed as generated


def test_count_tokens_is_the_rendered_prompts(server):
    messages = [{"role": "user", "content": QUESTION}]
    want = chat(server, [{"role": "system", "content": "Be brief."}, *messages], 1)["usage"]["prompt_tokens"]
    counted = claude(server).messages.count_tokens(model="demo", system="Be brief.", messages=messages)
    assert counted.input_tokens == want
    assert_anthropic_error(post(server, "/v1/messages/count_tokens", {"model": "demo"}), 400, "invalid_request_error")


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": QUESTION}]},                     # no max_tokens
    {"max_tokens": 0, "messages": [{"role": "user", "content": QUESTION}]},
    {"max_tokens": 8, "messages": []},
    {"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]},
    {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}]}]},
    {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS},   # auto: no parser
    {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
     "tool_choice": {"type": "tool", "name": "nope"}},
    {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], "tool_choice": {"type": "any"}},   # no tools
    {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], "tools": [],
     "tool_choice": {"type": "tool", "name": "get_weather"}},
    {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], "temperature": "hot"},
    {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], "stop_sequences": "x"},
    {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], "thinking": {"type": "enabled"}},
    {"max_tokens": 100000, "messages": [{"role": "user", "content": QUESTION}]},
])
def test_refusals_are_anthropic_errors(server, body):
    assert_anthropic_error(post(server, "/v1/messages", {"model": "demo", **body}), 400, "invalid_request_error")


def test_errors_through_the_client_and_auth(server):
    client = claude(server)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}])
    assert "text only" in info.value.body["error"]["message"]
    for headers in ({"Authorization": "Bearer wrong"}, {"x-api-key": "wrong", "Authorization": ""}):
        r = httpx.post(server.url + "/v1/messages", json={"model": "demo", "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}]}, headers=headers, timeout=60)
        assert_anthropic_error(r, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="demo", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    # the key as x-api-key (the SDK's api_key) and as a bearer token (its auth_token) both pass
    assert claude(server, bearer=True).messages.create(model="demo", max_tokens=1, messages=[
        {"role": "user", "content": "Hi"}]).usage.output_tokens == 1
