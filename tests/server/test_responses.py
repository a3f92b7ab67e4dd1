"""``POST /v1/responses`` (OpenAI's Responses API) on a node, with the official ``openai`` client: the greedy text is
the same chat request's, usage counts agree, the stream's events come in vLLM's order and add up to the whole
answer, tools and text.format ride on the chat machinery, and what is not served is a 400 naming its field."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_errors import assert_error, post
from test_server_tool_calls import CUT_IN_CITY, cut_inside_the_city

QUESTION = "Name three colors."
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city", "parameters": WEATHER}]
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, object]:
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens, temperature=0)
    return chat.choices[0].message.content, chat


def squeeze(types: list[str]) -> list[str]:
    """The event types with each run of one type kept once (the deltas)."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_text_equals_the_same_chat_requests(client):
    want, chat = chat_text(client, [{"role": "user", "content": QUESTION}], 24)
    r = client.responses.create(model="demo", input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.output_text == want
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "demo"
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    item = r.output[0]
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert item.id.startswith("msg_") and item.content[0].type == "output_text" and item.content[0].annotations == []


def test_instructions_and_items_are_the_chat_messages(client):
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": QUESTION}]
    want, _ = chat_text(client, messages, 16)
    r = client.responses.create(
        model="demo", instructions="You answer briefly.", max_output_tokens=16, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
               {"role": "user", "content": QUESTION}])
    assert r.output_text == want
    assert r.instructions == "You answer briefly."


def test_echoed_settings_and_max_output_tokens(server, client):
    r = client.responses.create(model="demo", input=QUESTION, max_output_tokens=3, temperature=0, top_p=0.5,
                                metadata={"k": "v"}, user="u1")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert (r.temperature, r.top_p, r.max_output_tokens, r.metadata, r.user) == (0.0, 0.5, 3, {"k": "v"}, "u1")
    assert (r.tools, r.tool_choice, r.parallel_tool_calls, r.truncation, r.background) == ([], "auto", True,
                                                                                            "disabled", False)
    unbounded = client.responses.create(model="demo", input=QUESTION, max_output_tokens=4, temperature=0)
    raw = post(server, "/v1/responses", {"model": "demo", "input": QUESTION, "temperature": 0,
                                         "max_output_tokens": 500}).json()   # cut at the context, as vLLM
    assert raw["max_output_tokens"] == server.max_model_len - unbounded.usage.input_tokens


def test_stream_events_in_order_and_add_up(client):
    whole = client.responses.create(model="demo", input=QUESTION, max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model="demo", input=QUESTION, max_output_tokens=16, temperature=0,
                                          stream=True))
    assert squeeze([e.type for e in events]) == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.output_text == whole.output_text and done.status == whole.status
    assert done.usage.output_tokens == whole.usage.output_tokens
    assert done.id == events[0].response.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {done.output[0].id}


