"""CORS as vLLM serves it: Starlette's ``CORSMiddleware`` with vLLM's four flags (``--allowed-origins``,
``--allow-credentials``, ``--allowed-methods``, ``--allowed-headers``), the same answers header for header.

Only a request with an ``Origin`` header is CORS; the HTTP edges (the node's aiohttp app, the router's server) look
that header up and leave every other request alone.

    OPTIONS + Origin + Access-Control-Request-Method    a preflight: ``preflight`` answers it (no API key needed)
        200 "OK" with Access-Control-Allow-Methods, -Max-Age: 600, -Allow-Origin ("*", or the origin named
            with ``Vary: Origin`` when origins are listed or credentials allowed), -Allow-Headers
            (the asked ones echoed under "*"; else the list with the CORS-safelisted four)
        400 "Disallowed CORS origin, method, headers" (those that failed), the same headers less the origin
    any other request + Origin                          answered as ever, plus ``response_headers``:
        Access-Control-Allow-Origin "*" under "*" (the origin named, with ``Vary: Origin``, when the request has a
        cookie), the origin named with ``Vary: Origin`` when it is listed, nothing when it is not;
        Access-Control-Allow-Credentials "true" whenever credentials are allowed
"""

from __future__ import annotations

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = frozenset({"Accept", "Accept-Language", "Content-Language", "Content-Type"})
MAX_AGE = 600
PLAIN_TEXT = "text/plain; charset=utf-8"
ALLOW_ORIGIN = "Access-Control-Allow-Origin"


class CorsPolicy:
    def __init__(self, allowed_origins: list[str], allow_credentials: bool, allowed_methods: list[str],
                 allowed_headers: list[str]) -> None:
        self.allow_all_origins = "*" in allowed_origins
        self.allowed_origins = frozenset(allowed_origins)
        self.allowed_methods = ALL_METHODS if "*" in allowed_methods else tuple(allowed_methods)
        self.allow_all_headers = "*" in allowed_headers
        listed = sorted(SAFELISTED_HEADERS | set(allowed_headers))
        self.allowed_headers = frozenset(h.lower() for h in listed)
        self.explicit_origin = not self.allow_all_origins or allow_credentials   # a preflight names the origin

        simple: dict[str, str] = {}
        if self.allow_all_origins:
            simple[ALLOW_ORIGIN] = "*"
        if allow_credentials:
            simple["Access-Control-Allow-Credentials"] = "true"
        self.simple_headers = simple

        preflight = {"Vary": "Origin"} if self.explicit_origin else {ALLOW_ORIGIN: "*"}
        preflight["Access-Control-Allow-Methods"] = ", ".join(self.allowed_methods)
        preflight["Access-Control-Max-Age"] = str(MAX_AGE)
        if not self.allow_all_headers:
            preflight["Access-Control-Allow-Headers"] = ", ".join(listed)
        if allow_credentials:
            preflight["Access-Control-Allow-Credentials"] = "true"
        self.preflight_headers = preflight

    @classmethod
    def from_config(cls, section) -> "CorsPolicy":
        """From a ``ServerConfig`` or ``RouterConfig`` (``pdpool.config``)."""
        return cls(section.allowed_origins, section.allow_credentials, section.allowed_methods,
                   section.allowed_headers)

    def is_allowed_origin(self, origin: str) -> bool:
        return self.allow_all_origins or origin in self.allowed_origins

    def preflight(self, origin: str, method: str, requested_headers: str | None) -> tuple[int, str, dict[str, str]]:
        """(status, plain-text body, headers) of the answer to a preflight."""
        headers = dict(self.preflight_headers)
        failures = []
        if self.is_allowed_origin(origin):
            if self.explicit_origin:
                headers[ALLOW_ORIGIN] = origin
        else:
            failures.append("origin")
        if method not in self.allowed_methods:
            failures.append("method")
        if self.allow_all_headers and requested_headers is not None:
            headers["Access-Control-Allow-Headers"] = requested_headers
        elif requested_headers is not None:
            if any(h.strip() not in self.allowed_headers for h in requested_headers.lower().split(",")):
                failures.append("headers")
        if failures:
            return 400, "Disallowed CORS " + ", ".join(failures), headers
        return 200, "OK", headers

    def response_headers(self, origin: str, has_cookie: bool) -> dict[str, str]:
        """What any other answer to a request from ``origin`` carries (read only: often the shared dict)."""
        if self.allow_all_origins:
            if not has_cookie:
                return self.simple_headers
        elif not self.is_allowed_origin(origin):
            return self.simple_headers
        return {**self.simple_headers, ALLOW_ORIGIN: origin, "Vary": "Origin"}
