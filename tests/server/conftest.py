"""One server for every test under tests/server (float32, API key from the environment), and the demo model's
front end and HF tokenizer for the tests that compare with transformers."""

from __future__ import annotations

import pytest

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 128
BLOCK_SIZE = 16


@pytest.fixture(scope="package")
def server(launch_server):
    srv = launch_server("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks",
                        str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
                        api_key=API_KEY)
    srv.max_model_len = MAX_MODEL_LEN
    srv.num_kv_blocks = NUM_KV_BLOCKS
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
