"""``pdpool.server.cors.CorsPolicy`` against Starlette's CORSMiddleware rules (over HTTP: tests/cors_checks.py)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from pdpool.server.cors import ALL_METHODS, CorsPolicy

ORIGIN = "https://app.example"


def test_no_origin_listed_refuses_every_preflight_and_names_none():
    policy = CorsPolicy([], False, ["*"], ["*"])
    status, text, headers = policy.preflight(ORIGIN, "GET", None)
    assert (status, text) == (400, "Disallowed CORS origin")
    assert headers["Vary"] == "Origin" and "Access-Control-Allow-Origin" not in headers
    assert policy.response_headers(ORIGIN, has_cookie=True) == {}


def test_listed_origin_with_credentials_is_named_on_every_answer():
    policy = CorsPolicy([ORIGIN], True, ["GET"], [])
    assert policy.response_headers(ORIGIN, has_cookie=False) == {
        "Access-Control-Allow-Credentials": "true", "Access-Control-Allow-Origin": ORIGIN, "Vary": "Origin"}
    # Starlette's simple headers go out whatever the origin: credentials "true", no origin named
    assert policy.response_headers("https://other.example", has_cookie=False) == {
        "Access-Control-Allow-Credentials": "true"}
    assert policy.preflight(ORIGIN, "GET", "accept, Content-Type")[0] == 200   # the safelisted four
    assert policy.preflight(ORIGIN, "GET", "")[1] == "Disallowed CORS headers"


def test_the_shared_headers_are_not_changed_by_an_answer():
    policy = CorsPolicy(["*"], False, ["*"], ["*"])
    assert policy.response_headers(ORIGIN, has_cookie=True) == {"Access-Control-Allow-Origin": ORIGIN,
                                                                 "Vary": "Origin"}
    assert policy.response_headers(ORIGIN, has_cookie=False) == {"Access-Control-Allow-Origin": "*"}


names = st.sampled_from(["*", ORIGIN, "null", "GET", "POST", "post", "X-Custom", "content-type", "Accept", ""])


@given(origins=st.lists(names, max_size=3), credentials=st.booleans(), methods=st.lists(names, max_size=3),
       allowed_headers=st.lists(names, max_size=3), origin=names | st.text(max_size=10), method=names,
       requested=st.none() | st.lists(names, max_size=3).map(", ".join))
def test_a_preflight_is_200_exactly_when_origin_method_and_headers_are_allowed(
        origins, credentials, methods, allowed_headers, origin, method, requested):
    policy = CorsPolicy(origins, credentials, methods, allowed_headers)
    status, text, headers = policy.preflight(origin, method, requested)
    origin_ok = "*" in origins or origin in origins
    method_ok = method in (ALL_METHODS if "*" in methods else methods)
    listed = {h.lower() for h in [*allowed_headers, "Accept", "Accept-Language", "Content-Language", "Content-Type"]}
    headers_ok = requested is None or "*" in allowed_headers or all(
        h.strip().lower() in listed for h in requested.split(","))
    assert status == (200 if origin_ok and method_ok and headers_ok else 400)
    assert (text == "OK") == (status == 200)
    named = headers.get("Access-Control-Allow-Origin")
    assert named == (None if not origin_ok else origin if credentials or "*" not in origins else "*")
    assert headers["Access-Control-Max-Age"] == "600"
