"""The router's ``/v1/models`` card carries ``max_model_len`` as a node's does: the limit the nodes advertise
(their card when probed, their Redis heartbeat when discovered there), and a chat the router tokenizes reaches the
node as the node renders it itself (``continue_final_message``)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import redis_server  # noqa: E402,F401

from pdpool.kv_index import IndexReader, NodeIndex, NodeInfo, PoolKeys, connect  # noqa: E402
from pdpool.router.discovery_redis import RedisDiscovery  # noqa: E402
from pdpool.router.endpoints import Pool  # noqa: E402

MAX_MODEL_LEN = 384
KEYS = PoolKeys("ns", "p")


@pytest.fixture(scope="module")
def node(colocated_node):
    return colocated_node


@pytest.fixture(scope="module")
def router(node, start_router):
    return start_router(["--both", node.url], name="router-static")


def card(base_url: str) -> dict:
    r = httpx.get(f"{base_url}/models", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]


def test_router_card_has_the_nodes_max_model_len(node, router):
    assert card(node.base_url)["max_model_len"] == node.max_model_len   # the --max-model-len it started with
    assert card(router.base_url)["max_model_len"] == node.max_model_len
    r = httpx.get(f"{router.base_url}/models/demo", timeout=30)
    assert r.json()["max_model_len"] == node.max_model_len


def test_a_heartbeat_carries_max_model_len_to_redis_discovery(redis_server):
    index = NodeIndex(connect(redis_server.url, redis_server.password), KEYS, "n1", "i1")
    assert index.heartbeat(NodeInfo("n1", "decode", "http://n1:8000", "i1", max_model_len=MAX_MODEL_LEN))
    pool = Pool()
    reader = IndexReader(connect(redis_server.url, redis_server.password), KEYS)

    async def run_sync(fn, *args):
        return fn(*args)

    assert asyncio.run(RedisDiscovery(reader, pool, 1.0, run_sync).refresh())
    assert pool.endpoints["n1"].max_model_len == MAX_MODEL_LEN


def test_continue_final_message_through_the_router_is_the_nodes_prompt(node, router):
    body = {"model": "demo", "max_tokens": 3, "temperature": 0, "return_token_ids": True,
            "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "user", "content": "Name two planets."},
                         {"role": "assistant", "content": "Sure: Mars and"}]}
    direct = httpx.post(f"{node.base_url}/chat/completions", json=body, timeout=120)
    routed = httpx.post(f"{router.base_url}/chat/completions", json=body, timeout=120)
    assert direct.status_code == routed.status_code == 200, (direct.text, routed.text)
    assert routed.json()["choices"][0]["prompt_token_ids"] == direct.json()["choices"][0]["prompt_token_ids"]
    assert routed.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    refused = httpx.post(f"{router.base_url}/chat/completions", json={**body, "add_generation_prompt": True},
                         timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_generation_prompt"


def test_without_nodes_the_card_falls_back_to_the_models_config(demo_model_dir):
    import json

    from pdpool.frontend import ModelFiles

    config = json.loads((demo_model_dir / "config.json").read_text())
    assert ModelFiles.read(demo_model_dir).max_position_embeddings == config["max_position_embeddings"]
