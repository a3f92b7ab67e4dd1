"""The ``pythonic`` tool-call format's Python side: a list of calls with keyword arguments (``[f(a=1),
g(b="x")]``) read as calls whole (``python_calls``) or as it grows (``PythonCallsReader``); values are literals,
JSON's ``true``/``false``/``null`` too, and become the arguments' JSON text."""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
import unicodedata

from pdpool.server.tool_arguments import json_object_text


class PythonCallsReader:
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


def python_calls(source: str) -> list[tuple[str, str]] | None:
    """``source`` (from "[" to a "]") as calls, each its name and arguments' JSON text; None when it is no
    expression (yet), [] when it is one but not a non-empty list of calls with literal keyword arguments."""
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
        text = json_object_text(arguments)
        if text is None:
            return []
        calls.append((name, text))
    return calls
