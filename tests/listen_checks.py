"""What a server started without --host must answer on (tests/server, tests/router): 127.0.0.1 and, where this
machine has an IPv6 loopback, [::1]. A kubelet probes a pod's IP, which is IPv6 only in an IPv6-only cluster."""

from __future__ import annotations

import socket
import time

import httpx


def has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def loopbacks() -> list[str]:
    """The loopback hosts, as a URL writes them, a server listening on every address answers on here."""
    return ["127.0.0.1", "[::1]"] if has_ipv6_loopback() else ["127.0.0.1"]


def get(host: str, port: int, path: str, timeout: float = 60, log=lambda: "") -> httpx.Response:
    """GET http://host:port/path, retried while nothing listens yet (a server just started)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"http://{host}:{port}{path}", timeout=5)
        except httpx.TransportError as exc:
            assert time.monotonic() < deadline, f"nothing answers on {host}:{port}: {exc}\n{log()}"
            time.sleep(0.2)


def refused(host: str, port: int) -> bool:
    try:
        httpx.get(f"http://{host}:{port}/health/live", timeout=5)
    except httpx.ConnectError:
        return True
    return False
