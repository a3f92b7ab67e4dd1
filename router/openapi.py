"""``GET /openapi.json``: what the router serves, truthfully (the routes are read from its route table)."""

from __future__ import annotations

_ERROR = {"description": "OpenAI error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_GEN_RESPONSES = {
    "200": {"description": "The completion (JSON), or server-sent events when `stream` is true.",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}}},
    "400": _ERROR, "401": _ERROR, "404": _ERROR, "429": _ERROR, "503": _ERROR,
}
_DOCS = {
    ("POST", "/v1/completions"): ("Text completion (OpenAI), routed to a prefill and a decode node.",
                                  ["model", "prompt"], "prompt"),
    ("POST", "/v1/chat/completions"): ("Chat completion (OpenAI), routed to a prefill and a decode node.",
                                       ["model", "messages"], "messages"),
    ("GET", "/v1/models"): ("The served model.", None, None),
    ("GET", "/v1/models/{model}"): ("The served model's card by its name (OpenAI's retrieve), else 404.", None, None),
    ("GET", "/health/live"): ("200 while the process runs, with its pid (with --workers, the answering worker's).",
                              None, None),
    ("GET", "/health/ready"): ("200 when at least one decode-capable node is usable, else 503.", None, None),
    ("GET", "/metrics"): ("Prometheus metrics (pdpool_router_*).", None, None),
    ("GET", "/openapi.json"): ("This document.", None, None),
    ("POST", "/tokenize"): ("vLLM's tokenize: token ids of a prompt or of a chat (its template applied), from the "
                            "router's own tokenizer.", None, None),
    ("POST", "/detokenize"): ("vLLM's detokenize: the text of token ids.", None, None),
}
_BODIES = {
    "/tokenize": {"type": "object", "additionalProperties": True, "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "add_special_tokens": {"type": "boolean", "description": "default: true with prompt, false with messages"},
        "add_generation_prompt": {"type": "boolean"}, "continue_final_message": {"type": "boolean"},
        "return_token_strs": {"type": "boolean"}}},
    "/detokenize": {"type": "object", "required": ["tokens"], "additionalProperties": True, "properties": {
        "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
}


def spec(routes, title: str = "pdpool router") -> dict:
    """``routes``: the (method, path) pairs served."""
    paths: dict = {}
    for method, path in routes:
        doc = _DOCS.get((method, path))
        if doc is None:
            continue
        summary, required, _ = doc
        op: dict = {"summary": summary, "parameters": [
            {"name": "X-Request-Id", "in": "header", "required": False, "schema": {"type": "string"},
             "description": "Request id carried to the nodes and echoed back (generated if absent)."}]}
        if "{model}" in path:
            op["parameters"].append({"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
                                     "description": "A served model name (it may hold slashes)."})
        if required:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": required, "additionalProperties": True,
                "properties": {"model": {"type": "string"}, "stream": {"type": "boolean"},
                               "max_tokens": {"type": ["integer", "null"], "minimum": 1, "description": (
                                   "null: the rest of the context; absent: 16 on completions, the rest of the "
                                   "context on chat")},
                               "stream_options": {"type": "object"}}}}}}
            op["responses"] = _GEN_RESPONSES
            op["security"] = [{"bearer": []}]
        elif path in _BODIES:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _BODIES[path]}}}
            op["responses"] = {"200": {"description": "OK", "content": {"application/json": {
                "schema": {"type": "object"}}}}, "400": _ERROR, "401": _ERROR, "404": _ERROR}
            op["security"] = [{"bearer": []}]
        else:
            op["responses"] = {"200": {"description": "OK"}}
        paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"}, "paths": paths,
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                           "schemas": {"Error": {"type": "object", "properties": {"error": {
                               "type": "object", "properties": {"message": {"type": "string"},
                                                                "type": {"type": "string"},
                                                                "param": {"type": ["string", "null"]},
                                                                "code": {}}}}}}}}
