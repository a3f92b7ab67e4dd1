"""The OpenAI HTTP surface of one node (aiohttp): completions, chat, responses, Anthropic's messages, models,
health, metrics.

Pure HTTP: ``create_app(config, node, routes)`` receives what it serves. ``node`` (``ServedNode``, built by
``pdpool.node.Node``) gives the engine once loaded, the node's status and its metrics; ``routes`` are the node's
internal routes. ``/health/live`` answers 200 from the start, ``/health/ready`` (and ``/health``) 503 until the
engine is loaded and while the node drains, and ``/v1/*`` 503 while it loads.

Clients that disconnect cancel their handler (``handler_cancellation=True``), which aborts their requests.
``X-Request-Id`` (generated when absent) names the request in the response id, the engine's request ids and
the logs, and comes back as a response header. A request with an ``Origin`` is CORS, as vLLM's
(``pdpool.server.cors``): its preflight is answered before the API key, its other answers carry the CORS headers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from aiohttp import web

from pdpool import __version__
from pdpool.config import auto_tool_parser
from pdpool.logs import HEADER as REQUEST_ID_HEADER, request_id_from, request_id_var
from pdpool.server import anthropic_messages, json_body, openapi, protocol, responses, tokenize
from pdpool.server.anthropic_events import MessageEvents
from pdpool.server.auth import check_api_key
from pdpool.server.cors import CorsPolicy
from pdpool.server.errors import APIError, error_middleware
from pdpool.server.metrics import CONTENT_TYPE, ServerMetrics
from pdpool.server.response_events import ResponseEvents
from pdpool.server.serving import Generation, full_response, stream_response

logger = logging.getLogger("pdpool.server")

NODE_KEY = web.AppKey("node", object)
CONFIG_KEY = web.AppKey("config", object)

PUBLIC_PATHS = ("/health", "/metrics", "/openapi.json", "/ping", "/version",
                "/internal/")  # node-to-node: checked against the internal token instead (pdpool.internal_api)
TOKEN_IDS_FIELD = "pdpool_prompt_token_ids"


class ServedNode(Protocol):
    """What the app serves (``pdpool.node.Node``)."""
    status: str          # loading | ready | failed | draining | stopping
    error: str | None
    created: int
    metrics: ServerMetrics
    llm: object | None   # AsyncLLM once loaded

    def require_llm(self): ...
    def release_unclaimed(self, handles: list[dict]) -> None: ...  # KV handles no client received
    def refuse_kv_transfer(self, kv_transfer_params: dict) -> None: ...  # a refused request's handle: end its lease


def _auth_middleware(api_key: str | None):
    @web.middleware
    async def auth(request: web.Request, handler):
        if not request.path.startswith(PUBLIC_PATHS):
            check_api_key(request.headers, api_key)
        return await handler(request)

    return auth


def _cors_preflight_middleware(policy: CorsPolicy):
    """Answers a CORS preflight before the API key is asked for, as vLLM does (``pdpool.server.cors``)."""
    @web.middleware
    async def cors_preflight(request: web.Request, handler):
        headers = request.headers
        if request.method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers:
            status, text, cors_headers = policy.preflight(headers["Origin"], headers["Access-Control-Request-Method"],
                                                          headers.get("Access-Control-Request-Headers"))
            return web.Response(status=status, text=text, content_type="text/plain",
                                headers={name: _header_value(v) for name, v in cors_headers.items()})
        return await handler(request)

    return cors_preflight


def _cors_response_headers(policy: CorsPolicy):
    """Adds the CORS headers to every other answer to a request with an ``Origin``, errors and streams included
    (``on_response_prepare``: before the head is written)."""
    async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or (request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers):
            return                    # no CORS, or a preflight, answered whole by cors_preflight
        for name, value in policy.response_headers(origin, "Cookie" in request.headers).items():
            if name == "Vary" and "Vary" in response.headers:
                value = f"{response.headers['Vary']}, {value}"
            response.headers[name] = _header_value(value)

    return add_cors_headers


def _header_value(value: str) -> str:
    """An echoed request header (an origin, the asked headers) written back. aiohttp reads bytes that are no UTF-8
    as lone surrogates, which its C writer drops and its pure-Python one cannot encode (a 500): they become U+FFFD.
    (Control characters never get this far: its parser refuses them, a 400.)"""
    if value.isascii():
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


@web.middleware
async def _request_id_middleware(request: web.Request, handler):
    rid = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    request["request_id"] = rid
    request_id_var.set(rid)  # every log line about this request names it (pdpool.logs)
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        exc.headers[REQUEST_ID_HEADER] = rid
        raise
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = rid
    return response


# ---- handlers ------------------------------------------------------------------------------------

def _served_names(request: web.Request) -> list[str]:
    return request.app[CONFIG_KEY].served_model_names


def forwarded_token_ids(body: dict, num_prompts: int) -> list[list[int]] | None:
    """``pdpool_prompt_token_ids``: one non-empty list of token ids per prompt (a router's), or None."""
    ids = body.get(TOKEN_IDS_FIELD)
    if ids is None:
        return None
    if (not isinstance(ids, list) or len(ids) != num_prompts
            or not all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in ids)):
        raise APIError(f"'{TOKEN_IDS_FIELD}' must be a list of {num_prompts} non-empty lists of token ids "
                       "(one per prompt)", param=TOKEN_IDS_FIELD)
    return ids


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, lambda llm, body: (None, protocol.parse_completion(body, _served_names(request))))


