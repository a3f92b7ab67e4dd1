"""A streamed chat answer's chunks -> Anthropic's Messages stream events, as vLLM 0.32 streams them.

    message_start                   (the message with no content; usage: the prompt's tokens, 0 output)
    per text run:  content_block_start (text), content_block_delta (text_delta) ..., content_block_stop
    per tool call: content_block_start (tool_use, input {}), content_block_delta (input_json_delta) ...,
                   content_block_stop
    message_delta                   (stop_reason, stop_sequence; the whole usage)
    message_stop

Each event is ``event: <type>`` and ``data: <json>`` with its ``type``; blocks are numbered by ``index`` (0, 1,
...). No ``ping``: vLLM sends none. An error mid-stream is an ``error`` event, the last one.
``MessageEvents.sse(chunk)`` takes what ``serving.stream_response`` would have written (a chat chunk, an error
body, or "[DONE]") and returns the bytes.
"""

from __future__ import annotations

from pdpool.server import anthropic_messages as messages
from pdpool.server.errors import APIError
from pdpool.server.protocol import GenerationRequest
from pdpool.server.stream_events import ChatStreamEvents


class MessageEvents(ChatStreamEvents):
    def __init__(self, req: GenerationRequest, request_id: str, prompt_tokens: int) -> None:
        super().__init__()
        self.req = req
        self.id = messages.message_id(request_id)
        self.prompt_tokens = prompt_tokens
        self.index = 0                          # the next block's index
        self.block: str | None = None           # the open block's type (text, tool_use)
        self.call_index: int | None = None      # the open call's index in chat's tool_calls deltas
        self.arguments = ""                     # the open call's arguments so far
        self.called = False
        self.finish_reason: str | None = None
        self.stop: int | str | None = None

    def _opening(self) -> list[dict]:
        start = messages.message_object(self.id, self.req.model, [], (None, None),
                                        {"input_tokens": self.prompt_tokens, "output_tokens": 0})
        return [{"type": "message_start", "message": start}]

    def _closing(self) -> list[dict]:
        out = self._close()
        complete = self.called and messages.json_object(self.arguments) is not None
        reason, sequence = messages.stop_reason(self.finish_reason, self.stop, self.called, complete)
        out.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self.usage or {"input_tokens": self.prompt_tokens, "output_tokens": 0}})
        out.append({"type": "message_stop"})
        return out

    def _error(self, error: dict) -> dict:
        return APIError(error.get("message") or "", status=_status(error.get("code"))).anthropic_body()

    def _usage(self, chat_usage: dict) -> dict:
        return messages.usage(chat_usage)

    def _delta(self, choice: dict) -> list[dict]:
        out: list[dict] = []
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text and "role" not in delta:
            if self.block != "text":
                out += self._close() + self._open({"type": "text", "text": ""})
            out.append(self._block_delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("index") != self.call_index or self.block != "tool_use":
                out += self._close()
                self.call_index, self.arguments, self.called = call.get("index"), "", True
                out += self._open({"type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or "",
                                   "input": {}})
            arguments = function.get("arguments") or ""
            if arguments:
                self.arguments += arguments
                out.append(self._block_delta({"type": "input_json_delta", "partial_json": arguments}))
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.stop = choice["finish_reason"], choice.get("stop_reason")
        return out

    def _open(self, block: dict) -> list[dict]:
        self.block = block["type"]
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _block_delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        event = {"type": "content_block_stop", "index": self.index}
        self.block, self.index = None, self.index + 1
        return [event]


def _status(code) -> int:
    return code if isinstance(code, int) and 400 <= code < 600 else 500

