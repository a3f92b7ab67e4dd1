"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, never a bare 500."""

from __future__ import annotations

import logging
import uuid

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger("pdpool.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}
# Anthropic's error types (its Messages API), by status
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"


class APIError(Exception):
    """An error the client should see, with its HTTP status and the offending ``param``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _TYPES.get(status) or ("internal_server_error" if status >= 500 else
                                                   "invalid_request_error")
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's shape, as its Messages API answers (vLLM's ``/v1/messages`` too)."""
        kind = _ANTHROPIC_TYPES.get(self.status) or ("api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict:
        """The error's body on ``path``: Anthropic's shape on its Messages API, else OpenAI's."""
        return self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()


def error_response(err: APIError, headers: dict | None = None, path: str = "") -> web.Response:
    return web.json_response(err.body_for(path), status=err.status,
                             headers={"Retry-After": "1", **(headers or {})} if err.status == 429 else headers)


def _client_left(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn every failure into OpenAI error JSON; the server keeps serving. aiohttp's own errors (404 for an
    unknown path, 405 with its ``Allow`` header, 413 for too large a body) keep their status. An unexpected
    exception is a 500 whose message names only an error id: the traceback goes to the log under that id, and
    no internal text reaches the client."""
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err, path=request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = exc.headers.get("Allow")
        return error_response(APIError(exc.reason or "HTTP error", status=exc.status),
                              headers={"Allow": allow} if allow is not None else None, path=request.path)
    except Exception as exc:  # noqa: BLE001 - the server must stay up
        if isinstance(exc, ConnectionResetError) and _client_left(request):
            # The answer's write failed because its client left: nobody reads a status now, and no fault here.
            logger.info("client left before the answer to %s %s was written", request.method, request.path)
            return web.Response(status=499)
        error_id = uuid.uuid4().hex[:16]
        logger.exception("internal error %s on %s %s", error_id, request.method, request.path)
        return error_response(APIError(f"internal server error (error id {error_id}; the server log has the "
                                       "details)", status=500), path=request.path)


def _parse_reason(exc: HttpProcessingError) -> str:
    """The first line of the parser's message (aiohttp adds the offending bytes and a caret below it)."""
    return (exc.message or type(exc).__name__).strip().split("\n", 1)[0].rstrip(":")[:200]


def _refusal(exc: HttpProcessingError) -> tuple[int, str]:
    """The status and message a node answers a request its parser refused with, as the router answers it."""
    if isinstance(exc, LineTooLong):
        return 431, f"the request line or a header is longer than {exc.args[1]} bytes"
    return 400, f"malformed HTTP request: {_parse_reason(exc)}"


class _MalformedRequestLine(logging.Filter):
    """aiohttp logs a request it cannot parse (conflicting framing, a missing Host, a line over its limits) as an
    error with a traceback, before it is answered (400, 431). The fault is the client's, and a client could fill the log with
    tracebacks, so such a record becomes one info line that names the client and the parser's reason. Every other
    record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and record.levelno > logging.INFO:
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            reason, status = _parse_reason(exc), _refusal(exc)[0]
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "malformed HTTP request from %s: %s (answered %d)", (remote, reason, status)
            record.exc_info = record.exc_text = None
        return True


def http_logger() -> logging.Logger:
    """The logger for a node's aiohttp server (``AppRunner(logger=...)``): its parse errors as one info line."""
    log = logging.getLogger("pdpool.server.http")
    if not any(isinstance(f, _MalformedRequestLine) for f in log.filters):
        log.addFilter(_MalformedRequestLine())
    return log


class _OpenAIErrorRequestHandler(RequestHandler):
    """A connection whose own error answers (a request aiohttp's parser refuses, a failure outside the app's
    middlewares, an ``Expect`` other than ``100-continue``) are OpenAI error JSON, as the router's are, where
    aiohttp answered plain text. aiohttp still logs a parse error (one info line through ``http_logger``) and
    closes the connection."""

    async def finish_response(self, request, resp: web.StreamResponse, start_time):
        if isinstance(resp, web.HTTPException) and resp.status >= 400:   # raised before the middlewares ran:
            resp = error_response(APIError(resp.text or resp.reason, status=resp.status))   # aiohttp's Expect check
        return await super().finish_response(request, resp, start_time)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)
        if isinstance(exc, HttpProcessingError):
            status, text = _refusal(exc)
        else:
            text = "internal server error" if status == 500 else (message or plain.reason)
        answer = error_response(APIError(text, status=status))
        answer.force_close()
        return answer


class _OpenAIErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenAIErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class NodeRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer aiohttp's own errors in the OpenAI shape."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorServer   # the app's server as built, with the error answers above
        return server
