"""A real redis-server on a free port, for tests (no persistence, optional password).

    sys.path.insert(0, "<repo>/tests")                        # as tests/operator/conftest.py does
    from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture, for a conftest.py)

    def test_x(redis_server):
        client = redis_server.client()

``stop()`` then ``start()`` brings the same server back on the same port (empty), to test outages.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
TEST_PASSWORD = "test-secret"  # the fixtures' servers, and the nodes the tests start against them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, password: str | None = None, port: int | None = None) -> None:
        self.password = password
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw):
        # redis-py is imported where it is used, so the root conftest loads on a host without it (the GPU machines)
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kw)

    def start(self, timeout: float = 10.0) -> "RedisServer":
        import redis

        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            argv += ["--requirepass", self.password]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        client = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def redis_server():
    """A fresh password-protected redis-server per test."""
    with RedisServer(password=os.environ.get("PDPOOL_TEST_REDIS_PASSWORD", TEST_PASSWORD)) as server:
        yield server


@pytest.fixture(scope="module")
def redis_module():
    """One password-protected redis-server for a module's tests (flush it yourself if a test needs it empty)."""
    with RedisServer(password=TEST_PASSWORD) as server:
        yield server
