"""One server for every test under tests/server (float32, API key from the environment), and the demo model's
front end and HF tokenizer for the tests that compare with transformers."""

from __future__ import annotations

import pytest

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 128
BLOCK_SIZE = 16


def _node(launch_server, *flags: str):
    srv = launch_server("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks",
                        str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8", *flags,
                        api_key=API_KEY)
    srv.max_model_len = MAX_MODEL_LEN
    srv.num_kv_blocks = NUM_KV_BLOCKS
    return srv


@pytest.fixture(scope="package")
def server(launch_server):
    srv = _node(launch_server)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def permissive_server(launch_server):
    """A node that takes what ``server`` refuses: clients' chat templates, tool_choice "auto" (hermes parser), and
    logprobs' tokens as ids by default."""
    srv = _node(launch_server, "--trust-request-chat-template", "--enable-auto-tool-choice", "--tool-call-parser",
                "hermes", "--return-tokens-as-token-ids")
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def client(server):
    return server.client()


@pytest.fixture(scope="package")
def frontend(demo_model_dir):
    from pdpool.frontend import Frontend

    return Frontend.from_model(str(demo_model_dir))


@pytest.fixture(scope="package")
def hf_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)
