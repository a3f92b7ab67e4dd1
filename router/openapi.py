"""``GET /openapi.json``: what the router serves, truthfully (the routes are read from its route table), built by
the nodes' builder (``pdpool.server.openapi``)."""

from __future__ import annotations

from pdpool.server.openapi import spec as _spec


def spec(routes, *, served_model_names: list[str], api_key: bool, vocab_size: int | None = None,
         max_model_len: int | None = None, auto_tool_choice: bool = False, chat_template: bool = False) -> dict:
    """``routes``: the (method, path) pairs served."""
    return _spec(routes, title="pdpool router", served_model_names=served_model_names, api_key=api_key,
                 vocab_size=vocab_size, max_model_len=max_model_len, auto_tool_choice=auto_tool_choice,
                 chat_template=chat_template)