def _parse_chat(request: web.Request, llm, body: dict) -> protocol.GenerationRequest:
    server = request.app[CONFIG_KEY].server
    return protocol.parse_chat(body, _served_names(request), llm.tokenizer.apply_chat_template,
                               auto_tool_parser(server), trust_chat_template=server.trust_request_chat_template)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, lambda llm, body: (None, _parse_chat(request, llm, body)))


async def responses_route(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API on the chat path (``pdpool.server.responses``)."""
    return await _translated_chat(request, responses)


async def messages_route(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API on the chat path (``pdpool.server.anthropic_messages``)."""
    return await _translated_chat(request, anthropic_messages)


async def _translated_chat(request: web.Request, api) -> web.StreamResponse:
    """Another API's request (``api.parse``: its chat body, parsed) run as that chat request; ``turn`` turns the
    answer back into the API's shape."""
    return await _generation(request, lambda llm, body: api.parse(body, lambda chat: _parse_chat(request, llm, chat)))


async def _generation(request: web.Request, parse) -> web.StreamResponse:
    """The generation routes' one path: the body, ``parse(llm, body)`` (the turn of another API's request, or None,
    and the parsed request), run. A body refused here, before the engine sees it (its fields, an unknown model),
    that hands a prefill node's KV handle over ends the handle's lease now, as the engine does for its own
    refusals (``refuse_kv_transfer``), rather than at its expiry, counted against the prefill node's
    ``--max-leased-blocks`` meanwhile."""
    body = await json_body.read_json(request)
    node = request.app[NODE_KEY]
    try:
        llm = node.require_llm()   # a 503 while the model loads: a refusal too
        turn, req = parse(llm, body)
        req.prompt_token_ids = forwarded_token_ids(body, len(req.prompts))
        _apply_server_options(request, llm, req)
    except Exception:
        kv_transfer_params = body.get("kv_transfer_params")
        if isinstance(kv_transfer_params, dict):   # else the parse refused them: they hold no handle
            node.refuse_kv_transfer(kv_transfer_params)
        raise
    return await _generate(request, llm, req, turn)


async def count_tokens_route(request: web.Request) -> web.Response:
    """Anthropic's ``POST /v1/messages/count_tokens``: the rendered prompt's tokens (``/tokenize``'s count)."""
    body = await json_body.read_json(request)
    turn = anthropic_messages.translate(body, count_tokens=True)
    llm = request.app[NODE_KEY].require_llm()
    trusted = request.app[CONFIG_KEY].server.trust_request_chat_template
    return web.json_response(anthropic_messages.counted(await asyncio.to_thread(
        tokenize.tokenize, anthropic_messages.count_tokens_body(turn), llm.frontend, _served_names(request),
        llm.max_model_len, trust_chat_template=trusted)))


def _apply_server_options(request: web.Request, llm, req: protocol.GenerationRequest) -> None:
    """What the server's flags and the request's headers add to a parsed request (the model's generation
    defaults among them, which may refuse it)."""
    server_config = request.app[CONFIG_KEY].server
    if req.return_tokens_as_token_ids is None:   # the request's choice wins, either way, as in vLLM
        req.return_tokens_as_token_ids = server_config.return_tokens_as_token_ids
    req.priority = protocol.header_priority(request.headers.get(protocol.PRIORITY_HEADER), req.priority)
    max_log_len = server_config.max_log_len
    if max_log_len:
        logger.info("request %s: %s prompt %r", request["request_id"], req.kind, str(req.prompts[0])[:max_log_len])
    if llm.generation_defaults:
        protocol.apply_generation_defaults(req, llm.generation_defaults, llm.max_model_len)


async def _generate(request: web.Request, llm, req: protocol.GenerationRequest,
                    turn: responses.ResponsesTurn | anthropic_messages.MessagesTurn | None = None
                    ) -> web.StreamResponse:
    """``turn``: a Responses request's, whose answer is a Response (its events, streamed) made of the chat's; or
    a Messages request's, whose answer is a Message (its events)."""
    rid = request["request_id"]
    gen = Generation(llm, req, rid)
    await gen.start()
    if req.stream:
        prompt_tokens = len(gen.choices[0].stream.prompt_token_ids)
        events = None
        if isinstance(turn, responses.ResponsesTurn):
            events = ResponseEvents(turn, req, rid, prompt_tokens, llm.max_model_len)
        elif turn is not None:
            events = MessageEvents(req, rid, prompt_tokens)
        return await stream_response(gen, request, events)

    async def answer() -> dict:
        chat = await full_response(gen)
        if isinstance(turn, responses.ResponsesTurn):
            return responses.response_body(turn, req, chat, rid, llm.max_model_len)
        return chat if turn is None else anthropic_messages.message_body(req, chat, rid)

    if not req.kv_transfer_params:
        return web.json_response(await answer(), headers={REQUEST_ID_HEADER: rid})
    # A prefill request: its response carries a KV handle (a lease on blocks). If the client never gets it (it
    # left, the write failed), nobody will ever claim the lease: release it now rather than at its expiry.
    body = None
    try:
        body = await answer()
        response = web.json_response(body, headers={REQUEST_ID_HEADER: rid})
        await response.prepare(request)
        await response.write_eof()
        return response
    except BaseException:
        unclaimed = [c.final.kv_transfer_params for c in gen.choices
                     if c.final is not None and c.final.kv_transfer_params]
        if unclaimed:
            request.app[NODE_KEY].release_unclaimed(unclaimed)
        raise


async def tokenize_route(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize`` (``pdpool.server.tokenize``)."""
    body = await json_body.read_json(request)
    llm = request.app[NODE_KEY].require_llm()
    trusted = request.app[CONFIG_KEY].server.trust_request_chat_template
    # Off the event loop (rendering and tokenizing a long text takes seconds): as a generation request's prompt
    return web.json_response(await asyncio.to_thread(tokenize.tokenize, body, llm.frontend, _served_names(request),
                                                     llm.max_model_len, trust_chat_template=trusted))


async def detokenize_route(request: web.Request) -> web.Response:
    """vLLM's ``POST /detokenize``."""
    body = await json_body.read_json(request)
    llm = request.app[NODE_KEY].require_llm()
    return web.json_response(tokenize.detokenize(body, llm.frontend, _served_names(request)))


def _model_card(request: web.Request, name: str) -> dict:
    cfg = request.app[CONFIG_KEY]
    node = request.app[NODE_KEY]
    card = {"id": name, "object": "model", "created": node.created, "owned_by": "pdpool", "root": cfg.model.model,
            "parent": None}
    if node.llm is not None:
        card["max_model_len"] = node.llm.max_model_len
    return card


async def models(request: web.Request) -> web.Response:
    """One card per served name (vLLM's, with several ``--served-model-name``)."""
    return web.json_response({"object": "list", "data": [_model_card(request, n) for n in _served_names(request)]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (OpenAI's retrieve): the card of a served name, else a 404 naming what is."""
    names = _served_names(request)
    if request.match_info["model"] not in names:
        raise protocol.model_not_found(request.match_info["model"], names)
    return web.json_response(_model_card(request, request.match_info["model"]))


async def version(request: web.Request) -> web.Response:
    """vLLM's ``/version``: the server's pdpool version."""
    return web.json_response({"version": __version__})


async def health_live(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def health_ready(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    if node.status == "ready":
        return web.json_response({"status": "ready", "role": request.app[CONFIG_KEY].server.role})
    body = {"status": node.status}
    if node.error:
        body["error"] = node.error
    return web.json_response(body, status=503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[NODE_KEY].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi_page(request: web.Request) -> web.Response:
    """This node's routes (those of its app's route table, less the node-to-node ``/internal/`` ones)."""
    cfg, llm = request.app[CONFIG_KEY], request.app[NODE_KEY].llm
    return web.json_response(openapi.spec(
        served_routes(request.app), title="pdpool node", served_model_names=_served_names(request),
        api_key=bool(cfg.server.api_key), vocab_size=llm.frontend.vocab_size if llm is not None else None,
        max_model_len=llm.max_model_len if llm is not None else None,
        auto_tool_choice=auto_tool_parser(cfg.server) is not None,
        chat_template=cfg.server.trust_request_chat_template))


def served_routes(app: web.Application) -> list[tuple[str, str]]:
    """The (method, path) pairs ``app`` serves to clients: HEAD (aiohttp's twin of each GET) and ``/internal/``
    left out; a path parameter's regex dropped (``/v1/models/{model:.+}`` is ``/v1/models/{model}``)."""
    routes = []
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method != "HEAD" and not path.startswith("/internal/"):
            routes.append((route.method, path))
    return routes


# ---- app -----------------------------------------------------------------------------------------

def create_app(node_config, node: ServedNode, routes: list[web.RouteDef] = ()) -> web.Application:
    """The node's app: the OpenAI routes, health, metrics, and the node's own ``routes``."""
    cors = CorsPolicy.from_config(node_config.server)
    app = web.Application(middlewares=[_cors_preflight_middleware(cors), _request_id_middleware, error_middleware,
                                       _auth_middleware(node_config.server.api_key)],
                          client_max_size=json_body.MAX_BODY_BYTES,
                          handler_args={"auto_decompress": False,   # json_body.read_json decodes, as the router
                                        "max_line_size": json_body.MAX_HEAD_BYTES,
                                        "max_field_size": json_body.MAX_HEAD_BYTES,
                                        # an idle connection, or one whose request head stopped arriving, is
                                        # closed after this, as the router's (aiohttp's default: 3630 s)
                                        "keepalive_timeout": json_body.REQUEST_SECONDS})
    app.on_response_prepare.append(_cors_response_headers(cors))
    app[NODE_KEY] = node
    app[CONFIG_KEY] = node_config
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses_route)
    app.router.add_post(anthropic_messages.PATH, messages_route)
    app.router.add_post(anthropic_messages.COUNT_TOKENS_PATH, count_tokens_route)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health_ready)
    app.router.add_get("/health/live", health_live)
    app.router.add_get("/version", version)
    app.router.add_get("/health/ready", health_ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_page)
    app.add_routes(list(routes))
    return app
