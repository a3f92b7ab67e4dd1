"""The router passes the client's ``X-Vllm-Priority`` on to its nodes, which honour it as vLLM 0.32 does (the
header, an integer, wins over the body's ``priority``): the node's own test (tests/server/test_priority_header.py),
through a router in front of a real colocated node with ``--scheduling-policy priority --max-num-seqs 1``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_priority_header import finish_order  # noqa: E402


@pytest.fixture(scope="module")
def router(launch_server, start_router):
    node = launch_server("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "96",
                         "--max-num-seqs", "1", "--scheduling-policy", "priority")
    yield start_router(["--both", node.url], name="router-priority")
    node.stop()


def test_the_header_reaches_the_node_and_wins_over_the_body(router):
    order = asyncio.run(finish_order(router, [
        ("header-9", {"priority": 0}, {"X-Vllm-Priority": "9"}),
        ("body-5", {"priority": 5}, {}),
        ("not-a-number", {"priority": 1}, {"X-Vllm-Priority": "soon"}),
    ]))
    assert order == ["long", "not-a-number", "body-5", "header-9"]
