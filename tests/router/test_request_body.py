"""The body forwarded to a node: spliced from the client's bytes, it must be the same JSON object as the
re-encoded one (the node parses it with the same rules)."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from pdpool.router.request import TOKEN_IDS_FIELD, RoutedRequest

values = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=20),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=3), max_leaves=8)
bodies = st.dictionaries(st.text(max_size=8).filter(lambda k: k != TOKEN_IDS_FIELD), values, min_size=1,
                         max_size=6)


def make_request(body: dict, raw: bytes, ids: list[list[int]]) -> RoutedRequest:
    return RoutedRequest("/v1/completions", body, None, ids, "rid", raw)


@settings(max_examples=200, deadline=None)
@given(body=bodies, indent=st.sampled_from([None, 0, 2]), trailing=st.sampled_from(["", " ", "\n", "\r\n\t "]),
       ids=st.lists(st.lists(st.integers(0, 50000), min_size=1, max_size=40), min_size=1, max_size=3),
       ensure_ascii=st.booleans())
def test_spliced_body_is_the_reencoded_body(body, indent, trailing, ids, ensure_ascii):
    raw = (json.dumps(body, indent=indent, ensure_ascii=ensure_ascii) + trailing).encode()
    rr = make_request(body, raw, ids)
    for pdpool_node in (True, False):
        assert json.loads(rr.upstream_bytes(pdpool_node)) == rr.upstream_body(pdpool_node)
    assert rr.upstream_bytes(False) == raw  # a plain OpenAI node gets the client's bytes as is
    with_json = make_request(body, raw, ids)   # the ids' JSON from the front end's token cache: the same bytes
    with_json.ids_json = [json.dumps(i, separators=(",", ":")).encode() for i in ids]
    assert with_json.upstream_bytes(True) == rr.upstream_bytes(True)


def test_client_kv_transfer_params_are_dropped_in_both_paths():
    body = {"model": "demo", "prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}
    rr = make_request(body, json.dumps(body).encode(), [[1, 2]])
    assert json.loads(rr.upstream_bytes(True)) == {"model": "demo", "prompt": "hi", TOKEN_IDS_FIELD: [[1, 2]]}
    assert "kv_transfer_params" not in json.loads(rr.upstream_bytes(False))
