"""Logging for every pdpool process, and the request id in every log line about a request.

``configure()`` sets the one format (``... [request id] message``); a server sets ``request_id_var`` for the
duration of each request (from ``X-Request-Id``, see ``request_id_from``), so whatever logs on its behalf, on the
event loop, names it. The router forwards the id to the nodes, so one id follows a request through the pool.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

HEADER = "X-Request-Id"
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("pdpool_request_id", default="-")
_VALID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")

def request_id_from(header: str | None) -> str:
    """The client's id when it is a sane token (it ends up in log lines and node ids), else a fresh one."""
    if header and _VALID.match(header):
        return header
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
