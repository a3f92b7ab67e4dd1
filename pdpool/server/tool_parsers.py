"""Tool calls in the model's own format, for ``tool_choice`` ``"auto"``: vLLM's ``--tool-call-parser`` formats.

A parser reads an answer's text as it grows and turns it into pieces, in order: content (``str``) and calls
(``Call``). ``feed(text)`` returns the pieces that no later text can change; ``feed(text, final=True)`` the rest.
A whole answer is one final feed, so a streamed answer's pieces are the whole answer's, in any chunking. Text
that is not a valid call is content, never an error; a call may be held back until it is complete, so each call
comes out once, with its whole arguments (JSON, re-serialized as vLLM does: ``json.dumps(..., ensure_ascii=False)``).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after optional content. The
  last one may lack its closing tag at the end of the answer. Whitespace right after a call is dropped.
- ``llama3_json``: the answer is ``{"name": ..., "parameters" (or "arguments"): {...}}`` objects, separated by
  ``;`` (or whitespace), optionally after ``<|python_tag|>``. An answer that does not start with one is content.
- ``pythonic``: the answer is a Python list of calls with keyword arguments, ``[f(a=1), g(b="x")]``; values are
  literals (JSON's ``true``/``false``/``null`` too). An answer that does not start with one is content.

Where a call is followed by text that is no call, that text is content (vLLM drops it or turns the whole answer
into content: docs/openai_compat.md).
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "pythonic")


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str   # a JSON object's text


Piece = str | Call


def make_parser(name: str) -> "ToolCallParser":
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser}[name]()


def parse_whole(name: str, text: str) -> tuple[str | None, list[Call]]:
    """A whole answer's content (None when it holds calls and nothing else) and calls."""
    pieces = make_parser(name).feed(text, final=True)
    calls = [p for p in pieces if isinstance(p, Call)]
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None) if calls else content, calls


def _json_object_text(value) -> str | None:
    """``value`` (a dict) as arguments text, or None when it is no JSON object (NaN and the like included)."""
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _call_from_object(obj, argument_keys: tuple[str, ...]) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in argument_keys:
        if key in obj:
            arguments = _json_object_text(obj[key])
            return Call(obj["name"], arguments) if arguments is not None else None
    return None


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """How many of ``text``'s last characters (from ``start`` on) begin ``tag``: held back, the tag may follow."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class ToolCallParser:
    """``self.text[:self.pos]`` has been turned into pieces."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0

    def feed(self, new_text: str, final: bool = False) -> list[Piece]:
        self.text += new_text
        out: list[Piece] = []
        self._advance(out, final)
        return [p for p in out if p != ""]

    def _advance(self, out: list[Piece], final: bool) -> None:
        raise NotImplementedError

    def _rest_as_content(self, out: list[Piece]) -> None:
        out.append(self.text[self.pos:])
        self.pos = len(self.text)


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.after_call = False      # the last tag pair held a call: whitespace after it is no content
        self.live_segment = False    # the text since that call holds more than whitespace: all of it is content

    def _advance(self, out: list[Piece], final: bool) -> None:
        text = self.text
        while True:
            start = text.find(self.OPEN, self.pos)
            if self.pos < start or start < 0:   # text before the next tag (or none yet)
                end = start if start >= 0 else (len(text) if final else
                                                len(text) - _partial_suffix(text, self.pos, self.OPEN))
                segment = text[self.pos:end]
                if not self.after_call or self.live_segment or segment.strip():
                    self.live_segment = self.after_call
                    out.append(segment)
                    self.pos = end
                elif start >= 0 or final:   # whitespace between calls, or after the last: dropped
                    self.pos = end
                if start < 0:
                    return
            self.live_segment = False
            body = start + len(self.OPEN)
            close = text.find(self.CLOSE, body)
            if close < 0 and not final:
                return
            end = len(text) if close < 0 else close + len(self.CLOSE)
            try:
                call = _call_from_object(_DECODER.decode(text[body:end if close < 0 else close].strip()),
                                         ("arguments",))
            except (ValueError, RecursionError):
                call = None
            out.append(call if call is not None else text[start:end])
            self.after_call = call is not None
            self.pos = end


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"     # start | object (one is being read from self.start) | between | content
        self.start = 0
        self.tried = 0           # "}"s before this offset were tried as an object's end

    def _advance(self, out: list[Piece], final: bool) -> None:
        text = self.text
        while True:
            if self.state == "content":
                self._rest_as_content(out)
                return
            if self.state in ("start", "between"):
                i = _skip_space(text, self.pos)
                if self.state == "start":
                    if text.startswith(self.TAG, i):
                        i = _skip_space(text, i + len(self.TAG))
                    elif self.TAG.startswith(text[i:]) and i < len(text) and not final:
                        return   # perhaps the tag
                elif text.startswith(";", i):
                    i = _skip_space(text, i + 1)
                if i == len(text):
                    if final:   # only whitespace (and a tag) left: content if nothing was called, else dropped
                        if self.state == "start":
                            self._rest_as_content(out)
                        self.pos = len(text)
                    return
                if text[i] != "{":
                    self.state = "content"
                    continue
                self.state, self.start, self.tried = "object", i, i
            # an object from self.start: decoded once a "}" arrives that may end it
            last = text.rfind("}", self.tried)
            if last < 0 and not final:
                return
            self.tried = len(text)
            try:
                obj, end = _DECODER.raw_decode(text, self.start)
            except (ValueError, RecursionError):
                if final:
                    self.state = "content"
                    continue
                return
            call = _call_from_object(obj, ("arguments", "parameters"))
            if call is None:
                self.state = "content"
                continue
            out.append(call)
            self.pos, self.state = end, "between"


