"""A minimal blocking HTTP client for tests: `Client(url).post(path, body)` → `Reply(status, body)`."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass


@dataclass
class Reply:
    status: int
    body: dict | list | None

    @property
    def reason(self) -> str | None:
        return self.body.get("reason") if isinstance(self.body, dict) else None


class Client:
    def __init__(self, url: str, user_agent: str = "emulator-test-client"):
        parsed = urllib.parse.urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port
        self.user_agent = user_agent

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, content_type: str = "application/json",
                params: dict | None = None, accept: str = "application/json", timeout: float = 10) -> Reply:
        if params:
            path += "?" + urllib.parse.urlencode(params)
        payload = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
        conn = self._connect(timeout)
        try:
            conn.request(method, path, body=payload, headers={
                "Content-Type": content_type, "Accept": accept, "User-Agent": self.user_agent})
            response = conn.getresponse()
            raw = response.read()
            return Reply(response.status, json.loads(raw) if raw.strip() else None)
        finally:
            conn.close()

    def get(self, path: str, **kw) -> Reply:
        return self.request("GET", path, **kw)

    def post(self, path: str, body, **kw) -> Reply:
        return self.request("POST", path, body, **kw)

    def put(self, path: str, body, **kw) -> Reply:
        return self.request("PUT", path, body, **kw)

    def patch(self, path: str, body, content_type: str = "application/merge-patch+json", **kw) -> Reply:
        return self.request("PATCH", path, body, content_type=content_type, **kw)

    def delete(self, path: str, body=None, **kw) -> Reply:
        return self.request("DELETE", path, body, **kw)

    def watch(self, path: str, params: dict | None = None, timeout: float = 10):
        """Yields watch events (dicts) until the server ends the stream or `timeout` passes idle."""
        params = {"watch": "true", **(params or {})}
        conn = self._connect(timeout)
        try:
            conn.request("GET", path + "?" + urllib.parse.urlencode(params),
                         headers={"Accept": "application/json", "User-Agent": self.user_agent})
            response = conn.getresponse()
            while line := response.readline():
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()
