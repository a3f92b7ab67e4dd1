"""A streamed chat answer retold as another API's stream events (the Responses API's, Anthropic's Messages').

``serving.stream_response`` writes what a chat stream would (a chunk, an error body, or "[DONE]") through an
encoder's ``sse``; a ``ChatStreamEvents`` turns each into that API's events, framed as ``event: <type>`` and
``data: <json>``. The walk is the same for every API: its opening events before the first chunk's, each choice's
delta, the usage when a chunk carries it, an error (the last event), and its closing events at "[DONE]". A
subclass says what each of those is.
"""

from __future__ import annotations

import json


class ChatStreamEvents:
    def __init__(self) -> None:
        self.started = self.failed = False
        self.usage: dict | None = None      # the API's usage, from the chunk that carried chat's

    def sse(self, chunk: dict | str) -> bytes:
        return b"".join(map(sse_frame, self.events(chunk)))

    def events(self, chunk: dict | str) -> list[dict]:
        if self.failed:
            return []
        out: list[dict] = []
        if not self.started:
            self.started = True
            out += self._opening()
        if chunk == "[DONE]":
            out += self._closing()
        elif "error" in chunk:
            self.failed = True
            out.append(self._error(chunk["error"]))
        else:
            if chunk.get("usage"):
                self.usage = self._usage(chunk["usage"])
            for choice in chunk.get("choices") or ():
                out += self._delta(choice)
        return out

    # ---- what an API's stream says at each point ------------------------------------------------------------

    def _opening(self) -> list[dict]:
        raise NotImplementedError

    def _closing(self) -> list[dict]:
        raise NotImplementedError

    def _error(self, error: dict) -> dict:
        raise NotImplementedError

    def _usage(self, chat_usage: dict) -> dict:
        raise NotImplementedError

    def _delta(self, choice: dict) -> list[dict]:
        raise NotImplementedError


def sse_frame(event: dict) -> bytes:
    """UTF-8 text as is; escaped where a request's echoed field (metadata, tools) holds an unpaired surrogate."""
    try:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
    except UnicodeEncodeError:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
