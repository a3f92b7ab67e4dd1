"""Tool calls streamed in pieces (``pdpool.server.tools``: ``ToolCallStream``, ``AutoToolStream``; their arguments'
JSON by ``tool_arguments.JsonStreamer``): whatever the chunking of the model's text, each call's first
``delta.tool_calls`` entry has its index, id, type and name, later ones only pieces of its arguments, and the pieces
join to exactly the whole answer's arguments (``tools.tool_message``): for a named function, "required" and the
three "auto" parsers."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings, strategies as st

from pdpool.server.tool_arguments import JsonStreamer
from pdpool.server.tool_parsers import PARSERS
from pdpool.server.tools import AutoToolStream, ToolCallStream, ToolChoice, tool_message
from test_tool_parsers import arguments, dotted_names, json_values, names, render_hermes, render_llama, \
    render_pythonic

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
cuts = st.lists(st.integers(0, 10_000), max_size=16)
# the spacings a model may write JSON in: json.dumps' own, compact, indented; \uXXXX escapes or the characters
spacing = st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}, {"indent": 2, "ensure_ascii": True},
                           {"ensure_ascii": True}])


def dumps(value, style: dict) -> str:
    return json.dumps(value, **{"ensure_ascii": False, **style})


def chunks(text: str, cuts: list[int]) -> list[str]:
    points = [0, *sorted(set(c % (len(text) + 1) for c in cuts)), len(text)]
    return [text[a:b] for a, b in zip(points, points[1:])]


def joined(deltas: list[dict]) -> list[dict]:
    """The calls a client accumulates from ``delta.tool_calls`` entries; each entry's shape checked on the way."""
    calls: list[dict] = []
    for d in deltas:
        if d["index"] == len(calls):   # a call's first entry: its id, type and name
            assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function" and d["function"]["name"]
            calls.append({"name": d["function"]["name"], "arguments": d["function"].get("arguments") or ""})
        else:
            assert d["index"] == len(calls) - 1, "a call's pieces come before the next call's"
            assert "id" not in d and "type" not in d and not d["function"].get("name")
            calls[-1]["arguments"] += d["function"]["arguments"]
    return calls


def whole_calls(choice: ToolChoice, text: str) -> list[dict]:
    return [c["function"] for c in tool_message(choice, text).get("tool_calls", [])]


def stream_guided(choice: ToolChoice, text: str, cuts: list[int]) -> list[dict]:
    stream, deltas = ToolCallStream(choice), []
    for piece in chunks(text, cuts):
        deltas += stream.feed(piece)
    return joined(deltas)


@SETTINGS
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=4) | st.lists(json_values, max_size=3), spacing,
       st.sampled_from(["", " ", "\n", "}", ", "]), cuts)
def test_json_streamer_pieces_join_to_the_reserialized_value(value, style, tail, cuts):
    text = dumps(value, style)
    streamer, out = JsonStreamer(), ""
    for piece in chunks(text + tail, cuts):
        out += streamer.feed(piece)   # what follows the value is left unconsumed
    out += streamer.finish()
    assert not streamer.broken and streamer.done and streamer.consumed == len(text)
    assert out == json.dumps(json.loads(text), ensure_ascii=False)


def test_json_streamer_holds_back_what_may_change():
    streamer = JsonStreamer()
    assert streamer.feed('{"n": 12') == '{"n": '            # 12 may go on: 123
    assert streamer.feed('3, "s": "a\\') == '123, "s": "a'  # an escape's start waits for its end
    assert streamer.feed("ud83d") == ""                      # half a surrogate pair waits for the other half
    assert streamer.feed('\\ude00", "f": 1.50e0}') == '😀", "f": 1.5}'
    assert streamer.done and not streamer.broken
    for bad in ('{"a": 1, "a": 2}', '{"a": NaN}', '{"a": 1e999}', '{"a": 01}', '{"a": "\x01"}', '[1 2]'):
        streamer = JsonStreamer()
        streamer.feed(bad)
        assert streamer.broken, bad


@SETTINGS
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), spacing, cuts)
def test_required_arguments_join_to_the_whole_answers(calls, style, cuts):
    choice = ToolChoice({"type": "array"})
    text = dumps([{"name": name, "parameters": args} for name, args in calls], style)
    assert stream_guided(choice, text, cuts) == whole_calls(choice, text)


@SETTINGS
@given(arguments, spacing, cuts)
def test_named_function_arguments_join_to_the_whole_answers(args, style, cuts):
    choice = ToolChoice({"type": "object"}, name="get_weather")
    text = dumps(args, style)
    assert stream_guided(choice, text, cuts) == whole_calls(choice, text) == [{"name": "get_weather",
                                                                              "arguments": text}]


