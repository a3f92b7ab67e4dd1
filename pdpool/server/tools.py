"""Tool calls: ``tool_choice`` ``"required"`` or a named function, and ``"auto"`` with a tool-call parser.

``"required"`` and a named function need no model-specific parser: the request's ``tools`` and ``tool_choice``
become a JSON-schema constraint on the output (structured output): a named function's ``parameters``, or for
``"required"`` an array of ``{"name", "parameters"}`` objects, one of the tools each (``parallel_tool_calls:
false``: at most one). The answer reads that JSON back as ``message.tool_calls``, or as ``delta.tool_calls`` when
streaming. ``"auto"`` (the default with tools) leaves the output free and reads the model's own tool-call format
with the server's ``--tool-call-parser`` (``pdpool.server.tool_parsers``); without ``--enable-auto-tool-choice``
it is refused, as vLLM refuses it. ``"none"`` is text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pdpool.engine.sampling_params import short_repr
from pdpool.server.errors import APIError
from pdpool.server.tool_arguments import JsonStreamer
from pdpool.server.tool_parsers import CallStart, make_parser, parse_whole

_USAGE = '{"type": "function", "function": {"name": "my_function"}}'


@dataclass
class ToolChoice:
    """What a chat answer's text is: one named function's arguments (``name`` set), a JSON array of calls
    (``schema`` alone), or free text read by a tool-call parser (``parser`` set, no ``schema``: "auto")."""
    schema: dict | None
    name: str | None = None
    parser: str | None = None
    parallel: bool = True     # "auto" with parallel_tool_calls false: the first call alone, as vLLM's


def parse_tools(body: dict, auto_parser: str | None = None) -> tuple[list[dict] | None, ToolChoice | None]:
    """The request's tools (for the chat template; None without) and, for ``"required"`` or a named function,
    the choice to constrain the output to; for ``"auto"`` the parser to read it with (``auto_parser``: the
    server's, None where auto is not enabled). Every refusal names its field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):   # checked whatever tool_choice is (schemathesis)
        raise APIError(f"'parallel_tool_calls' must be a boolean, got {short_repr(parallel)}",
                       param="parallel_tool_calls")
    if tools is not None:
        tools = read_tools(tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return tools, None
    if isinstance(choice, str) and choice not in ("auto", "required") or not isinstance(choice, (str, dict)):
        raise APIError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {_USAGE}, got {short_repr(choice)}",
                       param="tool_choice")
    if not tools:
        raise APIError("'tool_choice' other than \"none\" needs 'tools'", param="tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise APIError("'tool_choice' \"auto\" (the default with tools) needs the server started with "
                           "--enable-auto-tool-choice and --tool-call-parser (the model's own tool-call format): "
                           "send \"required\" or a named function for a call constrained to the tools' schemas, "
                           "or \"none\" for text", param="tool_choice")
        return tools, ToolChoice(None, parser=auto_parser, parallel=parallel is not False)
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        return tools, ToolChoice(_calls_schema(tools, parallel))
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise APIError(f"'tool_choice' must name a function as {_USAGE}, got {short_repr(choice)}",
                       param="tool_choice")
    name = function["name"]
    if name not in by_name:
        raise APIError(f"'tool_choice' names the function {short_repr(name)}, which is not in 'tools' "
                       f"({', '.join(map(repr, by_name))})", param="tool_choice")
    return tools, ToolChoice(_parameters(by_name[name]), name=name)


def read_tools(tools) -> list[dict]:
    """The request's ``tools``, checked: a non-empty list of functions, each named, its parameters a schema."""
    if not isinstance(tools, list):
        raise APIError(f"'tools' must be a list of functions, got {short_repr(tools)}", param="tools")
    if not tools:
        raise APIError("'tools' must not be empty (omit it, or send at least one function)", param="tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                           f"{short_repr(tool)}", param="tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(f"{where}.function must be an object with a non-empty string 'name'", param="tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise APIError(f"{where}.function.parameters must be a JSON schema object", param="tools")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise APIError(f"{where}.function.description must be a string", param="tools")
    return tools


def _parameters(function: dict) -> dict:
    """A function's arguments schema; one without ``parameters`` takes an object (``{}`` at least)."""
    params = function.get("parameters")
    return params if params else {"type": "object", "properties": {}}


def _calls_schema(tools: list[dict], parallel) -> dict:
    """The array of calls for ``"required"``. Each tool's ``$defs`` move to the top, where its ``#/$defs/..``
    references point once its schema is nested; one name defined two ways is refused."""
    alternatives, defs = [], {}
    for tool in tools:
        function = tool["function"]
        params = dict(_parameters(function))
        for name, schema in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(f"two tools define '$defs' {short_repr(name)} differently; with tool_choice "
                               f"\"required\" their definitions share one namespace", param="tools")
        alternatives.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                              "parameters": params},
                             "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def _call(name: str, arguments: str) -> dict:
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(choice: ToolChoice, text: str, cut: bool = False) -> dict:
    """A whole answer's message. A named function's call holds the text as its arguments, even cut short by
    max_tokens; ``"required"``'s text is a JSON array of calls, each one's arguments re-serialized; an unfinished
    array cut by max_tokens (``cut``) holds the calls its stream sent, with their arguments so far (vLLM's whole
    answer has none), and none otherwise. The content is "" (not null), as vLLM's. ``"auto"``: the parser's
    content (null when the answer is calls alone) and calls, if any."""
    if choice.parser is not None:
        content, calls = parse_whole(choice.parser, text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [_call(c.name, c.arguments) for c in calls[:None if choice.parallel else 1]]
        return message
    message = {"role": "assistant", "content": ""}
    if choice.name is not None:
        message["tool_calls"] = [_call(choice.name, text)]
        return message
    try:
        calls = json.loads(text)
    except ValueError:
        cut_calls = _streamed_calls(choice, text) if cut else []
        if cut_calls:
            message["tool_calls"] = cut_calls
        return message
    if isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c
                                       for c in calls):   # what the grammar allows; anything else is no call
        message["tool_calls"] = [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    return message


def _streamed_calls(choice: ToolChoice, text: str) -> list[dict]:
    """The calls a stream of ``text`` sends (``ToolCallStream``), each with its arguments joined."""
    calls: list[dict] = []
    for delta in ToolCallStream(choice).feed(text):
        if "id" in delta:
            calls.append(_call(delta["function"]["name"], ""))
        calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls


def finish_reason(choice: ToolChoice, reason: str | None, called: bool = False) -> str | None:
    """vLLM's: ``"required"``'s calls, once complete, end with "tool_calls"; a named function's with "stop";
    ``"auto"``'s with "tool_calls" when the answer called a tool (``called``), else as text does. A call cut by
    max_tokens stays "length" (as vLLM streams it; vLLM's whole answer says "tool_calls" then)."""
    if choice.parser is not None:
        return "tool_calls" if called and reason == "stop" else reason
    return "tool_calls" if choice.name is None and reason == "stop" else reason


class AutoToolStream:
    """A streamed ``"auto"`` answer's text -> its chunks' deltas: content, and each call as it is written: a first
    ``delta.tool_calls`` entry with its index, id, type and name, then entries with pieces of its arguments, as
    vLLM's parsers stream them. The pieces are the whole answer's (``pdpool.server.tool_parsers``): a stream's
    content and arguments join to what the whole answer says."""

    def __init__(self, choice: ToolChoice) -> None:
        self.parser = make_parser(choice.parser)
        self.parallel = choice.parallel
        self.calls = 0
        self.skipping = False   # the call being read is past the first, with parallel_tool_calls false

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, new_text: str, final: bool) -> dict:
        content, tool_calls = "", []
        for piece in self.parser.feed(new_text, final):
            if isinstance(piece, str):
                content += piece
            elif isinstance(piece, CallStart):
                self.skipping = not self.parallel and self.calls > 0   # parallel_tool_calls false: the first alone
                if not self.skipping:
                    tool_calls.append({"index": self.calls, "id": tool_call_id(), "type": "function",
                                       "function": {"name": piece.name}})
                    self.calls += 1
            elif not self.skipping:
                last = tool_calls[-1] if tool_calls else None
                if last is not None and "arguments" in last["function"]:   # one entry per call's new arguments
                    last["function"]["arguments"] += piece.text
                else:
                    tool_calls.append({"index": self.calls - 1, "function": {"arguments": piece.text}})
        if not tool_calls:
            return {"content": content}
        return {"content": content, "tool_calls": tool_calls} if content else {"tool_calls": tool_calls}


@dataclass
class ToolCallStream:
    """A streamed choice's text -> ``delta.tool_calls`` entries, as the text grows: each call's first entry
    carries its index, id, type, name and its arguments so far; then pieces of its arguments. A named function's
    arguments are the text itself, as the whole answer's; ``"required"``'s are each parameters object's JSON as
    the whole answer re-serializes it (``JsonStreamer``), so the pieces join to the whole answer's arguments."""
    choice: ToolChoice
    text: str = ""
    sent: list[int] = field(default_factory=list)    # per call: characters of its parameters' text read
    streamers: list[JsonStreamer] = field(default_factory=list)   # "required": per call, its parameters

    def feed(self, new_text: str) -> list[dict]:
        self.text += new_text
        if self.choice.name is not None:
            spans = [(self.choice.name, 0, len(self.text))]
        else:
            spans = _array_calls(self.text)
        deltas = []
        for index, (name, start, end) in enumerate(spans):
            if name is None or start is None:
                break
            if index == len(self.sent):
                self.sent.append(0)
                self.streamers.append(JsonStreamer())
                deltas.append({"index": index, "id": tool_call_id(), "type": "function",
                               "function": {"name": name, "arguments": ""}})
            raw = self.text[start + self.sent[index]:end]
            self.sent[index] += len(raw)
            if self.choice.name is not None:
                piece = raw
            else:   # a scalar's end is its span's (parameters are an object, unless a tool says otherwise)
                piece = self.streamers[index].feed(raw)
                if self.text[end:].strip():
                    piece += self.streamers[index].finish()
            if piece:
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += piece
                else:
                    function = {"arguments": piece} if self.choice.name is not None else {"name": None,
                                                                                           "arguments": piece}
                    deltas.append({"index": index, "function": function})
        return deltas


def _array_calls(text: str) -> list[tuple[str | None, int | None, int]]:
    """For a (possibly unfinished) JSON array of ``{"name": ..., "parameters": ...}`` objects: per object, its name
    once complete, and the span of its parameters' text so far (start None before it starts). A scanner of JSON's
    structure, not a parser: the grammar already made the text valid."""
    calls: list[list] = []
    depth = 0
    in_string = escaped = False
    key_start = value_start = None
    key = last_string = None
    expecting_value = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                last_string = json.loads(text[key_start:i + 1])
                if depth == 2 and not expecting_value:
                    key = last_string
                elif depth == 2 and expecting_value and key == "name":
                    calls[-1][0] = last_string
                    expecting_value = False
            continue
        if ch == '"':
            in_string = True
            key_start = i
            if depth == 2 and expecting_value and key == "parameters":
                value_start = i
                calls[-1][1] = i
                expecting_value = False
            continue
        if ch.isspace():
            continue
        if depth == 2 and expecting_value and key == "parameters":
            calls[-1][1] = value_start = i
            expecting_value = False
        if ch in "[{":
            depth += 1
            if depth == 2:
                calls.append([None, None, None])
        elif ch in "]}":
            if depth == 2:   # the call's object closes
                if value_start is not None and calls[-1][2] is None:
                    calls[-1][2] = i
                value_start = None
            depth -= 1
            if depth == 2 and value_start is not None and key == "parameters":
                calls[-1][2] = i + 1
                value_start = None
        elif ch == ":" and depth == 2:
            expecting_value = True
        elif ch == "," and depth == 2:
            if value_start is not None and calls[-1][2] is None:
                calls[-1][2] = i
            value_start = None
    out = []
    for name, start, end in calls:
        if end is None:
            end = len(text)
        if start is not None:
            end = len(text[start:end].rstrip()) + start
        out.append((name, start, end))
    return out
