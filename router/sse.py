"""Server-sent events passed through event by event (never a whole response buffered).

The router may ask a node for ``stream_options.include_usage`` to learn the realized prefix hits; then the
final usage chunk, and the ``"usage": null`` field of the other chunks, are kept from a client that did not
ask for them. ``usage`` is whatever usage the stream carried; ``done`` whether ``[DONE]`` arrived.

A Responses stream (``event: <type>`` lines before the data) ends with its ``response.completed`` event, whose
response carries the usage, or an ``error`` event, without ``[DONE]``; its events pass unchanged. So does an
Anthropic Messages stream, which ends with ``message_stop`` (or ``error``); its ``message_delta`` has the usage.
"""

from __future__ import annotations

import json

_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")   # an SSE event's lines start so
_NULL_USAGE = (b', "usage": null', b',"usage":null')
_RESPONSE_ENDS = (b"response.completed", b"response.incomplete", b"response.failed", b"error", b"message_stop")


class SSERelay:
    def __init__(self, hide_usage: bool) -> None:
        self.hide_usage = hide_usage
        self._pending = b""
        self.usage: dict | None = None
        self.done = False
        self.num_events = 0              # named events relayed (a Responses stream's next sequence_number)
        self.at_boundary = True          # the client has received whole events only

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send now: the complete events in ``pending + chunk``."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        complete, self._pending = data[:end + 2], data[end + 2:]
        if b'"usage"' not in complete and b"[DONE]" not in complete and not complete.startswith(b"event: "):
            return complete
        out = []
        for event in complete.split(b"\n\n")[:-1]:
            out.append(self._event(event))
        return b"".join(e for e in out if e)

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"event: "):
            self.num_events += 1
            self._response_event(event)
            return event + b"\n\n"
        payload = event[6:] if event.startswith(b"data: ") else None
        if payload == b"[DONE]":
            self.done = True
        elif payload is not None and b'"usage": {' in payload or payload is not None and b'"usage":{' in payload:
            try:
                obj = json.loads(payload)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if self.hide_usage:
                    if not obj.get("choices"):
                        return b""
                    obj.pop("usage")
                    return b"data: " + json.dumps(obj).encode() + b"\n\n"
        elif self.hide_usage and payload is not None:
            for null in _NULL_USAGE:
                event = event.replace(null, b"")
        return event + b"\n\n"

    def _response_event(self, event: bytes) -> None:
        kind, _, data = event[7:].partition(b"\n")
        if kind == b"message_delta":
            obj = _data(data)
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            return
        if kind not in _RESPONSE_ENDS:
            return
        self.done = True
        obj = _data(data)
        response = obj.get("response") if isinstance(obj, dict) else None
        if isinstance(response, dict) and isinstance(response.get("usage"), dict):
            self.usage = response["usage"]

    def tail(self) -> bytes:
        """What is left at the end: an incomplete event is dropped (a client cannot parse half an event, and
        would stop there, before the error event that follows); bytes that are no event (a body that is no SSE)
        pass on as is."""
        rest, self._pending = self._pending, b""
        return b"" if rest.startswith(_FIELDS) else rest


def _data(data: bytes):
    try:
        return json.loads(data[6:]) if data.startswith(b"data: ") else None
    except ValueError:
        return None
