"""Disaggregation test cluster: real node processes (one torch thread each), real redis-server, real NIXL over UCX
(``UCX_TLS=tcp,self`` pinned), the demo model. Nodes are shared by the tests of a module.

Nodes run with ``PDPOOL_TEST_HOOKS=1``: decode destination blocks are filled with large random values before every transfer,
and ``kv_transfer_params.pdpool_test_hold`` may hold a transfer at a chosen point.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: node_process, redis_server
sys.path.insert(0, str(Path(__file__).resolve().parent))       # tests/disagg: proxy
from pdpool.node_process import NodeProcess  # noqa: E402
from redis_server import TEST_PASSWORD  # noqa: E402

UCX_TLS = "tcp,self"
INTERNAL_TOKEN = "internal-test-token"
REDIS_PASSWORD = TEST_PASSWORD
BLOCK_SIZE = 16


class Node(NodeProcess):
    """A node process (``pdpool serve --role ...``); ``restart()`` brings it back on the same port."""

    def __init__(self, name: str, role: str, flags: list[str], log_dir: Path, redis_url: str | None) -> None:
        super().__init__(name)
        self.role = role
        self.flags = flags
        self.log_dir = log_dir
        self.redis_url = redis_url
        self.api_key = None
        self.starts = 0
        self._spawn()

    def _spawn(self) -> None:
        self.starts += 1
        flags = ["--role", self.role, "--node-id", self.name, "--ucx-tls", UCX_TLS, "--dtype", "float32",
                 "--block-size", str(BLOCK_SIZE), "--max-model-len", "512", "--num-kv-blocks", "96", *self.flags]
        if self.redis_url:
            flags += ["--redis", self.redis_url, "--heartbeat-seconds", "0.2"]
        env = dict(os.environ, PDPOOL_TEST_HOOKS="1", PDPOOL_INTERNAL_TOKEN=INTERNAL_TOKEN,
                   PDPOOL_REDIS_PASSWORD=REDIS_PASSWORD, UCX_TLS=UCX_TLS)
        env.pop("PDPOOL_API_KEY", None)
        self.launch(self.serve_argv(flags), env, self.log_dir / f"{self.name}-{self.starts}.log")

    def wait_ready(self, timeout: float = 300.0) -> "Node":
        return super().wait_ready(timeout)

    def complete(self, body: dict) -> dict:
        r = httpx.post(self.base_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def kill(self) -> None:
        """SIGKILL: no deregistration, no lease release."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def restart(self) -> "Node":
        self.stop()
        self._spawn()
        return self.wait_ready()

    def value(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def kv(self) -> dict[str, float]:
        m = self.metrics()
        return {"free": m["pdpool_kv_cache_free_blocks"], "leases": m.get("pdpool_kv_leases", 0.0),
                "pulled": m.get("pdpool_kv_pulled_bytes_total", 0.0),
                "pushed": m.get("pdpool_kv_pushed_bytes_total", 0.0),
                "recomputes": m.get("pdpool_kv_recomputes_total", 0.0),
                "ok": m.get('pdpool_kv_transfers_total{outcome="ok"}', 0.0),
                "fail": m.get('pdpool_kv_transfers_total{outcome="fail"}', 0.0),
                "expiries": m.get("pdpool_kv_lease_expiries_total", 0.0)}


@contextlib.contextmanager
def running_nodes(spec: dict[str, tuple[str, list[str]]], log_dir: Path, redis_url: str | None):
    """``{"name": (role, [flags])}``: the nodes started, ready; stopped on the way out (a failed start too), all at
    once: each stops as ``NodeProcess.stop`` stops it (SIGTERM, SIGKILL after its grace), and a node's exit takes
    seconds of CPU (the interpreter's teardown of torch), which one node after the other would add up."""
    nodes = {name: Node(name, role, flags, log_dir, redis_url) for name, (role, flags) in spec.items()}
    try:
        for node in nodes.values():
            node.wait_ready()
        yield nodes
    finally:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(nodes))) as pool:
            list(pool.map(lambda node: node.stop(), nodes.values()))


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def assert_no_leaks(nodes, start_free: dict[str, float], timeout: float = 10.0) -> None:
    """Every node's free-block count is back to its start and no lease is left."""
    for node in nodes:
        if node.proc.poll() is not None:
            continue
        wait_for(lambda: (lambda kv: kv["free"] == start_free[node.name] and kv["leases"] == 0)(node.kv()),
                 timeout, f"{node.name} to free its blocks and leases: {node.kv()} (start {start_free[node.name]})")


def completion_body(prompt, max_tokens: int = 12, **extra) -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}


def token_ids(response: dict) -> list[int]:
    return response["choices"][0]["token_ids"]


def internal_post(node: Node, path: str, token: str | None = INTERNAL_TOKEN, **kw) -> httpx.Response:
    headers = {"X-PDPool-Internal-Token": token} if token else {}
    return httpx.post(f"{node.url}/internal/{path}", headers=headers, timeout=10, **kw)
