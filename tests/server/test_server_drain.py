"""The preStop hook (``python -m pdpool.operator.drain``) against a real node: readiness turns off, requests in
flight and new ones are still served, and the internal token is enforced."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

TOKEN = "drain-token"


def test_drain_turns_readiness_off_and_keeps_serving(launch_server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    node = launch_server("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--internal-token-file", str(token_file))
    try:
        assert httpx.get(node.url + "/health/ready").status_code == 200
        wrong = httpx.post(node.url + "/internal/drain", headers={"X-PDPool-Internal-Token": "nope"})
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_internal_token"
        assert httpx.get(node.url + "/health/ready").status_code == 200

        started = time.monotonic()
        hook = subprocess.run([sys.executable, "-m", "pdpool.operator.drain", "--port", str(node.port),
                               "--wait", "0.5"], env=dict(os.environ, PDPOOL_INTERNAL_TOKEN=TOKEN),
                              capture_output=True, text=True, timeout=60)
        assert hook.returncode == 0, hook.stderr
        assert time.monotonic() - started >= 0.5  # it waits out the lease after draining
        ready = httpx.get(node.url + "/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert httpx.get(node.url + "/health/live").status_code == 200  # draining is not dead: no restart
        out = node.client().completions.create(model="demo", prompt="Hello", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length"
    finally:
        node.stop()


def test_drain_hook_exits_cleanly_when_the_node_is_gone():
    # nothing listens on this port: the hook reports it and still waits, exiting 0 so the pod terminates
    hook = subprocess.run([sys.executable, "-m", "pdpool.operator.drain", "--port", "9", "--wait", "0"],
                          capture_output=True, text=True, timeout=60)
    assert hook.returncode == 0
    assert "drain:" in hook.stderr

