"""A minimal disaggregation proxy for tests: vLLM's convention, over the ordinary OpenAI endpoints.

1. the prefill node gets the request with ``kv_transfer_params: {"do_remote_decode": true}``, ``max_tokens``
   1 and ``stream`` false, and answers with the first token and the KV handle in ``kv_transfer_params``;
2. the decode node gets the original request plus that handle, and streams (or returns) the completion.
"""

from __future__ import annotations

import json

import httpx


class DisaggProxy:
    def __init__(self, prefill_url: str, decode_url: str, timeout: float = 120.0) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.timeout = timeout

    def prefill(self, body: dict, path: str = "/v1/completions") -> httpx.Response:
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        return httpx.post(self.prefill_url + path, json=first, timeout=self.timeout)

    def handle(self, body: dict, path: str = "/v1/completions") -> dict:
        r = self.prefill(body, path)
        r.raise_for_status()
        return r.json()["kv_transfer_params"]

    def decode(self, body: dict, handle: dict, path: str = "/v1/completions") -> httpx.Response:
        return httpx.post(self.decode_url + path, json={**body, "kv_transfer_params": handle}, timeout=self.timeout)

    def complete(self, body: dict, path: str = "/v1/completions") -> dict:
        r = self.decode(body, self.handle(body, path), path)
        r.raise_for_status()
        return r.json()

    def stream(self, body: dict, path: str = "/v1/completions") -> list[dict]:
        """The decode node's SSE events (``stream: true``), parsed; the last is ``[DONE]``'s absence checked."""
        handle = self.handle(body, path)
        events = []
        with httpx.stream("POST", self.decode_url + path, json={**body, "stream": True, "kv_transfer_params": handle},
                          timeout=self.timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[6:]
                    if payload == "[DONE]":
                        return events
                    events.append(json.loads(payload))
        raise AssertionError("stream ended without [DONE]")
