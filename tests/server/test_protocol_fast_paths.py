"""The request reader's fast paths (router overhead round 9) give what the plain paths give, on arbitrary bodies:
``read_json_body`` with one decoder made once against ``json.loads`` with its hooks per call, the flat-object
check of ``_nesting_within``, ``_sampling`` without its 14 reads when no sampling field is there, and
``make_sampling_params`` validating once. The references below are the code as it was before."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from pdpool.engine.sampling_params import SamplingParams, SamplingParamsError
from pdpool.server import protocol
from pdpool.server.errors import APIError

from fuzz_strategies import bodies, json_values, raw_bodies

MODEL = "demo"


def outcome(f, *args):
    """What ``f`` returns, or the error it raises, in a comparable form."""
    try:
        return "ok", f(*args)
    except APIError as exc:
        return "error", exc.status, exc.message, exc.param
    except (SamplingParamsError, TypeError, ValueError) as exc:
        return "error", type(exc).__name__, str(exc), getattr(exc, "param", None)


# ---- the references: the code before the fast paths ----------------------------------------------------

def old_nesting_within(value, limit: int) -> bool:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            if protocol._LEAVES.issuperset(map(type, v)):
                continue
            children = v
        else:
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def old_read_json_body(raw: bytes) -> dict:
    if not raw:
        raise APIError("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=protocol._refuse_constant, parse_float=protocol._finite_float)
    except RecursionError:
        body = protocol._TOO_DEEP
    except ValueError as exc:
        raise APIError(f"malformed JSON body: {str(exc)[:200]}") from None
    if body is protocol._TOO_DEEP or not old_nesting_within(body, protocol.MAX_JSON_DEPTH):
        raise APIError(f"the JSON body is nested more than {protocol.MAX_JSON_DEPTH} levels deep")
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def old_make_sampling_params(kwargs: dict) -> SamplingParams:
    try:
        params = SamplingParams(**kwargs)
        params.validate()
    except SamplingParamsError as exc:
        raise APIError(str(exc), param=getattr(exc, "param", None)) from None
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc)) from None
    return params


# ---- the properties ---------------------------------------------------------------------------------------

def _json_bytes(value) -> bytes:
    return json.dumps(value).encode()


raw_inputs = st.one_of(
    raw_bodies(MODEL).map(lambda pair: pair[0]),
    st.sampled_from(["completion", "chat"]).flatmap(lambda kind: bodies(kind, MODEL)).map(_json_bytes),
    json_values().map(_json_bytes),
    json_values().map(lambda v: b"\xef\xbb\xbf" + _json_bytes({"a": v})),
    st.binary(max_size=40))


@settings(max_examples=500, deadline=None)
@given(raw=raw_inputs)
def test_read_json_body_is_the_old_reader(raw):
    assert outcome(protocol.read_json_body, raw) == outcome(old_read_json_body, raw)


def test_a_bom_is_refused_as_json_loads_refuses_it():
    raw = b"\xef\xbb\xbf" + b'{"prompt": "x"}'
    got, old = outcome(protocol.read_json_body, raw), outcome(old_read_json_body, raw)
    assert got == old and got[0] == "error" and "BOM" in got[2]


@settings(max_examples=500, deadline=None)
@given(value=st.one_of(json_values(), st.dictionaries(st.text(max_size=4), json_values(), max_size=4)),
       limit=st.integers(0, 4))
def test_nesting_within_is_the_old_check(value, limit):
    assert protocol._nesting_within(value, limit) == old_nesting_within(value, limit)


sampling_bodies = st.sampled_from(["completion", "chat"]).flatmap(lambda kind: bodies(kind, MODEL))


@settings(max_examples=600, deadline=None)
@given(body=sampling_bodies, max_tokens=st.one_of(st.none(), st.integers(1, 100)),
       logprobs=st.one_of(st.none(), st.integers(0, protocol.MAX_LOGPROBS)), drop=st.booleans())
def test_sampling_is_every_field_read(body, max_tokens, logprobs, drop):
    """The fast path (no sampling field in the body) and the reads of every field agree on any body; ``drop``
    removes the sampling fields so that the fast path is taken often."""
    if drop:
        body = {k: v for k, v in body.items() if k not in protocol._SAMPLING_FIELDS}
    assert outcome(protocol._sampling, body, max_tokens, logprobs) == \
        outcome(protocol._sampling_fields, body, max_tokens, logprobs)


def _parse(kind: str, body: dict):
    if kind == "completion":
        return protocol.parse_completion(body, [MODEL])
    return protocol.parse_chat(body, [MODEL], lambda messages, add_generation_prompt: json.dumps(messages))


@settings(max_examples=400, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["completion", "chat"]), drop=st.booleans())
def test_parse_is_the_parse_that_reads_every_field(data, kind, drop):
    """The whole parse of a completion or chat body against the same parse with every sampling field read."""
    body = data.draw(bodies(kind, MODEL))
    if drop:
        body = {k: v for k, v in body.items() if k not in protocol._SAMPLING_FIELDS}
    got = outcome(_parse, kind, body)
    fast = protocol._sampling
    protocol._sampling = protocol._sampling_fields
    try:
        old = outcome(_parse, kind, body)
    finally:
        protocol._sampling = fast
    assert got == old


kwargs_values = st.one_of(json_values(), st.sampled_from([None, 0, 1, -1, 0.5, 2.5, True, "x", [], ["a"], [""]]))
sampling_kwargs = st.dictionaries(
    st.sampled_from(["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                     "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "include_stop_str_in_output", "skip_special_tokens", "n", "bogus"]),
    kwargs_values, max_size=6)


@settings(max_examples=600, deadline=None)
@given(kwargs=sampling_kwargs)
def test_make_sampling_params_validates_once_as_twice(kwargs):
    assert outcome(protocol.make_sampling_params, kwargs) == outcome(old_make_sampling_params, kwargs)
