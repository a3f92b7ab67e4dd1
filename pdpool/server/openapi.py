"""``GET /openapi.json`` of a node and of the router: one builder, fed the (method, path) pairs each one serves.

The request bodies say what ``pdpool.server.protocol`` and ``pdpool.server.tokenize`` accept: each field's type
and bounds, the served model names, and the rules across fields that JSON Schema can say (``stream_options``
needs ``stream``; ``top_logprobs`` needs ``logprobs``; completions' ``max_tokens`` 0 needs ``echo``;
``continue_final_message`` needs ``add_generation_prompt`` false; /tokenize takes ``prompt`` or ``messages``).
Rules it cannot say (``min_tokens`` at most ``max_tokens``, ``best_of`` equal to ``n``, the prompt and
``max_tokens`` within the context, the last message the assistant's to continue it) are in the descriptions;
breaking one is a 400. Authentication is documented only when an API key
is set, and so is its 401.
"""


from __future__ import annotations

from pdpool.server import anthropic_messages
from pdpool.server.openapi_bodies import (anthropic_body, chat_body, completion_body, count_tokens_body,
                                          detokenize_body, responses_body, tokenize_body)

_JSON = "application/json"
_ERROR = {"description": "OpenAI error", "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {  # what any request may get: every one an OpenAI error body
    "400": {**_ERROR, "description": "Bad request: the body or a field (named in `param`)"},
    "404": {**_ERROR, "description": "A model name that is not served"},
    "413": {**_ERROR, "description": "A body over 64 MiB"},
    "500": {**_ERROR, "description": "Internal error (a bug; the message names an error id from the log)"},
    "503": {**_ERROR, "description": "Not ready: the node loads or drains, or the router has no ready node"},
}
_ANTHROPIC_ERROR = {"description": "Anthropic error",
                    "content": {_JSON: {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
_GEN_ERRORS = {
    **_ERRORS,
    "429": {**_ERROR, "description": "Too many requests in flight (the router's --max-inflight, a prefill "
                                      "node's lease cap)"},
    "502": {**_ERROR, "description": "The router's upstream node failed"},
}

_DOCS = {
    ("POST", "/v1/completions"): "Text completion (OpenAI).",
    ("POST", "/v1/chat/completions"): "Chat completion (OpenAI).",
    ("POST", "/v1/responses"): "A response (OpenAI's Responses API, as vLLM serves it: no stored state).",
    ("POST", anthropic_messages.PATH): "A message (Anthropic's Messages API, as vLLM serves it); errors in "
                                       "Anthropic's shape.",
    ("POST", anthropic_messages.COUNT_TOKENS_PATH): "The input tokens of a Messages request's rendered prompt "
                                                    "(Anthropic's count_tokens).",
    ("GET", "/v1/models"): "The served model.",
    ("GET", "/v1/models/{model}"): "The served model's card by its name (OpenAI's retrieve), else 404.",
    ("GET", "/health/live"): "200 while the process runs.",
    ("GET", "/health/ready"): "200 when ready to serve (a router: at least one decode-capable node), else 503.",
    ("GET", "/metrics"): "Prometheus metrics.",
    ("GET", "/openapi.json"): "This document.",
    ("GET", "/version"): "The server's pdpool version (vLLM's route).",
    ("POST", "/tokenize"): "vLLM's tokenize: token ids of a prompt or of a chat (its template applied).",
    ("POST", "/detokenize"): "vLLM's detokenize: the text of token ids.",
}
_PLAIN = {"/metrics": "text/plain"}   # Prometheus' text format (a version parameter follows)
_NOT_READY = {"/health/ready"}   # /health, its alias, is left out of the document
_PUBLIC = ("/health", "/metrics", "/openapi.json", "/version")


def spec(routes, *, title: str, served_model_names: list[str], api_key: bool, vocab_size: int | None = None,
         max_model_len: int | None = None, auto_tool_choice: bool = False, chat_template: bool = False) -> dict:
    """The document for ``routes`` (the (method, path) pairs served; others are left out). ``api_key``: whether
    the API (all but /health*, /metrics, /openapi.json) needs ``Authorization: Bearer``. ``vocab_size`` and
    ``max_model_len``, where known, bound token ids and lengths. ``auto_tool_choice``: tool_choice "auto" is
    served (--enable-auto-tool-choice). ``chat_template``: a request's is taken (--trust-request-chat-template)."""
    model = {"type": "string", "enum": list(served_model_names)}
    named = {"type": "string", "enum": [*served_model_names, ""]}   # OpenAI's bodies: "", as null, is the first
    bodies = {"/v1/completions": completion_body(named, vocab_size, max_model_len),
              "/v1/chat/completions": chat_body(named, vocab_size, max_model_len, auto_tool_choice, chat_template),
              "/v1/responses": responses_body(named, vocab_size, max_model_len, auto_tool_choice, chat_template),
              anthropic_messages.PATH: anthropic_body(model, vocab_size, max_model_len, auto_tool_choice,
                                                       chat_template),
              anthropic_messages.COUNT_TOKENS_PATH: count_tokens_body(model, chat_template),
              "/tokenize": tokenize_body(named, chat_template), "/detokenize": detokenize_body(named, vocab_size)}
    paths: dict = {}
    for method, path in sorted(set(routes)):
        summary = _DOCS.get((method, path))
        if summary is None:
            continue
        op: dict = {"summary": summary, "parameters": [
            {"name": "X-Request-Id", "in": "header", "required": False, "schema": {"type": "string"},
             "description": "Request id carried through and echoed back (generated if absent)."}]}
        if "{model}" in path:
            op["parameters"].append({"name": "model", "in": "path", "required": True, "schema": model,
                                     "description": "A served model name (it may hold slashes)."})
        anthropic = path.startswith(anthropic_messages.PATH)
        if path in bodies:
            op["requestBody"] = {"required": True, "content": {_JSON: {"schema": bodies[path]}}}
            errors = _GEN_ERRORS if path.startswith("/v1/") else _ERRORS
            if anthropic:
                errors = {status: {**e, "content": _ANTHROPIC_ERROR["content"]} for status, e in errors.items()}
            ok: dict = {_JSON: {"schema": {"type": "object"}}}
            if path.startswith("/v1/"):
                ok["text/event-stream"] = {"schema": {  # each event: a JSON chunk, the last one "[DONE]"
                    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}
            op["responses"] = {"200": {"description": "JSON, or server-sent events when `stream` is true"
                                       if path.startswith("/v1/") else "OK", "content": ok}, **errors}
        else:
            content_type = _PLAIN.get(path, _JSON)
            op["responses"] = {"200": {"description": "OK", "content": {content_type: {"schema": {}}}}}
            if path in _NOT_READY:
                op["responses"]["503"] = {"description": "Not ready", "content": {_JSON: {"schema": {"type": "object"}}}}
            if "{model}" in path:
                op["responses"]["404"] = _ERROR
        if api_key and not path.startswith(_PUBLIC):
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = {**(_ANTHROPIC_ERROR if anthropic else _ERROR),
                                      "description": "Missing or wrong API key"}
        paths.setdefault(path, {})[method.lower()] = op
    components: dict = {"schemas": {"Error": {
        "type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer"]}}}}},
        "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
            "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
                "type": {"type": "string"}, "message": {"type": "string"}}}}}}}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"}, "paths": paths, "components": components}
