"""Router processes for tests: ``pdpool router`` on a free port, next to the disaggregation test cluster
(``tests/disagg/cluster.py``: real nodes, real Redis, real NIXL)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from cluster import INTERNAL_TOKEN, REDIS_PASSWORD  # noqa: E402

from pdpool.node_process import NodeProcess  # noqa: E402

BLOCK_SIZE = 16


class RouterProcess(NodeProcess):
    def __init__(self, name: str, flags: list[str], log_dir: Path, api_key: str | None = None,
                 every_address: bool = False) -> None:
        """``every_address``: no --host (the router's default: every address); reached on 127.0.0.1 still."""
        super().__init__(name)
        self.api_key = api_key
        env = dict(os.environ, PDPOOL_INTERNAL_TOKEN=INTERNAL_TOKEN, PDPOOL_REDIS_PASSWORD=REDIS_PASSWORD)
        env.pop("PDPOOL_API_KEY", None)
        if api_key:
            env["PDPOOL_API_KEY"] = api_key
        host = [] if every_address else ["--host", self.host]
        argv = ["router", "--model", "demo", *host, "--port", str(self.port), "--dtype", "float32",
                "--block-size", str(BLOCK_SIZE), "--discovery-seconds", "0.1", "--node-cooldown", "0.5", *flags]
        self.launch(argv, env, log_dir / f"{name}.log")

    def wait_ready(self, timeout: float = 120.0) -> "RouterProcess":
        return super().wait_ready(timeout)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        headers = kw.pop("headers", {})
        if self.api_key:
            headers.setdefault("Authorization", f"Bearer {self.api_key}")
        return httpx.post(self.url + path, json=body, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def value(self, name: str) -> float:
        return self.metrics().get(name, 0.0)


def redis_flags(redis_url: str) -> list[str]:
    return ["--redis", redis_url, "--pool", "default"]
