"""Router fixtures: one redis-server and one 1 prefill + 2 decode cluster per module (tests/disagg/cluster.py),
router processes started by the tests (``start_router``), stopped after the module, and one colocated node for the
package (``colocated_node``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from cluster import running_nodes  # noqa: E402  (puts tests/ on sys.path)
from routers import RouterProcess  # noqa: E402

# Decode nodes get a small cache (40 blocks of 16 tokens) so that the prefix-routing workload cannot keep every
# group's system prompt on every node; the prefill node's lease cap (24 blocks) lets one test provoke a 429.
CLUSTER = {
    "p0": ("prefill", ["--max-leased-blocks", "24"]),
    "d0": ("decode", ["--num-kv-blocks", "40"]),
    "d1": ("decode", ["--num-kv-blocks", "40"]),
}


COLOCATED_MAX_MODEL_LEN = 512   # schemathesis' shaped prompts fit (tests/schemathesis_run.py)


@pytest.fixture(scope="package")
def colocated_node(launch_server):
    """One colocated node without an API key, for the modules whose routers front a single node (CORS, the model
    card, served names, schemathesis): started once for the package; they send it requests and change nothing on
    it."""
    srv = launch_server("--dtype", "float32", "--max-model-len", str(COLOCATED_MAX_MODEL_LEN), "--num-kv-blocks",
                        "96", "--block-size", "16", "--max-num-seqs", "4")
    srv.max_model_len = COLOCATED_MAX_MODEL_LEN
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory, redis_module):
    with running_nodes(CLUSTER, tmp_path_factory.mktemp("nodes"), redis_module.url) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def start_router(demo_model_dir, tmp_path_factory):
    started: list[RouterProcess] = []
    log_dir = tmp_path_factory.mktemp("routers")

    def start(flags: list[str], name: str | None = None, api_key: str | None = None, wait: bool = True,
              every_address: bool = False):
        router = RouterProcess(name or f"router-{len(started)}", flags, log_dir, api_key, every_address)
        started.append(router)
        return router.wait_ready() if wait else router

    yield start
    for router in started:
        router.stop(grace=5)
