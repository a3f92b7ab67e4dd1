"""A ``pdpool serve`` subprocess on a free local port: start, readiness, ``/metrics`` parsing, stop. Shared by the
single-node server tests (``conftest.Server``) and the disaggregated cluster (``disagg/cluster.Node``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from redis_server import free_port


class NodeProcess:
    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"

    def _launch(self, flags: list[str], env: dict, log_path: Path) -> None:
        """``pdpool serve --model demo`` on this port, one torch thread, output into ``log_path``."""
        self.log_path = log_path
        argv = [sys.executable, "-m", "pdpool.cli", "serve", "--model", "demo", "--host", "127.0.0.1",
                "--port", str(self.port), "--num-threads", "1", *flags]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(self.url + "/health/ready", timeout=2)
                if r.status_code == 200:
                    return self
                if r.json().get("status") == "failed":
                    raise RuntimeError(f"{self.name}: engine failed to load:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {'name{label="v"}': value} (labels sorted), plus plain names for unlabeled ones."""
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
