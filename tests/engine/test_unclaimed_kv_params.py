"""A node that runs no KV connector (``pdpool serve`` alone: role both, no Redis) ignores ``kv_transfer_params``, as
vLLM does without one: the answer carries no ``kv_transfer_params``. It used to echo the request's own, so a vLLM-style
proxy that took this node for a prefill node read ``{"do_remote_decode": true}`` back as a KV handle and sent it to
its decode node, which refused it (400), instead of falling back to decode-only (vLLM answers null here)."""

from __future__ import annotations

import pytest

from pdpool import config
from pdpool.engine.llm_engine import LLMEngine
from pdpool.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(config.build(model="demo", dtype="float32", num_kv_blocks=32))


@pytest.mark.parametrize("params", [{"do_remote_decode": True}, {"do_remote_prefill": True, "remote_engine_id": "p"},
                                    {"vendor_field": 1}])
def test_without_a_connector_no_kv_transfer_params_come_back(engine, params):
    engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0), kv_transfer_params=params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    assert [out.kv_transfer_params for out in finals] == [None]
