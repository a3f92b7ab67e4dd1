"""A request's body, bytes to a JSON object: the limits the router and the nodes share (size, head, time), the
``Content-Encoding`` decoding, and the one strict JSON reader of every route.

``read_json_body`` reads strict UTF-8 and strict JSON (no ``NaN``/``Infinity``, no number that overflows to inf), at
most ``MAX_JSON_DEPTH`` levels, an object at the top. Anything else is a 400, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib

from aiohttp import web

from pdpool.engine.sampling_params import short_repr
from pdpool.server.errors import APIError

MAX_JSON_DEPTH = 32  # an OpenAI body needs about 5 (messages[i].content[j].text); deeper is an attack or a bug
MAX_BODY_BYTES = 64 * 1024 * 1024   # a request body, as sent and decompressed: the router's and the nodes' limit
MAX_HEAD_BYTES = 64 * 1024   # a request's line and headers (a node: each line): the router's and the nodes' limit (431)
REQUEST_SECONDS = 75.0   # a request must arrive whole within this (408 past it): the router's and the nodes' limit


async def read_json(request) -> dict:
    """The body of an aiohttp request (the app reads it compressed: ``decode_content``) as a JSON object
    (``request_json``). A ``Content-Length`` over ``MAX_BODY_BYTES`` is a 413 at once, before the body is read; a
    body not whole within ``REQUEST_SECONDS`` a 408, as the router answers both."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise body_too_large()
    try:
        async with asyncio.timeout(REQUEST_SECONDS):   # a client that stops mid-body would hold its handler for ever
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:   # a chunked body past aiohttp's client_max_size (MAX_BODY_BYTES)
        raise body_too_large() from None
    except TimeoutError:
        raise APIError(f"the request was not received within {REQUEST_SECONDS:g} s", status=408) from None
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None:
        raw = decode_content(raw, encoding)
    return request_json(raw, request.headers.get("Content-Type"))


def request_json(raw: bytes, content_type: str | None) -> dict:
    """A request's body as a JSON object (``read_json_body``), the router's and the nodes'. A ``Content-Type``
    other than JSON is a 400; none at all is taken as JSON, as simple clients send none."""
    if content_type is not None and not _is_json_type(content_type):
        raise APIError(f"Content-Type must be application/json, got {short_repr(content_type)}")
    return read_json_body(raw)


def body_too_large() -> APIError:
    return APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)


_INFLATE_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode_content(raw: bytes, content_encoding: str) -> bytes:
    """``raw`` decoded by its ``Content-Encoding``: gzip, deflate or identity, the last listed undone first, at
    most ``MAX_BODY_BYTES`` decoded (413 past it, a compressed bomb included). Another coding is a 415; bytes
    that are not what the header says a 400."""
    for coding in reversed(content_encoding.lower().split(",")):
        coding = coding.strip()
        if coding in ("identity", ""):
            continue
        wbits = _INFLATE_WBITS.get(coding)
        if wbits is None:
            raise APIError(f"Content-Encoding {short_repr(coding)} is not supported; send gzip, deflate or "
                           "identity", status=415)
        inflater = zlib.decompressobj(wbits)
        try:
            decoded = inflater.decompress(raw, MAX_BODY_BYTES + 1)
        except zlib.error as exc:
            raise APIError(f"the request body is not valid {coding} data ({exc})") from None
        if len(decoded) > MAX_BODY_BYTES:
            raise body_too_large()
        if not inflater.eof:
            raise APIError(f"the request body is not valid {coding} data (it ends before its end marker)")
        raw = decoded
    return raw


def read_json_body(raw: bytes) -> dict:
    """``raw`` as a JSON object, or ``APIError`` (400) saying what is wrong with it."""
    if not raw:
        raise APIError("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        if text.startswith("\ufeff"):   # json.loads' own check, kept with the decoder below
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        body = _DECODER.decode(text)
    except RecursionError:
        body = _TOO_DEEP  # deeper than the interpreter's recursion limit: refused just below
    except ValueError as exc:  # JSONDecodeError, a refused constant or number, an int of too many digits
        raise APIError(f"malformed JSON body: {str(exc)[:200]}") from None
    if body is _TOO_DEEP or not _nesting_within(body, MAX_JSON_DEPTH):
        raise APIError(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep")
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def _finite_float(literal: str) -> float | int:
    """A JSON number written with a fraction or an exponent; an integral one (``350.0``, ``1e3``) is that int, as
    JSON Schema's ``integer`` and vLLM's lax parsing take it (a token id list ``[350.0]``); float fields read any
    number as a float."""
    x = float(literal)
    if math.isinf(x):
        raise ValueError(f"the number {short_repr(literal, 40)} is out of range (it would be infinite)")
    return int(x) if x.is_integer() else x


# json.loads with these hooks makes a decoder (and its C scanner) per call: one, made once, reads every body
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_LEAVES = frozenset((str, int, float, bool, type(None)))
_TOO_DEEP = object()


def _nesting_within(value, limit: int) -> bool:
    """Whether ``value``'s arrays and objects nest at most ``limit`` deep. Iterative, and a list of scalars (a
    long token-id prompt) is checked in C, so a large body costs little."""
    if type(value) is dict and _LEAVES.issuperset(map(type, value.values())):
        return limit >= 1             # a flat object (most bodies: model, prompt, max_tokens, ...)
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            if _LEAVES.issuperset(map(type, v)):
                continue
            children = v
        else:
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True
