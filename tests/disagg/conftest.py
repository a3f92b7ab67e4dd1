"""Disaggregation fixtures (see ``cluster.py``): one redis-server and the nodes of each test module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import Node  # noqa: E402  (puts tests/ on sys.path)


@pytest.fixture(scope="module")
def start_nodes(demo_model_dir, tmp_path_factory, redis_module):
    """``start_nodes({"name": (role, [flags])})`` starts them in parallel, waits, and stops them after the module."""
    started: list[Node] = []

    def start(spec: dict[str, tuple[str, list[str]]]) -> dict[str, Node]:
        log_dir = tmp_path_factory.mktemp("nodes")
        nodes = {}
        for name, (role, flags) in spec.items():
            nodes[name] = Node(name, role, flags, log_dir, redis_module.url)
            started.append(nodes[name])
        for node in nodes.values():
            node.wait_ready()
        return nodes

    yield start
    for node in started:
        node.stop()


