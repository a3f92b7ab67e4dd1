"""Where ``pdpool serve`` listens: without --host on every address, IPv4 and IPv6 (in an IPv6-only cluster the
kubelet probes the pod's IPv6 address; 0.0.0.0, the old default, refused it and the pool never became ready); with
--host exactly there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdpool.node_process import NodeProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from listen_checks import get, has_ipv6_loopback, loopbacks, refused  # noqa: E402


def _serve(tmp_path, *host_flags: str) -> NodeProcess:
    node = NodeProcess("node")
    return node.launch(["serve", "--model", "demo", *host_flags, "--port", str(node.port), "--num-threads", "1",
                        "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "16"],
                       log_path=tmp_path / "node.log")


def test_a_node_without_host_answers_on_ipv4_and_ipv6(demo_model_dir, tmp_path):
    node = _serve(tmp_path)
    try:
        for host in loopbacks():
            assert get(host, node.port, "/health/live", log=node.log_tail).status_code == 200, host
        node.wait_ready(300)
        for host in loopbacks():
            models = get(host, node.port, "/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["demo"], host
        assert "listening on http://0.0.0.0:" in node.log_tail(20000)
    finally:
        node.stop()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_node_with_host_listens_there_alone(demo_model_dir, tmp_path):
    node = _serve(tmp_path, "--host", "::1")
    try:
        assert get("[::1]", node.port, "/health/live", log=node.log_tail).status_code == 200
        assert refused("127.0.0.1", node.port)
    finally:
        node.stop()
