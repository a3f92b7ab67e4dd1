"""CORS checks that a node (tests/server) and the router (tests/router) pass alike: Starlette's CORSMiddleware as
vLLM installs it (``pdpool.server.cors``), over real HTTP. ``url`` is the server's root, ``key`` its API key."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings, strategies as st

from hypothesis_profiles import scaled

ORIGIN = "https://app.example"
ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
CORS_NAMES = ("access-control-allow-origin", "access-control-allow-credentials", "access-control-allow-methods",
              "access-control-allow-headers", "access-control-max-age", "vary")


def preflight(url: str, path: str = "/v1/chat/completions", origin: str = ORIGIN, method: str = "POST",
              headers: str | None = None) -> httpx.Response:
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        h["Access-Control-Request-Headers"] = headers
    return httpx.request("OPTIONS", url + path, headers=h, timeout=30)


def cors_of(r: httpx.Response) -> dict[str, str]:
    return {name: r.headers[name] for name in CORS_NAMES if name in r.headers}


def check_default_preflight_needs_no_key(url: str) -> None:
    r = preflight(url, headers="authorization, content-type, x-stainless-lang")
    assert r.status_code == 200, r.text
    assert r.text == "OK"
    assert r.headers["content-type"] == "text/plain; charset=utf-8"
    assert cors_of(r) == {"access-control-allow-origin": "*", "access-control-allow-methods": ALL_METHODS,
                          "access-control-max-age": "600",
                          "access-control-allow-headers": "authorization, content-type, x-stainless-lang"}
    r = preflight(url, path="/no/such/path", method="GET")   # any path: the middleware answers before routing
    assert r.status_code == 200 and "access-control-allow-headers" not in r.headers


def check_default_answers_carry_allow_origin(url: str, key: str) -> None:
    """A 200, a 401 (CORS never stands in for the key), a 404, a 405 and a stream, each with its CORS header; the
    same requests without an Origin have none."""
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=120) as client:
        for headers, expect in [({"Origin": ORIGIN}, {"access-control-allow-origin": "*"}), ({}, {})]:
            r = client.post(url + "/v1/chat/completions", json=CHAT, headers={**headers, **auth})
            assert r.status_code == 200, r.text
            assert cors_of(r) == expect
            r = client.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert cors_of(r) == expect
            r = client.get(url + "/v1/nothing", headers={**headers, **auth})
            assert r.status_code == 404 and cors_of(r) == expect
            r = client.get(url + "/v1/chat/completions", headers={**headers, **auth})
            assert r.status_code == 405 and cors_of(r) == expect
            r = client.get(url + "/health/live", headers=headers)
            assert r.status_code == 200 and cors_of(r) == expect
            with client.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True},
                               headers={**headers, **auth}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                assert cors_of(r) == expect
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def check_options_that_is_no_preflight_needs_the_key(url: str, key: str) -> None:
    """``OPTIONS`` without ``Access-Control-Request-Method`` is an ordinary request: the key, then a 405."""
    r = httpx.request("OPTIONS", url + "/v1/chat/completions", headers={"Origin": ORIGIN}, timeout=30)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.request("OPTIONS", url + "/v1/chat/completions", timeout=30,
                      headers={"Origin": ORIGIN, "Authorization": f"Bearer {key}"})
    assert r.status_code == 405 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["allow"]


def check_listed_origins_methods_and_headers(url: str) -> None:
    """--allowed-origins '["https://app.example"]' --allowed-methods POST GET --allowed-headers Authorization
    X-Custom: the origin named, with ``Vary: Origin``; what is not listed is a 400 naming it."""
    listed = "Accept, Accept-Language, Authorization, Content-Language, Content-Type, X-Custom"
    r = preflight(url, headers="Authorization,content-type , x-custom")
    assert r.status_code == 200, r.text
    assert cors_of(r) == {"vary": "Origin", "access-control-allow-origin": ORIGIN,
                          "access-control-allow-methods": "POST, GET", "access-control-max-age": "600",
                          "access-control-allow-headers": listed}
    r = preflight(url, origin="https://evil.example")
    assert (r.status_code, r.text) == (400, "Disallowed CORS origin")
    assert "access-control-allow-origin" not in r.headers and r.headers["vary"] == "Origin"
    assert preflight(url, method="PUT").text == "Disallowed CORS method"
    assert preflight(url, headers="x-other").text == "Disallowed CORS headers"
    r = preflight(url, origin="null", method="post", headers="authorization, x-other")
    assert (r.status_code, r.text) == (400, "Disallowed CORS origin, method, headers")

    r = httpx.get(url + "/health/live", headers={"Origin": ORIGIN}, timeout=30)
    assert cors_of(r) == {"access-control-allow-origin": ORIGIN, "vary": "Origin"}
    r = httpx.get(url + "/health/live", headers={"Origin": "https://evil.example"}, timeout=30)
    assert r.status_code == 200 and cors_of(r) == {}   # the answer, without a header the browser would need


def check_credentials_with_any_origin(url: str) -> None:
    """--allow-credentials (origins "*"): a preflight names the origin; an answer says "*" unless the request
    carries a cookie, then it names the origin."""
    r = preflight(url)
    assert r.status_code == 200
    assert cors_of(r) == {"vary": "Origin", "access-control-allow-origin": ORIGIN,
                          "access-control-allow-methods": ALL_METHODS, "access-control-max-age": "600",
                          "access-control-allow-credentials": "true"}
    r = httpx.get(url + "/health/live", headers={"Origin": ORIGIN}, timeout=30)
    assert cors_of(r) == {"access-control-allow-origin": "*", "access-control-allow-credentials": "true"}
    r = httpx.get(url + "/health/live", headers={"Origin": ORIGIN, "Cookie": "session=1"}, timeout=30)
    assert cors_of(r) == {"access-control-allow-origin": ORIGIN, "access-control-allow-credentials": "true",
                          "vary": "Origin"}


# Header values as bytes h11 sends: no CR, LF, NUL or other whitespace than inner spaces and tabs; control
# characters, DEL and obs-text (bytes that are no UTF-8) included.
_VALUE_BYTES = st.sampled_from([*range(1, 10), *range(0x20, 0x100)])
header_values = st.one_of(st.sampled_from([b"", b"*", b"null", ORIGIN.encode(), b"POST", b"x-custom, authorization"]),
                          st.lists(_VALUE_BYTES, max_size=40).map(lambda b: bytes(b).strip(b" \t")))
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health/live", "/metrics", "/nowhere", "/"]


def check_no_cors_request_is_a_5xx(url: str) -> None:
    """Any Origin, requested method and headers, on any method and path: never a 5xx, and a preflight is 200 or
    400 (requests without the key: nothing generates)."""
    client = httpx.Client(timeout=30)

    @settings(max_examples=scaled(60), suppress_health_check=[HealthCheck.too_slow])
    @given(method=st.sampled_from(["OPTIONS", "OPTIONS", "GET", "POST", "PUT", "DELETE", "HEAD"]),
           path=st.sampled_from(PATHS), origin=header_values, request_method=st.none() | header_values,
           request_headers=st.none() | header_values, cookie=st.booleans())
    def run(method, path, origin, request_method, request_headers, cookie):
        headers = [(b"Origin", origin)]
        if request_method is not None:
            headers.append((b"Access-Control-Request-Method", request_method))
        if request_headers is not None:
            headers.append((b"Access-Control-Request-Headers", request_headers))
        if cookie:
            headers.append((b"Cookie", b"a=b"))
        r = client.request(method, url + path, headers=headers, content=b"{}" if method == "POST" else None)
        assert r.status_code < 500, (r.status_code, r.text)
        if method == "OPTIONS" and request_method is not None:
            assert r.status_code in (200, 400), (r.status_code, r.text)

    try:
        run()
    finally:
        client.close()
