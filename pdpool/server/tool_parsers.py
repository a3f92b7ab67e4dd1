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

import json
import re
from dataclasses import dataclass

from pdpool.server.tool_arguments import JsonStreamer, json_object_text
from pdpool.server.tool_pythonic import PythonCallsReader, python_calls

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


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _call_from_object(obj, argument_keys: tuple[str, ...]) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in argument_keys:
        if key in obj:
            arguments = json_object_text(obj[key])
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
        self.calls = PythonCallsReader()

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
                calls = python_calls(text[self.start:end + 1])
                if calls is None:
                    continue   # not an expression yet: the "]" is inside it
                if not self._settle(out, [Call(name, arguments) for name, arguments in calls]):
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
