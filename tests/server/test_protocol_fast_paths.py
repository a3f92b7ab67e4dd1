"""The request reader's fast paths (router overhead round 9) give what the plain paths give, on arbitrary bodies:
``read_json_body`` with one decoder made once against ``json.loads`` with its hooks per call, the flat-object
check of ``_nesting_within``, ``_sampling`` without its 14 reads when no sampling field is there (and
``SamplingParams.defaults`` against the constructor), and ``make_sampling_params`` validating once. The
references below answer what the code answered before, written another way."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from pdpool.engine.sampling_params import SamplingParams, SamplingParamsError
from pdpool.server import json_body, protocol
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


# ---- the references: what the code before the fast paths answered, written another way -----------------

def nesting_depth(value) -> int:
    """How deep arrays and objects nest (a scalar: 0), level by level."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def reference_read(raw: bytes):
    """``read_json_body``'s answer before round 9 (``json.loads`` with the hooks on every call), as an outcome."""
    refused = ("error", 400)
    if not raw:
        return (*refused, "the request body is empty; send a JSON object", None)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (*refused, f"the request body is not valid UTF-8 (byte {exc.start})", None)
    try:
        value = json.loads(text, parse_constant=json_body._refuse_constant, parse_float=json_body._finite_float)
        too_deep = nesting_depth(value) > json_body.MAX_JSON_DEPTH
    except RecursionError:
        too_deep = True
    except ValueError as exc:
        return (*refused, f"malformed JSON body: {str(exc)[:200]}", None)
    if too_deep:
        return (*refused, f"the JSON body is nested more than {json_body.MAX_JSON_DEPTH} levels deep", None)
    return ("ok", value) if isinstance(value, dict) else (*refused, "the request body must be a JSON object", None)


def validated_twice(kwargs: dict):
    """``make_sampling_params`` before round 9 (the constructor validates, then ``validate()`` again), as an
    outcome."""
    try:
        params = SamplingParams(**kwargs)
        params.validate()
        return "ok", params
    except SamplingParamsError as exc:
        return "error", 400, str(exc), exc.param
    except (TypeError, ValueError) as exc:
        return "error", 400, str(exc), None


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
    assert outcome(json_body.read_json_body, raw) == reference_read(raw)


def test_a_bom_is_refused_as_json_loads_refuses_it():
    raw = b"\xef\xbb\xbf" + b'{"prompt": "x"}'
    got, old = outcome(json_body.read_json_body, raw), reference_read(raw)
    assert got == old and got[0] == "error" and "BOM" in got[2]


@settings(max_examples=500, deadline=None)
@given(value=st.one_of(json_values(), st.dictionaries(st.text(max_size=4), json_values(), max_size=4)),
       limit=st.integers(0, 4))
def test_nesting_within_is_the_old_check(value, limit):
    assert json_body._nesting_within(value, limit) == (nesting_depth(value) <= limit)


sampling_bodies = st.sampled_from(["completion", "chat"]).flatmap(lambda kind: bodies(kind, MODEL))


limits = st.one_of(st.none(), st.integers(-2, 100), st.sampled_from([True, False, 1.0, 1.5, "4", [], 2**70]))


@settings(max_examples=600, deadline=None)
@given(body=sampling_bodies, max_tokens=limits, logprobs=limits, drop=st.booleans())
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
    return protocol.parse_chat(body, [MODEL], lambda messages, *flags: json.dumps(messages))


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
    assert outcome(protocol.make_sampling_params, kwargs) == validated_twice(kwargs)


@settings(max_examples=600, deadline=None)
@given(max_tokens=limits, logprobs=limits)
def test_sampling_params_defaults_is_the_constructor(max_tokens, logprobs):
    """The same object (fields, and their order in ``vars``), or the same refusal; its lists its own."""
    def made(f):
        def call():
            params = f()
            return params, list(vars(params))
        return call

    got = outcome(made(lambda: SamplingParams.defaults(max_tokens, logprobs)))
    assert got == outcome(made(lambda: SamplingParams(max_tokens=max_tokens, logprobs=logprobs)))
    if got[0] == "ok":
        other = SamplingParams.defaults(max_tokens, logprobs)
        assert got[1][0].stop is not other.stop and got[1][0].stop_token_ids is not other.stop_token_ids


def test_every_field_the_reads_use_is_in_the_fast_paths_list():
    """A body field that ``_sampling_fields`` reads but ``_SAMPLING_FIELDS`` lacks would be dropped by the fast
    path, for a body with that field alone: every ``SamplingParams`` field outside the list (and outside the two
    passed in) must leave ``_sampling_fields``' answer as an empty body's, whatever its value."""
    import dataclasses

    empty = outcome(protocol._sampling_fields, {}, 16, None)
    for name in (f.name for f in dataclasses.fields(SamplingParams)):
        if name in protocol._SAMPLING_FIELDS or name in ("max_tokens", "logprobs"):
            continue
        for value in ("x", -3, 0.5, True, [1], None):
            assert outcome(protocol._sampling_fields, {name: value}, 16, None) == empty, name


class _Overlapping(frozenset):
    """Stands for ``protocol._REFUSAL_FIELDS`` in the reference: every body is taken to hold a refusal field."""

    def isdisjoint(self, other) -> bool:
        return False


refusal_values = st.one_of(st.sampled_from([None, False, [], True, 0, "x", {"type": "text"}, {"type": "json_object"},
                                            "none", "auto", "required", [{"type": "function"}]]), json_values())


@settings(max_examples=600, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["completion", "chat"]))
def test_refusals_are_checked_whenever_a_refusal_field_is_there(data, kind):
    """``_common`` reads the refusal fields only when the body has one of them (router overhead round 12): the
    same answer as reading them on every body."""
    body = dict(data.draw(bodies(kind, MODEL)))
    body.update(data.draw(st.dictionaries(st.sampled_from(sorted(protocol._REFUSAL_FIELDS) + ["bogus"]),
                                          refusal_values, max_size=3)))
    got = outcome(_parse, kind, body)
    fast = protocol._REFUSAL_FIELDS
    protocol._REFUSAL_FIELDS = _Overlapping()
    try:
        old = outcome(_parse, kind, body)
    finally:
        protocol._REFUSAL_FIELDS = fast
    assert got == old


def test_every_field_the_refusals_read_is_in_the_list():
    seen = set()

    class Recorder(dict):
        def get(self, key, default=None):
            seen.add(key)
            return default

    for kind in ("completion", "chat"):
        protocol._refuse_constrained(Recorder(), kind)
        protocol._refuse_unimplemented(Recorder(), kind)
    assert seen and seen <= protocol._REFUSAL_FIELDS
