"""The ``tool_choice: "auto"`` parsers (``pdpool.server.tool_parsers``): calls rendered in each parser's format come
back as the same calls, whole and streamed in any chunking (a call's arguments in pieces that join to the whole
answer's), and text that holds no call comes back as content."""

from __future__ import annotations

import json
import keyword

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from pdpool.server.tool_parsers import PARSERS, Arguments, Call, CallStart, make_parser, parse_whole

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12) | st.sampled_from(['"', "'", "\\", "]", "}", ")", "</tool_call>"[:5], "é", "😀", "\n"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s))
arguments = st.dictionaries(identifiers, json_values, max_size=4)
names = st.text(min_size=1, max_size=12)
dotted_names = st.lists(identifiers, min_size=1, max_size=3).map(".".join)


def render_hermes(calls, content, closed_last, spaces) -> str:
    out = content
    for i, (name, args) in enumerate(calls):
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=spaces % 2 == 0)
        close = "</tool_call>" if i < len(calls) - 1 or closed_last else ""
        out += f"<tool_call>{' ' * spaces}\n{body}\n{close}" + "\n" * (i < len(calls) - 1)
    return out


def render_llama(calls, tag, key, separator) -> str:
    body = separator.join(json.dumps({"name": name, key: args}, ensure_ascii=False) for name, args in calls)
    return ("<|python_tag|>" if tag else "") + body


def py(value) -> str:
    """A JSON value as Python source, JSON's names sometimes kept (the pythonic parser takes both)."""
    if value is None or isinstance(value, bool):
        return {None: "None", True: "True", False: "false"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(py, value)) + "]"
    return "{" + ", ".join(f"{k!r}: {py(v)}" for k, v in value.items()) + "}"


def render_pythonic(calls) -> str:
    return "[" + ", ".join(f"{name}(" + ", ".join(f"{k}={py(v)}" for k, v in args.items()) + ")"
                           for name, args in calls) + "]"


def merged(pieces) -> list:
    """Adjacent content pieces joined, and a call's argument pieces: a chunking changes how they split, never what
    they are."""
    out: list = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif isinstance(p, Arguments) and out and isinstance(out[-1], Arguments):
            out[-1] = Arguments(out[-1].text + p.text)
        else:
            out.append(p)
    return out


def streamed(name: str, text: str, cuts: list[int], broken: int = 0) -> list:
    parser, pieces, last = make_parser(name), [], 0
    for cut in sorted(set(c % (len(text) + 1) for c in cuts)):
        pieces += parser.feed(text[last:cut])
        last = cut
    pieces += parser.feed(text[last:], final=True)
    assert "" not in pieces and Arguments("") not in pieces
    assert parser.broken == broken   # a call that streamed and turned out none
    return merged(pieces)


def check(name: str, text: str, cuts: list[int], calls, content) -> None:
    got_content, got_calls = parse_whole(name, text)
    assert [c.name for c in got_calls] == [n for n, _ in calls]
    for call, (_, args) in zip(got_calls, calls):
        assert json.loads(call.arguments) == args
    assert got_content == content
    whole = merged(make_parser(name).feed(text, final=True))
    assert streamed(name, text, cuts) == whole


cuts = st.lists(st.integers(0, 10_000), max_size=12)


@SETTINGS
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
       st.text(max_size=20).filter(lambda s: "<tool_call>" not in s), st.booleans(), st.integers(0, 2),
       st.sampled_from(["", "\n", " Done.", "\n\nnote: <b>"]), cuts)
def test_hermes_round_trip(calls, content, closed_last, spaces, trailing, cuts):
    assume(not any("</tool_call>" in json.dumps(call) for call in calls))   # the format cannot hold it
    text = render_hermes(calls, content, closed_last or bool(trailing), spaces) + trailing
    want = content + (trailing if trailing.strip() else "")
    check("hermes", text, cuts, calls, want or None)


@SETTINGS
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.booleans(),
       st.sampled_from(["parameters", "arguments"]), st.sampled_from(["; ", ";", "\n", " ;\n"]),
       st.sampled_from(["", " ", "\nThat is all."]), cuts)
