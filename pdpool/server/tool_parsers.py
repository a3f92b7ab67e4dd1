"""Tool calls in the model's own format, for ``tool_choice`` ``"auto"``: vLLM's ``--tool-call-parser`` formats.

A parser reads an answer's text as it grows and turns it into pieces, in order: content (``str``), a call's start
(``CallStart``, its name) and pieces of its arguments (``Arguments``). ``feed(text)`` returns the pieces that no
later text can change; ``feed(text, final=True)`` the rest. A whole answer is one final feed, its calls' arguments
JSON re-serialized as vLLM does (``json.dumps(..., ensure_ascii=False)``); a stream's argument pieces are pieces of
that same text (``JsonStreamer``), so they join to the whole answer's arguments in any chunking. Text that is not
a valid call is content, never an error.

A call starts once its name is certain (hermes and llama3_json: an object that opens with ``{"name": "..."``;
pythonic: its first keyword argument, or its ``)``); its arguments stream when they follow the name (``"arguments":
{``), else they come whole with the object. A call that turns out invalid after it started (a cut answer, text
after its arguments, no arguments) has no more pieces, where the whole answer makes it content: a stream cannot take
back what it sent (``broken`` counts them).

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
import keyword
import math
import re
import unicodedata
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "pythonic")


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str   # a JSON object's text


@dataclass(frozen=True)
class CallStart:
    name: str


@dataclass(frozen=True)
class Arguments:
    text: str   # the next piece of the last started call's arguments


Piece = str | CallStart | Arguments


def make_parser(name: str) -> "ToolCallParser":
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser}[name]()


def parse_whole(name: str, text: str) -> tuple[str | None, list[Call]]:
    """A whole answer's content (None when it holds calls and nothing else) and calls."""
    calls: list[list[str]] = []
    content = ""
    for piece in make_parser(name).feed(text, final=True):
        if isinstance(piece, str):
            content += piece
        elif isinstance(piece, CallStart):
            calls.append([piece.name, ""])
        else:
            calls[-1][1] += piece.text
    return (content or None) if calls else content, [Call(n, a) for n, a in calls]


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
    """``self.text[:self.pos]`` has been turned into pieces; ``self.streamed`` holds the calls of the construct at
    ``self.pos`` that started streaming, each as [name, arguments sent]."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.streamed: list[list[str]] = []
        self.arguments: JsonStreamer | None = None   # the last streamed call's arguments, read from args_start
        self.args_start = 0
        self.broken = 0   # calls that started streaming and turned out invalid

    def feed(self, new_text: str, final: bool = False) -> list[Piece]:
        self.text += new_text
        out: list[Piece] = []
        self._advance(out, final)
        return [p for p in out if p != "" and p != Arguments("")]

    def _advance(self, out: list[Piece], final: bool) -> None:
        raise NotImplementedError

    def _rest_as_content(self, out: list[Piece]) -> None:
        out.append(self.text[self.pos:])
        self.pos = len(self.text)

    def _stream_object(self, out: list[Piece], start: int, limit: int, keys: tuple[str, ...]) -> None:
        """A ``{"name": ..., "arguments": {...}}`` object from ``start``, unfinished: once its name is certain the
        call starts (vLLM's first entry); once its arguments follow, what of them ``self.text[:limit]`` makes
        certain. Arguments after other keys come whole with the object."""
        if not self.streamed:
            head = _NAME.match(self.text, start, limit)
            try:
                name = json.loads(head["name"]) if head else None
            except ValueError:
                return
            if not name:
                return
            self._start(out, name)
            self.args_start = head.end()
        if self.arguments is None:
            follows = _ARGUMENTS.match(self.text, self.args_start, limit)
            if follows is None or follows["key"] not in keys:
                return
            self.arguments, self.args_start = JsonStreamer(), follows.end()
        if limit > self.args_start + self.arguments.consumed:
            self._send(out, self.arguments.feed(self.text[self.args_start + self.arguments.consumed:limit]))

    def _start(self, out: list[Piece], name: str) -> None:
        self.streamed.append([name, ""])
        out.append(CallStart(name))

    def _send(self, out: list[Piece], text: str) -> None:
        self.streamed[-1][1] += text
        out.append(Arguments(text))

    def _settle(self, out: list[Piece], calls: list[Call] | None) -> bool:
        """The construct at ``self.pos`` is complete: ``calls`` (None: no valid call). Each call that streamed gets
        the rest of its arguments, the others come whole. False when nothing had streamed and there is no call."""
        streamed, self.streamed, self.arguments = self.streamed, [], None
        calls = calls or []
        if not streamed and not calls:
            return False
        for i, call in enumerate(calls):
            if i < len(streamed):
                name, sent = streamed[i]
                if name != call.name or not call.arguments.startswith(sent):
                    self.broken += 1
                    return True
                out.append(Arguments(call.arguments[len(sent):]))
            else:
                out += [CallStart(call.name), Arguments(call.arguments)]
        self.broken += len(streamed) > len(calls)
        return True


_NAME = re.compile(r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")')
_ARGUMENTS = re.compile(r'\s*,\s*"(?P<key>arguments|parameters)"\s*:\s*(?=\{)')


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
            if close < 0 and not final:   # held back: a closing tag's start, which no argument may hold
                limit = len(text) - _partial_suffix(text, body, self.CLOSE)
                self._stream_object(out, _skip_space(text, body), limit, ("arguments",))
                return
            end = len(text) if close < 0 else close + len(self.CLOSE)
            try:
                call = _call_from_object(_DECODER.decode(text[body:end if close < 0 else close].strip()),
                                         ("arguments",))
            except (ValueError, RecursionError):
                call = None
            self.after_call = self._settle(out, None if call is None else [call])
            if not self.after_call:
                out.append(text[start:end])
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
            if not final:
                self._stream_object(out, self.start, len(text), ("arguments", "parameters"))
                if self.arguments is not None and not (self.arguments.done or self.arguments.broken):
                    return   # its arguments are not complete: neither is the object
            last = text.rfind("}", self.tried)
            if last < 0 and not final:
                return
            self.tried = len(text)
            try:
                obj, end = _DECODER.raw_decode(text, self.start)
            except (ValueError, RecursionError):
                if final:
                    if self._settle(out, None):   # streamed, then no call: what follows is content
                        self.pos = len(text)
                    self.state = "content"
                    continue
                return
            call = _call_from_object(obj, ("arguments", "parameters"))
            if not self._settle(out, None if call is None else [call]):
                self.state = "content"
                continue
            self.pos, self.state = end, "between"


class PythonicParser(ToolCallParser):

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"     # start | list (read from self.start) | after | content
        self.start = 0
        self.tried = 0           # "]"s before this offset were tried as the list's end
        self.live_segment = False
        self.calls = _PythonCallsReader()

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
                self.calls.pos = i + 1
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
                if not self._settle(out, calls):
                    self.state = "content"
                    break
                self.pos, self.state = end + 1, "after"
                break
            if self.state == "list":
                if not final:
                    self._stream_calls(out)
                    return
                if self._settle(out, None):
                    self.pos, self.state = len(text), "after"
                else:
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

    def _stream_calls(self, out: list[Piece]) -> None:
        """The unfinished list's calls, one keyword argument at a time: a call starts with its first argument (or
        its ``)``), each argument comes once its "," or ")" arrives."""
        for name, piece in self.calls.read(self.text):
            if name is not None:
                self._start(out, name)
            self._send(out, piece)


class _PythonCallsReader:
    """Reads ``f(a=1, b="x"), g()`` from ``pos`` on, as it grows: each call's name and its arguments' JSON text in
    pieces (``{"a": 1``, ``, "b": "x"``, ``}``); a plain string's characters as they come (``, "b": "``, ``x``).
    A call that is not one (a positional argument, a value that is no literal, a repeated keyword) stops it."""

    _NAME = re.compile(r"\s*(?P<comma>,\s*)?(?P<name>[^\W\d]\w*(?:\.[^\W\d]\w*)*)\s*\(")
    _OPEN_STRING = re.compile(r"\s*(?P<key>[^\W\d]\w*)\s*=\s*(?P<quote>[\"'])(?P<chars>[^\"'\\\n]+)")

    def __init__(self) -> None:
        self.pos = 0
        self.stopped = False
        self.calls = 0
        self.name: str | None = None     # the open call's name; None between calls
        self.keys: list[str] = []        # the open call's keywords so far
        self.started = False             # the open call's start has been sent
        self.arg_start = 0
        self.depth = 0
        self.quote: str | None = None
        self.sent = ""                   # the open argument's text sent before its end (a string's start)

    def read(self, text: str) -> list[tuple[str | None, str]]:
        """(the call's name when it starts here, else None; a piece of its arguments), in order."""
        out: list[tuple[str | None, str]] = []
        while not self.stopped:
            if self.name is None:
                head = self._NAME.match(text, self.pos)
                if head is None or bool(head["comma"]) != (self.calls > 0):
                    return out
                self.name, self.keys, self.started = unicodedata.normalize("NFKC", head["name"]), [], False
                self.pos = self.arg_start = head.end()
                self.depth, self.quote = 0, None
            i = self._argument_end(text)
            if i is None:
                early = self._string_start(text)
                if early:
                    out.append((self._start(), early))
                return out
            source = text[self.arg_start:i]
            closes = text[i] == ")"
            if source.strip() or not closes:
                piece = self._argument(source)
                if piece is None or not piece.startswith(self.sent):
                    self.stopped = True
                    return out
                out.append((self._start(), piece[len(self.sent):]))
                self.sent = ""
            if closes:
                out.append((self._start(), "" if self.keys else "{"))
                out.append((None, "}"))
                self.name, self.calls = None, self.calls + 1
            self.pos = self.arg_start = i + 1
        return out

    def _string_start(self, text: str) -> str:
        """What the open argument's unfinished plain string (``b="x...``) makes certain, not yet sent."""
        match = self._OPEN_STRING.fullmatch(text, self.arg_start, self.pos)
        key = match and unicodedata.normalize("NFKC", match["key"])   # as Python reads an identifier
        if match is None or key in self.keys or keyword.iskeyword(key):
            return ""
        separator = ", " if self.keys else "{"
        prefix = f'{separator}{json.dumps(key, ensure_ascii=False)}: "' \
                 f'{json.dumps(match["chars"], ensure_ascii=False)[1:-1]}'
        piece, self.sent = prefix[len(self.sent):], prefix
        return piece

    def _start(self) -> str | None:
        started, self.started = self.started, True
        return None if started else self.name

    def _argument_end(self, text: str) -> int | None:
        """The offset of the "," or ")" that ends the open call's argument, once it has come."""
        i = self.pos
        while i < len(text):
            ch = text[i]
            if self.quote is not None:
                if ch == "\\":
                    if i + 1 == len(text):
                        break
                    i += 2
                    continue
                if text.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = None
                    continue
                i += 1
                continue
            if ch in "'\"":
                if len(text) - i < 3 and text[i:] == ch * (len(text) - i):
                    break   # perhaps a triple quote
                self.quote = ch * 3 if text.startswith(ch * 3, i) else ch
                i += len(self.quote)
                continue
            if ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                if self.depth == 0:
                    self.pos = i
                    return i if ch == ")" else self._stop()
                self.depth -= 1
            elif ch == "," and self.depth == 0:
                self.pos = i
                return i
            elif ch == "#":
                return self._stop()
            i += 1
        self.pos = i
        return None

    def _stop(self) -> None:
        self.stopped = True
        return None

    def _argument(self, source: str) -> str | None:
        """One keyword argument's JSON text, with its separator; None when it is none."""
        try:
            tree = ast.parse(f"f({source})", mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if tree.args or len(tree.keywords) != 1 or tree.keywords[0].arg in (None, *self.keys):
            return None
        keyword = tree.keywords[0]
        try:
            value = json.dumps(_literal(keyword.value), ensure_ascii=False, allow_nan=False)
        except (_NotLiteral, ValueError, RecursionError):
            return None
        first = not self.keys
        self.keys.append(keyword.arg)
        return ("{" if first else ", ") + json.dumps(keyword.arg, ensure_ascii=False) + ": " + value


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


# ---- arguments streamed as the model writes them -------------------------------------------------------------

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_CLOSER = {"{": "}", "[": "]"}


class JsonStreamer:
    """One JSON value's text as it grows -> the pieces of ``json.dumps(json.loads(text), ensure_ascii=False)`` that
    no later text can change: a number or a name once it ends, a string's characters once each escape is whole (a
    surrogate pair's both halves), ", " and ": " for the separators. Text after the value is left unconsumed.

    ``done``: the value is complete. ``broken``: the text is no JSON, or repeats a key (json.loads keeps the
    last value in the first one's place, which no stream can know); nothing more comes out."""

    def __init__(self) -> None:
        self.stack: list[str] = []        # the open containers: "{" or "["
        self.keys: list[set[str]] = []    # per open object: its keys so far
        self.expect = "value"             # value | value_or_close | key | key_or_close | colon | after
        self.scalar: str | None = None    # a number or true/false/null being read
        self.raw: str | None = None       # a string being read: its text not yet decoded
        self.key: list[str] | None = None  # a key being read: its characters so far
        self.consumed = 0
        self.done = self.broken = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if self.done or self.broken:
                break
            self._char(ch, out)
            self.consumed += not self.broken
        if self.raw is not None and not self.broken:
            out.append(self._decode(closing=False))
        return "".join(out)

    def finish(self) -> str:
        """The text ends here: a number at its very end is whole."""
        return self._end_scalar() if self.scalar is not None and not self.broken else ""

    def _char(self, ch: str, out: list[str]) -> None:
        if self.raw is not None:
            trailing = len(self.raw) - len(self.raw.rstrip("\\"))
            if ch == '"' and trailing % 2 == 0:
                out.append(self._decode(closing=True))
                if not self.broken:
                    out.append('"')
                    self._end_string()
            else:
                self.raw += ch
            return
        if self.scalar is not None:
            if ch.isalnum() or ch in "+-.":
                self.scalar += ch
                return
            out.append(self._end_scalar())
            if self.broken:
                return
        if ch in " \t\n\r":
            return
        expect = self.expect
        if expect == "value_or_close" and ch == "]" or expect == "key_or_close" and ch == "}" \
                or expect == "after" and self.stack and ch == _CLOSER[self.stack[-1]]:
            out.append(ch)
            if self.stack.pop() == "{":
                self.keys.pop()
            self._end_value()
        elif expect in ("value", "value_or_close") and ch in "{[":
            out.append(ch)
            self.stack.append(ch)
            if ch == "{":
                self.keys.append(set())
            self.expect = "key_or_close" if ch == "{" else "value_or_close"
        elif expect in ("value", "value_or_close") and ch == '"' or expect in ("key", "key_or_close") and ch == '"':
            out.append('"')
            self.raw = ""
            self.key = [] if expect in ("key", "key_or_close") else None
        elif expect in ("value", "value_or_close") and (ch == "-" or ch.isalnum()):
            self.scalar = ch
        elif expect == "colon" and ch == ":":
            out.append(": ")
            self.expect = "value"
        elif expect == "after" and ch == "," and self.stack:
            out.append(", ")
            self.expect = "key" if self.stack[-1] == "{" else "value"
        else:
            self.broken = True

    def _end_value(self) -> None:
        self.expect = "after"
        self.done = not self.stack

    def _end_string(self) -> None:
        self.raw = None
        if self.key is None:
            self._end_value()
            return
        key, self.key = "".join(self.key), None
        if key in self.keys[-1]:
            self.broken = True
        self.keys[-1].add(key)
        self.expect = "colon"

    def _end_scalar(self) -> str:
        text, self.scalar = self.scalar, None
        if text in ("true", "false", "null"):
            self._end_value()
            return text
        try:
            if not _NUMBER.fullmatch(text):
                raise ValueError(text)
            number = json.dumps(json.loads(text), allow_nan=False)   # 1e999 is infinity: no JSON
        except (ValueError, OverflowError):   # an int past Python's digit limit too
            self.broken = True
            return ""
        self._end_value()
        return number

    def _decode(self, closing: bool) -> str:
        """The string's characters whose escapes are whole, re-escaped as json.dumps does; the rest stays raw."""
        raw, i, chars = self.raw, 0, []
        while i < len(raw):
            if raw[i] != "\\":
                if raw[i] < " ":   # a raw control character: json.loads refuses it
                    self.broken = True
                    return ""
                chars.append(raw[i])
                i += 1
                continue
            escape = raw[i + 1:i + 2]
            if escape in _ESCAPES and escape:
                chars.append(_ESCAPES[escape])
                i += 2
                continue
            code = _hex4(raw, i + 2) if escape == "u" else None
            if code is None:
                if escape not in ("", "u") or len(raw) >= i + 6 or closing:
                    self.broken = True
                    return ""
                break   # the escape is not whole yet
            if 0xD800 <= code <= 0xDBFF:   # a pair's first half: json.loads joins a \uDCxx right after it
                if len(raw) < i + 12 and not closing:
                    break
                low = _hex4(raw, i + 8) if raw[i + 6:i + 8] == "\\u" else None
                if low is not None and 0xDC00 <= low <= 0xDFFF:
                    chars.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    i += 12
                    continue
            chars.append(chr(code))
            i += 6
        self.raw = raw[i:]
        if self.key is not None:
            self.key += chars
        return json.dumps("".join(chars), ensure_ascii=False)[1:-1]


def _hex4(text: str, i: int) -> int | None:
    digits = text[i:i + 4]
    if len(digits) < 4 or not all(c in "0123456789abcdefABCDEF" for c in digits):
        return None
    return int(digits, 16)
