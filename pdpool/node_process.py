"""A ``pdpool`` server (a node or a router) as a child process on a local port: start, readiness, ``/metrics``, stop.

``pdpool up`` supervises a pool with it, and the tests start their nodes with it::

    node = NodeProcess("decode-0", port=free_port())
    node.launch(["serve", "--model", "demo", "--role", "decode"], env, log_path)
    node.wait_ready(300)          # polls GET /health/ready; raises with the log's tail if the child dies
    node.metrics()                # {'name{label="v"}': value}
    node.stop()                   # SIGTERM, then SIGKILL after a grace period

Only the standard library and prometheus_client (for parsing ``/metrics``): no torch, no HTTP client package.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from pdpool.utils import http_url


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual race: bind it soon)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; HTTP errors are answers, connection errors raise ``OSError``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{label="v"}': value} (labels sorted), plain names for unlabeled samples."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


class ProcessExited(RuntimeError):
    """The child exited while we waited for it to become ready."""


class NodeProcess:
    """One ``python -m pdpool.cli <argv>`` child listening on ``port`` (127.0.0.1)."""

    def __init__(self, name: str, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.name = name
        self.host = host
        self.port = port or free_port(host)
        self.url = http_url(host, self.port)
        self.base_url = self.url + "/v1"
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._log: IO[bytes] | None = None

    def launch(self, argv: list[str], env: dict | None = None, log_path: Path | None = None, *,
               stdout: int | IO[bytes] | None = None) -> "NodeProcess":
        """Start ``pdpool <argv>``; its output goes to ``log_path`` (or ``stdout``, e.g. a pipe)."""
        self.log_path = log_path
        if log_path is not None:
            self._log = open(log_path, "ab")
            stdout = self._log
        self.proc = subprocess.Popen([sys.executable, "-m", "pdpool.cli", *argv], stdout=stdout,
                                     stderr=subprocess.STDOUT, env=dict(os.environ) if env is None else env,
                                     start_new_session=True)
        return self

    def serve_argv(self, flags: list[str], model: str = "demo") -> list[str]:
        """``serve`` on this process's port, loopback only, one torch thread, plus ``flags``."""
        return ["serve", "--model", model, "--host", self.host, "--port", str(self.port), "--num-threads", "1",
                *flags]

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def readiness(self) -> tuple[str, str | None]:
        """('ready' | 'loading' | 'draining' | 'failed' | 'down', error)."""
        try:
            status, body = http_get(self.url + "/health/ready", timeout=2)
        except OSError:
            return "down", None
        if status == 200:
            return "ready", None
        with contextlib.suppress(ValueError):
            reply = json.loads(body)
            return str(reply.get("status", "loading")), reply.get("error")
        return "loading", None

    def wait_ready(self, timeout: float) -> "NodeProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                code = self.proc.returncode if self.proc is not None else None
                raise ProcessExited(f"{self.name} exited with {code}:\n{self.log_tail()}")
            state, error = self.readiness()
            if state == "ready":
                return self
            if state == "failed":
                raise RuntimeError(f"{self.name}: failed to start: {error}\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.url + "/metrics", timeout=10)
        if status != 200:
            raise RuntimeError(f"{self.name}: GET /metrics answered {status}")
        return parse_metrics(body.decode())

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the child (no clean shutdown)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._close_log()

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM (the node drains and deregisters), SIGKILL after ``grace`` seconds; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()
        return self.proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