def test_the_clients_stream_helper(client):
    with client.responses.stream(model="demo", input=QUESTION, max_output_tokens=8, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text and final.usage.output_tokens == 8


def test_raw_sse_framing(server):
    with httpx.stream("POST", server.url + "/v1/responses", headers=server.headers(), timeout=60,
                      json={"model": "demo", "input": "Hi", "max_output_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert "data: [DONE]" not in lines   # vLLM's and OpenAI's Responses streams end with response.completed
    for kind, data in zip(lines[::2], lines[1::2]):
        assert kind == "event: " + json.loads(data[6:])["type"]


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"],
              "additionalProperties": False}
    r = client.responses.create(model="demo", input="Pick a color.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"color"}
    assert r.text.format.type == "json_schema"


def test_logprobs_through_include(client):
    r = client.responses.create(model="demo", input="Hi", max_output_tokens=3, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text
    assert r.top_logprobs == 2


def test_function_calls_required_and_named(client):
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = client.responses.create(model="demo", input="Weather in Paris?", tools=TOOLS, tool_choice=choice,
                                    max_output_tokens=60, temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
        events = list(client.responses.create(model="demo", input="Weather in Paris?", tools=TOOLS,
                                              tool_choice=choice, max_output_tokens=60, temperature=0, stream=True))
        assert squeeze([e.type for e in events]) == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        streamed = events[-1].response.output[0]
        # the arguments in pieces, as generated; they join to exactly the whole answer's
        assert (streamed.name, streamed.arguments) == (calls[0].name, calls[0].arguments)
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(pieces) > 1 and "".join(pieces) == streamed.arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_call_cut_by_max_output_tokens_is_the_call_so_far(server, client, choice):
    """An incomplete Response (max_output_tokens) holds the forced call with its arguments so far, whole as
    streamed: chat's cut call (test_server_tool_calls), where it had no output for "required"."""
    chat_choice = choice if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    function = {k: v for k, v in TOOLS[0].items() if k != "type"}
    n = cut_inside_the_city(server, messages=[{"role": "user", "content": "Weather in Paris?"}],
                            tools=[{"type": "function", "function": function}], tool_choice=chat_choice)
    kwargs = dict(model="demo", input="Weather in Paris?", tools=TOOLS, tool_choice=choice, max_output_tokens=n,
                  temperature=0)
    r = client.responses.create(**kwargs)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    call, = r.output
    assert call.type == "function_call" and call.name == "get_weather" and CUT_IN_CITY.search(call.arguments)
    final = list(client.responses.create(stream=True, **kwargs))[-1].response
    assert final.status == "incomplete"
    assert [(o.type, o.name, o.arguments) for o in final.output] == [(call.type, call.name, call.arguments)]


def test_a_call_and_its_output_go_back_as_chat_turns(client):
    call_id = "call_1"
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C"}]
    want = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0,
                                          tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                                                  if k != "type"}}],
                                          tool_choice="none").choices[0].message.content
    r = client.responses.create(model="demo", max_output_tokens=16, temperature=0, tools=TOOLS, tool_choice="none",
                                input=[{"role": "user", "content": "Weather in Paris?"},
                                       {"type": "function_call", "call_id": call_id, "name": "get_weather",
                                        "arguments": '{"city": "Paris"}'},
                                       {"type": "function_call_output", "call_id": call_id, "output": "Sunny, 21 C"}])
    assert r.output_text == want


@pytest.mark.parametrize("body, param", [
    ({"input": QUESTION, "previous_response_id": "resp_abc"}, "previous_response_id"),
    ({"input": QUESTION, "background": True}, "background"),
    ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": QUESTION, "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": QUESTION, "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": QUESTION, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": QUESTION, "temperature": "hot"}, "temperature"),
    ({"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text"),
    ({"input": QUESTION, "tools": TOOLS}, "tool_choice"),   # "auto", the default, needs a parser
    ({"input": QUESTION, "tool_choice": "required"}, "tool_choice"),   # no tools: a 400 as in chat and vLLM
    ({"input": QUESTION, "tools": [], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
    ({"input": QUESTION, "include": ["nope"]}, "include"),
    ({"input": QUESTION, "top_logprobs": 21}, "top_logprobs"),
    ({"input": QUESTION, "metadata": {"k": 1}}, "metadata"),
    ({"input": QUESTION, "truncation": "sometimes"}, "truncation"),
    ({"input": QUESTION, "stream": "yes"}, "stream"),
    ({"input": QUESTION, "instructions": 3}, "instructions"),
])
def test_refusals_name_their_field(server, body, param):
    assert_error(post(server, "/v1/responses", {"model": "demo", **body}), 400, param)


def test_store_is_taken_and_ignored_and_unknown_model_is_404(server, client):
    r = client.responses.create(model="demo", input="Hi", max_output_tokens=2, store=True)
    assert r.status in ("completed", "incomplete")
    assert_error(post(server, "/v1/responses", {"model": "other", "input": "Hi"}), 404, "model")
    assert_error(post(server, "/v1/responses", {"input": "Hi", "max_output_tokens": 2},
                      headers={"Authorization": "Bearer wrong"}), 401)


def test_streamed_logprobs_are_the_whole_answers_with_a_stop_string(client):
    """A stop string's token has no text but its logprob: the streamed response keeps it as the whole one does
    (found by the router's differential property: a handed-off stream carried it, a node's did not)."""
    kwargs = dict(model="demo", input="Hi", max_output_tokens=8, temperature=0, top_logprobs=1,
                  include=["message.output_text.logprobs"], extra_body={"stop": ["!"]})
    whole = client.responses.create(**kwargs)
    streamed = list(client.responses.create(stream=True, **kwargs))[-1].response
    assert streamed.output_text == whole.output_text == "Hello"
    assert [lp.token for lp in streamed.output[0].content[0].logprobs] == \
        [lp.token for lp in whole.output[0].content[0].logprobs] == ["Hello", "!"]


def test_auto_tool_choice_with_a_parser(permissive_server):
    """tool_choice "auto" (the default with tools) on a node with --enable-auto-tool-choice --tool-call-parser
    hermes: a few-shot input makes the greedy model call the tool; whole and streamed give the same call."""
    def call(city: str) -> str:
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city

    items = []
    for city in ("Paris", "Rome"):
        items += [{"role": "user", "content": f"Weather in {city}?"}, {"role": "assistant", "content": call(city)}]
    kwargs = dict(model="demo", instructions="You answer only with a tool call.", tools=TOOLS, max_output_tokens=60,
                  temperature=0, input=items + [{"role": "user", "content": "Weather in Berlin?"}])
    client = permissive_server.client()
    whole = client.responses.create(**kwargs)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Berlin"})]
    assert whole.tool_choice == "auto"
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [o for o in events[-1].response.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert "response.function_call_arguments.done" in [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == calls[0].arguments   # streamed as generated


def test_an_echoed_unpaired_surrogate_streams_escaped(server):
    """metadata is echoed in every response object of a stream: a value with JSON's \\ud800 escape (no UTF-8 for
    it) goes out escaped, not as a broken stream."""
    body = b'{"model": "demo", "input": "Hi", "max_output_tokens": 2, "stream": true, "metadata": {"k": "\\ud800"}}'
    with httpx.stream("POST", server.url + "/v1/responses", content=body, timeout=60,
                      headers={**server.headers(), "Content-Type": "application/json"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["metadata"] == {"k": "\ud800"}
