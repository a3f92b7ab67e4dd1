"""A tool call's arguments as JSON text, as vLLM serializes them (``json.dumps(..., ensure_ascii=False)``): whole
(``json_object_text``) and streamed as the model writes them (``JsonStreamer``), whose pieces join to the same
text in any chunking."""

from __future__ import annotations

import json
import re


def json_object_text(value) -> str | None:
    """``value`` (a dict) as arguments text, or None when it is no JSON object (NaN and the like included)."""
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


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
