"""A streamed chat answer's chunks -> the Responses API's semantic events, as vLLM 0.32 streams them.

    response.created, response.in_progress                         (before the first chunk's event)
    per text run:  response.output_item.added (message), response.content_part.added,
                   response.output_text.delta ..., response.output_text.done, response.content_part.done,
                   response.output_item.done
    per tool call: response.output_item.added (function_call), response.function_call_arguments.delta ...,
                   response.function_call_arguments.done, response.output_item.done
    response.completed (its response's status "incomplete" when max_output_tokens cut it, as vLLM's)

Each event is ``event: <type>`` and ``data: <json>`` with its ``type`` and ``sequence_number`` (0, 1, ...). An
error mid-stream is an ``error`` event, the last one. ``ResponseEvents.sse(chunk)`` takes what
``serving.stream_response`` would have written (a chat chunk, an error body, or "[DONE]") and returns the bytes.
"""

from __future__ import annotations

from pdpool.server import responses
from pdpool.server.protocol import GenerationRequest
from pdpool.server.responses import ResponsesTurn
from pdpool.server.stream_events import ChatStreamEvents


class ResponseEvents(ChatStreamEvents):
    def __init__(self, turn: ResponsesTurn, req: GenerationRequest, request_id: str, prompt_tokens: int,
                 max_model_len: int) -> None:
        super().__init__()
        self.turn, self.req = turn, req
        self.id = responses.response_id(request_id)
        self.created_at = responses.now()
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        self.seq = 0
        self.output: list[dict] = []
        self.item: dict | None = None          # the open item (message or function_call)
        self.text = ""                         # the open item's text or arguments so far
        self.logprobs: list = []
        self.call_index: int | None = None     # the open call's index in chat's tool_calls deltas
        self.finish_reason: str | None = None

    def _opening(self) -> list[dict]:
        initial = self._response("in_progress", [], None)
        return [self._event("response.created", response=initial),
                self._event("response.in_progress", response=initial)]

    def _closing(self) -> list[dict]:
        out = self._close()
        status = responses.status(self.finish_reason)
        out.append(self._event("response.completed", response=self._response(status, self.output, self.usage)))
        return out

    def _error(self, error: dict) -> dict:
        return self._event("error", code=str(error.get("code")), message=error.get("message"),
                           param=error.get("param"))

    def _usage(self, chat_usage: dict) -> dict:
        return responses.usage(chat_usage)

    # ---- items ------------------------------------------------------------------------------------------------

    def _delta(self, choice: dict) -> list[dict]:
        out: list[dict] = []
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if not text and self.item is not None and self.item["type"] == "message":
            # a stop string's token: no text, its logprob kept, as in the whole answer
            self.logprobs += responses.output_logprobs(choice.get("logprobs")) or []
        if text and "role" not in delta:
            if self.item is None or self.item["type"] != "message":
                out += self._close() + self._open_message()
            self.text += text
            new_logprobs = responses.output_logprobs(choice.get("logprobs")) or []
            self.logprobs += new_logprobs
            out.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                   logprobs=[{"token": e["token"], "logprob": e["logprob"],
                                              "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                                               for t in e["top_logprobs"]]}
                                             for e in new_logprobs]))
        for call in delta.get("tool_calls") or ():
            if call.get("index") != self.call_index or self.item is None or self.item["type"] != "function_call":
                out += self._close() + self._open_call(call)
            arguments = (call.get("function") or {}).get("arguments") or ""
            if arguments:
                self.text += arguments
                out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return out

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _open_message(self) -> list[dict]:
        self.item = {"id": responses.item_id("msg"), "type": "message", "role": "assistant", "content": [],
                     "status": "in_progress"}
        self.text, self.logprobs = "", []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=len(self.output), item=self.item),
                self._event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def _open_call(self, call: dict) -> list[dict]:
        self.call_index = call.get("index")
        name = (call.get("function") or {}).get("name") or ""
        self.item = {"id": responses.item_id("fc"), "type": "function_call", "call_id": call.get("id") or "",
                     "name": name, "arguments": "", "status": "in_progress"}
        self.text = ""
        return [self._event("response.output_item.added", output_index=len(self.output), item=self.item)]

    def _close(self) -> list[dict]:
        item = self.item
        if item is None:
            return []
        where = self._where()
        if item["type"] == "message":
            done = responses.message_item(self.text, self.logprobs or None, item["id"])
            part = done["content"][0]
            out = [self._event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]),
                   self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            done = responses.call_item(item["call_id"], item["name"], self.text, item["id"])
            out = [self._event("response.function_call_arguments.done", **where, arguments=self.text,
                               name=item["name"])]
        out.append(self._event("response.output_item.done", output_index=where["output_index"], item=done))
        self.output.append(done)
        self.item, self.call_index = None, None
        return out

    # ---- framing ----------------------------------------------------------------------------------------------

    def _response(self, status: str, output: list, usage: dict | None) -> dict:
        return responses.response_object(self.turn, self.req, id=self.id, created_at=self.created_at,
                                         status=status, output=list(output), usage=usage,
                                         prompt_tokens=self.prompt_tokens, max_model_len=self.max_model_len)

    def _event(self, type: str, **fields) -> dict:
        event = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