def test_llama3_json_round_trip(calls, tag, key, separator, trailing, cuts):
    text = render_llama(calls, tag, key, separator) + trailing
    check("llama3_json", text, cuts, calls, trailing if trailing.strip() else None)


@SETTINGS
@given(st.lists(st.tuples(dotted_names, arguments), min_size=1, max_size=3), st.sampled_from(["", " ", "\n"]),
       st.sampled_from(["", "\n", " and more"]), cuts)
def test_pythonic_round_trip(calls, leading, trailing, cuts):
    text = leading + render_pythonic(calls) + trailing
    check("pythonic", text, cuts, calls, trailing if trailing.strip() else None)


# Text built from the formats' own pieces reaches every branch of the parsers.
fragments = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", "<|python_tag|>", "{", "}", "[", "]",
                             "(", ")", '"name"', '"arguments"', '"parameters"', ": ", ", ", "; ", '"f"', "f(",
                             "a=", "1", "true", "'x'", '"', "\\", " ", "\n", "é", "😀", "text"])
hostile = st.lists(fragments, max_size=30).map("".join) | st.text(max_size=60)


@SETTINGS
@given(st.sampled_from(PARSERS), hostile, cuts)
def test_any_text_parses_the_same_whole_and_streamed(name, text, cuts):
    content, calls = parse_whole(name, text)
    parser = make_parser(name)
    for i in sorted(set(c % (len(text) + 1) for c in cuts)):
        parser.feed(text[len(parser.text):i])
    parser.feed(text[len(parser.text):], final=True)
    if not parser.broken:   # else a call streamed that the whole answer makes content: the stream cannot undo it
        assert streamed(name, text, cuts) == merged(make_parser(name).feed(text, final=True))
    for call in calls:
        assert isinstance(call, Call) and call.name
        assert isinstance(json.loads(call.arguments), dict)
    if not calls:
        assert content == text   # no call: all of it is content
    else:
        assert content is None or content


@SETTINGS
@given(hostile, cuts)
def test_text_without_a_call_marker_is_content(text, cuts):
    starts = {"hermes": "<tool_call>" not in text, "llama3_json": not text.lstrip().startswith(("{", "<|")),
              "pythonic": not text.lstrip().startswith("[")}
    for name, plain in starts.items():
        if plain:
            assert parse_whole(name, text) == (text, [])
            assert streamed(name, text, cuts) == ([text] if text else [])


def test_content_streams_before_a_call_is_complete():
    parser = make_parser("hermes")
    assert parser.feed("Let me check. <tool") == ["Let me check. "]   # a tag's start is held back
    assert parser.feed('_call>{"name": "f", "arguments": {"a"') == [CallStart("f"), Arguments('{"a"')]
    assert parser.feed(': 1}}</tool_call>') == [Arguments(': 1}')]
    assert parser.feed("\n", final=True) == []


def test_invalid_calls_are_content_and_valid_ones_calls():
    assert parse_whole("hermes", '<tool_call>{"name": "f"}</tool_call>') == ('<tool_call>{"name": "f"}</tool_call>', [])
    assert parse_whole("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>')[1] == []
    assert parse_whole("llama3_json", '{"name": "f", "parameters": [1]}') == ('{"name": "f", "parameters": [1]}', [])
    assert parse_whole("pythonic", "[f(1)]") == ("[f(1)]", [])            # positional arguments: no call
    assert parse_whole("pythonic", "[f(a=b)]") == ("[f(a=b)]", [])        # a name is no literal
    assert parse_whole("pythonic", "[f(a=1e999)]") == ("[f(a=1e999)]", [])   # infinity is no JSON
    assert parse_whole("pythonic", "[]") == ("[]", [])
    assert parse_whole("pythonic", "[f(a=(1, 2), b=null, c=-3)]") == (None,
                                                                       [Call("f", '{"a": [1, 2], "b": null, "c": -3}')])
