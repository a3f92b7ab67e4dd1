"""The router raises its soft open-files limit at start (``pdpool.utils.raise_open_files_limit``), as vLLM and
SGLang do: started with a soft limit of 128, it still serves 400 clients connected at once."""

from __future__ import annotations

import resource
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster import wait_for
from routers import RouterProcess

CLIENTS = 400


@pytest.fixture
def router_with_a_low_limit(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))   # what the router inherits
    try:
        router = RouterProcess("router-fds", ["--both", "http://127.0.0.1:9"], tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        wait_for(lambda: live(router), 60, "the router to answer /health/live")   # no node: never ready
        yield router, hard
    finally:
        router.stop()


def live(router) -> bool:
    assert router.alive, router.log_tail()
    try:
        return httpx.get(router.url + "/health/live", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def soft_limit(pid: int) -> int:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line")


def test_many_clients_at_once_under_a_low_inherited_limit(router_with_a_low_limit):
    router, hard = router_with_a_low_limit
    assert soft_limit(router.proc.pid) == min(65536, hard)
    if min(65536, hard) < CLIENTS + 100:
        pytest.fail(f"this machine's hard open-files limit ({hard}) is below what the test needs")
    socks = [socket.create_connection((router.host, router.port), timeout=30) for _ in range(CLIENTS)]
    try:
        def ask(s: socket.socket) -> bytes:
            s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data.split(b"\r\n", 1)[0]

        with ThreadPoolExecutor(32) as pool:   # all connected before any is answered: all held at once
            lines = list(pool.map(ask, socks))
        assert lines == [b"HTTP/1.1 200 OK"] * CLIENTS
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("start", [128, 70000])
def test_the_limit_is_raised_never_lowered(start):
    """In a child process (the limit is the process's): a low soft limit goes up to 65536 or the hard limit, a
    higher one stays."""
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if start > hard:
        start = hard
    code = ("import resource; from pdpool.utils import raise_open_files_limit as r; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({start}, {hard})); print(r()[0])")
    got = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert got == max(start, min(65536, hard))
