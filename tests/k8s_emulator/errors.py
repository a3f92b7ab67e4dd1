"""Kubernetes `Status` failures, raised by the API logic and rendered by the HTTP layer."""

from __future__ import annotations

REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
           406: "NotAcceptable", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType",
           422: "Invalid", 500: "InternalError", 501: "NotImplemented"}


class ApiError(Exception):
    def __init__(self, code: int, message: str, reason: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def qualified(rt) -> str:
    """`deployments.apps`, or `pods` for the core group, as the API server names resources."""
    return f"{rt.plural}.{rt.group}" if rt.group else rt.plural


def not_found(rt, name: str) -> ApiError:
    return ApiError(404, f'{qualified(rt)} "{name}" not found',
                    details={"name": name, "group": rt.group, "kind": rt.plural})


def already_exists(rt, name: str) -> ApiError:
    return ApiError(409, f'{qualified(rt)} "{name}" already exists', reason="AlreadyExists",
                    details={"name": name, "group": rt.group, "kind": rt.plural})


def conflict(rt, name: str) -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on {qualified(rt)} "{name}": the object has been '
                         "modified; please apply your changes to the latest version and try again",
                    details={"name": name, "group": rt.group, "kind": rt.plural})


def invalid(rt, name: str, causes: list[dict]) -> ApiError:
    """422 with one cause per field: {"reason": "FieldValueInvalid", "message": ..., "field": "spec.x"}."""
    kind = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
    summary = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
    message = f'{kind} "{name}" is invalid: ' + (f"[{summary}]" if len(causes) > 1 else summary)
    return ApiError(422, message, details={"name": name, "group": rt.group, "kind": rt.kind, "causes": causes})


def not_implemented(what: str) -> ApiError:
    return ApiError(501, f"the emulator does not implement {what}")