class PythonicParser(ToolCallParser):

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"     # start | list (read from self.start) | after | content
        self.start = 0
        self.tried = 0           # "]"s before this offset were tried as the list's end
        self.live_segment = False

    def _advance(self, out: list[Piece], final: bool) -> None:
        text = self.text
        if self.state == "start":
            i = _skip_space(text, self.pos)
            if i == len(text):
                if final:
                    self._rest_as_content(out)
                return
            if text[i] != "[":
                self.state = "content"
            else:
                self.state, self.start, self.tried = "list", i, i
        if self.state == "list":
            while True:
                end = text.find("]", self.tried)
                if end < 0:
                    self.tried = len(text)
                    break
                self.tried = end + 1
                calls = _python_calls(text[self.start:end + 1])
                if calls is None:
                    continue   # not an expression yet: the "]" is inside it
                if not calls:
                    self.state = "content"
                    break
                out.extend(calls)
                self.pos, self.state = end + 1, "after"
                break
            if self.state == "list":
                if not final:
                    return
                self.state = "content"
        if self.state == "content":
            self._rest_as_content(out)
        elif self.state == "after":
            segment = text[self.pos:]
            if self.live_segment or segment.strip():
                self.live_segment = True
                self._rest_as_content(out)
            elif final:
                self.pos = len(text)


_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr):
    """A keyword argument's value, as JSON sees it (vLLM's literals: tuples are lists, JSON's names are theirs)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            if isinstance(node.value, float) and not math.isfinite(node.value):
                raise _NotLiteral
            return node.value
    elif isinstance(node, ast.Dict):
        keys = [k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None for k in node.keys]
        if None in keys:
            raise _NotLiteral
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(v) for v in node.elts]
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    raise _NotLiteral


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _python_calls(source: str) -> list[Call] | None:
    """``source`` (from "[" to a "]") as calls; None when it is no expression (yet), [] when it is one but not
    a non-empty list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(k.arg is None for k in node.keywords):
            return []
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
        except (_NotLiteral, RecursionError):
            return []
        text = _json_object_text(arguments)
        if text is None:
            return []
        calls.append(Call(name, text))
    return calls
