"""A ``max_model_len`` larger than the whole KV cache holds is cut to the cache's size, and said so at start (vLLM
refuses to start there): a request that could never fit the pool, even alone, is then refused at once with the
context-length error, and one that fits runs to the limit ("length") beside a batch-mate that needs the rest of the
pool, every block free after. Real engine (demo model, float32)."""

from __future__ import annotations

import logging

import pytest

from pdpool import LLM, SamplingParams
from pdpool.frontend import InvalidRequestError

NUM_BLOCKS, BLOCK = 8, 8


@pytest.fixture(scope="module")
def capped(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=256, num_kv_blocks=NUM_BLOCKS,
               block_size=BLOCK, max_num_batched_tokens=16)


def test_a_max_model_len_the_kv_cache_cannot_hold_is_cut_with_a_warning(demo_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="pdpool.engine.llm_engine"):
        llm = LLM("demo", dtype="float32", num_threads=1, max_model_len=256, num_kv_blocks=NUM_BLOCKS,
                  block_size=BLOCK)
    assert llm.engine.max_model_len == NUM_BLOCKS * BLOCK
    assert any("max_model_len 256 is more than the KV cache holds (8 blocks of 8 tokens); using 64" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("under", [-1, 0, 1, 2])
def test_prompts_at_the_limit_of_the_cache(capped, under):
    engine = capped.engine
    limit = engine.max_model_len
    n = limit - under
    mate = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    if n >= limit:
        with pytest.raises(InvalidRequestError, match=f"maximum context length is {limit} tokens"):
            capped.generate([[200 + i for i in range(20)], [100 + i for i in range(n)]],
                            [mate, SamplingParams(max_tokens=16)], use_tqdm=False)
    else:
        outs = capped.generate([[200 + i for i in range(20)], [100 + i for i in range(n)]],
                               [mate, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)],
                               use_tqdm=False)
        assert [(len(o.output_token_ids), o.finish_reason) for o in outs] == [(40, "length"), (limit - n, "length")]
    assert engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not engine.has_unfinished_requests()
