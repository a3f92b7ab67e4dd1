"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, never a bare 500."""

from __future__ import annotations

from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error the client should see, with its HTTP status and the offending ``param``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn every failure into OpenAI error JSON; the server keeps serving."""
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(APIError(exc.reason or "HTTP error", status=exc.status))
    except Exception as exc:  # noqa: BLE001 - the server must stay up
        request.app.logger.exception("internal error on %s %s", request.method, request.path)
        return error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500))
