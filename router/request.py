"""An OpenAI request as the router needs it: validated exactly as a node validates it (same 400s, before any
routing), tokenized once with the shared front end, and hashed into the engines' block hashes on demand.

Token-id forwarding: a pdpool node gets the ids in ``pdpool_prompt_token_ids`` (one list per prompt) and skips
its own tokenization, so router and engine hash exactly the same tokens. A plain OpenAI node gets the body as is.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field

from pdpool import frontend as _frontend
from pdpool.frontend import Frontend
from pdpool.server import anthropic_messages, protocol, responses
from pdpool.server.errors import APIError

TOKEN_IDS_FIELD = "pdpool_prompt_token_ids"
# The front end's refusal (named PromptError before the node-core rework, InvalidRequestError after it).
_REFUSED = getattr(_frontend, "InvalidRequestError", None) or getattr(_frontend, "PromptError")


_ids = [os.urandom(8).hex(), itertools.count()]   # this process's random prefix and counter


def new_request_id() -> str:
    """A fresh request id: 32 hex digits, as ``pdpool.logs.request_id_from``'s uuid4, from a random per-process
    prefix (drawn again in a forked worker) and a counter: no system call and no ``UUID`` object per request."""
    prefix, count = _ids
    return f"{prefix}{next(count):016x}"


def _new_id_prefix() -> None:
    _ids[:] = [os.urandom(8).hex(), itertools.count()]


os.register_at_fork(after_in_child=_new_id_prefix)


@dataclass
class RoutedRequest:
    path: str                         # /v1/completions | /v1/chat/completions | /v1/responses | /v1/messages
    body: dict                        # the client's body, untouched
    parsed: protocol.GenerationRequest
    prompt_token_ids: list[list[int]]
    request_id: str
    raw: bytes = b""                  # the client's body as received (valid JSON: it parsed into ``body``)
    ids_json: list = field(default_factory=list)  # per prompt, the JSON of its ids where the front end made it
    frontend: Frontend | None = None
    shared: tuple | None = None       # the first prompt's shared token-cache chunks (the block-hash memo's keys)
    # The ids the nodes get, where they differ from ``prompt_token_ids``: with truncate_prompt_tokens, the whole
    # prompt's (the node cuts them as it cuts a client's, so echo's text is the kept ids', not the body's prompt)
    forwarded_token_ids: list[list[int]] | None = None
    # a /v1/responses or /v1/messages request's chat body (``pdpool.server.responses``, ``anthropic_messages``): its
    # prefill leg is that chat request
    chat_body: dict | None = None
    client_request_id: bool = False   # ``request_id`` is the client's X-Request-Id (not unique: see prefill_id)
    headers: dict | None = None       # the client's headers the nodes get too, on both legs (X-Vllm-Priority)
    _hashes: dict = field(default_factory=dict)

    def prefill_id(self) -> str:
        """The X-Request-Id of the prefill leg, by which the router may free that response's leases
        (``upstream.release_response``): a client's id may be shared by requests in flight together (retries, a
        fan-out under one trace id), and one's leaving must not free another's lease, so a client's id gets a
        fresh suffix here (128 characters at most, as ``pdpool.logs.request_id_from`` takes). The router's own
        lines and answers keep the client's id; so does the decode leg, whose node makes the answer's id of it."""
        if not self.client_request_id:
            return self.request_id
        return f"{self.request_id[:95]}.{new_request_id()}"

    @property
    def stream(self) -> bool:
        return self.parsed.stream

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids[0])

    @property
    def disaggregable(self) -> bool:
        """The handoff moves one prompt's KV to one decode request; a request for the prompt's own logprobs
        (echo with logprobs) computes its whole prompt on one node, and a beam search runs one-token requests
        there, step after step."""
        return (len(self.prompt_token_ids) == 1 and self.parsed.n == 1
                and self.parsed.params.prompt_logprobs is None and not self.parsed.use_beam_search)

    @property
    def sent_token_ids(self) -> list[list[int]]:
        return self.prompt_token_ids if self.forwarded_token_ids is None else self.forwarded_token_ids

    def name_model(self, name: str) -> None:
        """Ask the nodes for ``name`` (the router's first served name, the one they serve) where the client named
        another of the router's names (``--served-model-name a b``): its answer carries ``name``, as vLLM's does."""
        if self.body.get("model") in (None, name):
            return
        self.body = {**self.body, "model": name}
        self.raw = b""   # re-encoded from ``body`` (``upstream_bytes``)
        if self.chat_body is not None and "model" in self.chat_body:
            self.chat_body = {**self.chat_body, "model": name}

    def block_hashes(self, fingerprint) -> list:
        hashes = self._hashes.get(fingerprint)
        if hashes is None:
            ids, salt = self.prompt_token_ids[0], self.parsed.cache_salt
            memo = self.frontend.hash_memo if self.frontend is not None else None
            hashes = self._hashes[fingerprint] = _frontend.block_hashes(ids, fingerprint, salt, memo, self.shared)
        return hashes

    def upstream_bytes(self, pdpool_node: bool | None) -> bytes:
        """``upstream_body(pdpool_node)`` serialized, built from the client's own bytes when it can be: the body
        as received, plus the token ids spliced in before its closing brace (the same object as re-encoding it,
        without re-encoding a long prompt)."""
        raw = self.raw.rstrip()
        if not raw.endswith(b"}") or not self.body or "kv_transfer_params" in self.body:
            return json.dumps(self.upstream_body(pdpool_node)).encode()
        if not pdpool_node:
            return self.raw
        if self.ids_json and all(j is not None for j in self.ids_json):
            ids = b"[" + b",".join(self.ids_json) + b"]"
        else:
            ids = json.dumps(self.sent_token_ids, separators=(",", ":")).encode()
        return b"".join((raw[:-1], b',"', TOKEN_IDS_FIELD.encode(), b'":', ids, b"}"))

    @property
    def prefill_path(self) -> str:
        return self.path if self.chat_body is None else "/v1/chat/completions"

    def prefill_body(self, pdpool_node: bool | None, **changes) -> dict:
        """The prefill leg's body: ``upstream_body``'s, or for a Responses or Messages request its chat body's (the
        prefill node's answer is a KV handle either way; the decode node answers with a Response or a Message)."""
        return self.upstream_body(pdpool_node, _of=self.chat_body, **changes)

    def upstream_body(self, pdpool_node: bool | None, _of: dict | None = None, **changes) -> dict:
        body = dict(self.body if _of is None else _of)
        body.pop("kv_transfer_params", None)  # the router owns the handoff
        body.pop(TOKEN_IDS_FIELD, None)
        if pdpool_node:
            body[TOKEN_IDS_FIELD] = self.sent_token_ids
        body.update(changes)
        return body


def parse(path: str, body: dict, frontend: Frontend, served_names: list[str], request_id: str,
          raw: bytes = b"", tool_parser: str | None = None, *, trust_chat_template: bool = False) -> RoutedRequest:
    """Raises ``APIError`` (4xx) for what a node would refuse before generating; the context length is the
    nodes' to check (their 400 reaches the client as is). ``tool_parser``: the pool's for tool_choice "auto"
    (None: refused, as the nodes refuse it without one)."""
    if TOKEN_IDS_FIELD in body:
        raise APIError(f"'{TOKEN_IDS_FIELD}' is set by the router, not by clients", param=TOKEN_IDS_FIELD)
    chat_body = None
    if path.endswith("/chat/completions"):
        # a request's chat_template: rendered here as the node renders it, so both hash the same prompt
        req = protocol.parse_chat(body, served_names, frontend.render_chat, tool_parser,
                                  trust_chat_template=trust_chat_template)
    elif path.endswith("/responses"):   # its chat body, parsed and rendered as a chat request
        turn, req = responses.parse(body, lambda chat: protocol.parse_chat(
            chat, served_names, frontend.render_chat, tool_parser, trust_chat_template=trust_chat_template))
        chat_body = turn.chat
    elif path == anthropic_messages.PATH:   # the same, for Anthropic's Messages API
        turn, req = anthropic_messages.parse(body, lambda chat: protocol.parse_chat(
            chat, served_names, frontend.render_chat, tool_parser, trust_chat_template=trust_chat_template))
        chat_body = turn.chat
    else:
        req = protocol.parse_completion(body, served_names)
    add_special = req.kind != "chat"
    try:
        encoded = [frontend.encode_prompt_chunked(p, add_special) for p in req.prompts]
        forwarded = None
        keep = req.params.truncate_prompt_tokens
        if keep is not None and keep > 0 and any(len(e[0]) > keep for e in encoded):
            # Routing sees the ids the node keeps (-1, its context length: the node's to cut); the node gets the
            # whole prompt's ids and cuts them itself, as it cuts a client's: given only the kept ids, it would
            # take them for the whole prompt and echo the body's text.
            forwarded = [e[0] for e in encoded]
            encoded = [(ids[-keep:], j, None) if len(ids) > keep else (ids, j, shared)
                       for ids, j, shared in encoded]
        stop_ids = getattr(req.params, "stop_token_ids", None)
        if stop_ids:
            _frontend.check_token_ids(stop_ids, frontend.vocab_size, "stop_token_ids")
        allowed = getattr(req.params, "allowed_token_ids", None)
        if allowed:
            _frontend.check_token_ids(allowed, frontend.vocab_size, "allowed_token_ids")
        logit_bias = getattr(req.params, "logit_bias", None)
        if logit_bias:  # the node checks its ids too: the same 400, before any routing
            _frontend.check_token_ids(list(logit_bias), frontend.vocab_size, "logit_bias")
    except _REFUSED as exc:
        raise APIError(str(exc), param=exc.param) from None
    return RoutedRequest(path, body, req, [e[0] for e in encoded], request_id, raw, [e[1] for e in encoded],
                         frontend, encoded[0][2], forwarded, chat_body)