def render(parser: str, calls, style: int) -> str:
    if parser == "hermes":
        return render_hermes(calls, "Let me check. ", True, style)
    if parser == "llama3_json":
        return render_llama(calls, style % 2 == 0, ("parameters", "arguments")[style % 2], ";\n"[style % 2:])
    return render_pythonic(calls)


def stream_auto(choice: ToolChoice, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    stream, content, deltas = AutoToolStream(choice), "", []
    pieces = chunks(text, cuts)
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, i == len(pieces) - 1)
        content += delta.get("content") or ""
        deltas += delta.get("tool_calls", [])
    assert stream.parser.broken == 0
    return content, joined(deltas)


@SETTINGS
@given(st.sampled_from(PARSERS), st.lists(st.tuples(dotted_names, arguments), min_size=1, max_size=3),
       st.integers(0, 2), st.booleans(), cuts)
def test_auto_arguments_join_to_the_whole_answers(parser, calls, style, parallel, cuts):
    choice = ToolChoice(None, parser=parser, parallel=parallel)
    text = render(parser, calls, style)
    content, streamed = stream_auto(choice, text, cuts)
    whole = tool_message(choice, text)
    assert content == (whole["content"] or "")
    assert streamed == [c["function"] for c in whole["tool_calls"]]
    assert len(streamed) == (len(calls) if parallel else 1)


def test_a_call_streams_before_it_is_complete():
    """Its name once certain, then its arguments as they come; a closing tag's start is held back."""
    stream = AutoToolStream(ToolChoice(None, parser="hermes"))
    first = stream.feed('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', False)
    assert first == {"content": "Sure. ", "tool_calls": [
        {"index": 0, "id": first["tool_calls"][0]["id"], "type": "function", "function": {"name": "get_weather"}},
        {"index": 0, "function": {"arguments": '{"city": "Par'}}]}   # vLLM's: the name, then the arguments
    assert stream.feed('is</tool', False) == {"tool_calls": [{"index": 0, "function": {"arguments": "is"}}]}
    assert stream.feed('", "days": 3}}\n</tool_call>', True) == {"tool_calls": [
        {"index": 0, "function": {"arguments": '</tool", "days": 3}'}}]}


def test_pythonic_streams_a_keyword_argument_once_it_ends_and_a_plain_string_as_it_comes():
    stream = AutoToolStream(ToolChoice(None, parser="pythonic"))
    out = [stream.feed(piece, False) for piece in ('[get_weather(city="Pa', "ris", '\\"", ', "days=3", ")",
                                                   ", ping()", "]")]
    pieces = [[(c.get("function") or {}).get("arguments") for c in d.get("tool_calls", [])] for d in out]
    assert pieces == [[None, '{"city": "Pa'], ["ris"], ['\\""'], [], [', "days": 3}'], [None, "{}"], []]


def test_a_call_that_turns_out_invalid_after_it_started_streaming():
    """The stream cannot take back its start: no more pieces come for it, and the parser counts it."""
    stream = AutoToolStream(ToolChoice(None, parser="hermes"))
    first = stream.feed('<tool_call>{"name": "f", "arguments": {"a": 1}', False)
    assert [c["function"] for c in first["tool_calls"]] == [{"name": "f"}, {"arguments": '{"a": 1}'}]
    assert stream.feed(" and more}</tool_call>", True) == {"content": ""}
    assert stream.parser.broken == 1 and stream.called
    text = '<tool_call>{"name": "f", "arguments": {"a": 1} and more}</tool_call>'
    assert tool_message(ToolChoice(None, parser="hermes"), text) == {"role": "assistant", "content": text}


def test_the_name_comes_once_certain_and_arguments_after_other_keys_come_whole():
    """As vLLM's hermes parser: the name's own chunk as soon as its string closes; arguments that do not follow the
    name stream nothing until the object is complete, then come whole."""
    stream = AutoToolStream(ToolChoice(None, parser="hermes"))
    assert stream.feed('<tool_call>{"name": "get_weat', False) == {"content": ""}
    [head] = stream.feed('her", "id": 7, "argu', False)["tool_calls"]
    assert head["function"] == {"name": "get_weather"} and head["index"] == 0 and head["type"] == "function"
    assert stream.feed('ments": {"city":"Paris"}}', False) == {"content": ""}
    assert stream.feed("</tool_call>", True) == {"tool_calls": [{"index": 0, "function": {
        "arguments": '{"city": "Paris"}'}}]}
    assert stream.parser.broken == 0
