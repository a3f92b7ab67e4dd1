"""Real processes for the operator's end-to-end tests: ``pdpool operator`` and a real ``redis-server``."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REDIS_SERVER = "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:  # noqa: BLE001 - the thing may not exist yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def posted_within(events: list[dict]) -> float:
    """Seconds between the first and the last of these Events (once, or again on every retry?)."""
    times = [datetime.datetime.fromisoformat(e["eventTime"]) for e in events]
    return (max(times) - min(times)).total_seconds()


class OperatorProcess:
    """``python -m pdpool.cli operator …`` against a kubeconfig, logging to a file."""

    def __init__(self, kubeconfig: Path, log_dir: Path, identity: str, *extra: str,
                 namespace: str = "default", lease_seconds: float = 2.0, status_interval: float = 0.3):
        self.identity = identity
        self.log_path = log_dir / f"operator-{identity}-{time.monotonic_ns()}.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        env.pop("POD_NAME", None)
        env.pop("POD_NAMESPACE", None)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdpool.cli", "operator", "--namespace", namespace, "--identity", identity,
             "--lease-seconds", str(lease_seconds), "--status-interval", str(status_interval), *extra,
             *(["--verbose"] if os.environ.get("PDPOOL_OPERATOR_VERBOSE") else [])],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class RedisServer:
    """A throwaway redis-server on a free port (no persistence)."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(tmp)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        wait_until(lambda: redis.Redis(port=self.port).ping(), 10, what="redis-server")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
