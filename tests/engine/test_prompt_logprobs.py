"""``SamplingParams.prompt_logprobs`` (completions' ``echo`` with ``logprobs``): the model's logprob of every prompt
token given the tokens before it, against HF transformers' on the demo model, whole or chunked, with the prefix
cache warm, beside batch-mates that did not ask."""

from __future__ import annotations

import pytest

from pdpool.engine.llm import LLM
from pdpool.engine.sampling_params import SamplingParams, SamplingParamsError

PROMPT = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father had taught him, "
          "and lit the lamp before the ships came round the northern cape in the dark.")


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=256, num_kv_blocks=64,
               block_size=16, max_num_batched_tokens=24)   # a 40-token prompt is computed in two chunks


def check_against_hf(hf_reference, prompt_ids: list[int], entries, top_n: int) -> None:
    import torch

    expected = hf_reference.logprobs(prompt_ids[:1], prompt_ids[1:])   # [n - 1, V]: token i from tokens < i
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt_ids[i]
        assert e.logprob == pytest.approx(expected[i - 1, prompt_ids[i]].item(), abs=2e-4)
        if top_n:
            values, ids = torch.topk(expected[i - 1], top_n)
            assert [t for t, _ in e.top] == ids.tolist() or \
                [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=2e-4)   # a tie may swap two ids
        else:
            assert e.top is None


@pytest.mark.parametrize("top_n", [0, 3])
def test_prompt_logprobs_match_transformers_across_chunks(llm, hf_reference, top_n):
    ids = llm.frontend.encode_prompt(PROMPT)
    assert len(ids) > 24
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=top_n))[0]
    check_against_hf(hf_reference, ids, out.prompt_logprobs, top_n)
    assert out.output_token_ids == hf_reference.greedy(ids, 2)


def test_a_cached_prompt_is_computed_again_and_batch_mates_are_untouched(llm, hf_reference):
    ids = llm.frontend.encode_prompt(PROMPT)
    plain = SamplingParams(max_tokens=4, temperature=0)
    alone = llm.generate([ids], plain)[0]                  # the prompt's blocks are now in the prefix cache
    assert alone.prompt_logprobs is None
    both = llm.generate([ids, ids], [plain, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)])
    assert both[0].output_token_ids == alone.output_token_ids and both[0].prompt_logprobs is None
    assert both[1].output_token_ids == alone.output_token_ids
    assert both[1].num_cached_tokens == 0                  # read nothing from the cache
    check_against_hf(hf_reference, ids, both[1].prompt_logprobs, 1)


def test_a_one_token_prompt_has_only_its_none():
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert params.prompt_logprobs == 0
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.param == "prompt_logprobs"


def test_one_token_prompt(llm):
    out = llm.generate([[1]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None]


def test_one_token_chunks_beside_a_decoding_request(hf_reference):
    """A budget of 2 tokens a step: once the first request decodes, the second one's prompt goes one token a step,
    in steps where every row computes one token (the runner's decode packing)."""
    llm = LLM("demo", dtype="float32", num_threads=1, max_num_seqs=2, max_model_len=128, num_kv_blocks=32,
              block_size=16, max_num_batched_tokens=2)
    first, second = llm.frontend.encode_prompt("Once upon a time"), llm.frontend.encode_prompt(PROMPT)[:12]
    outs = llm.generate([first, second], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                          SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)])
    check_against_hf(hf_reference, second, outs[1].prompt_logprobs, 2)


def test_offline_truncate_prompt_tokens(llm):
    """vLLM's truncate_prompt_tokens in the offline LLM too: the last k ids are the prompt."""
    ids = llm.frontend.encode_prompt(PROMPT)
    cut = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, truncate_prompt_tokens=9))[0]
    alone = llm.generate([ids[-9:]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert cut.prompt_token_ids == ids[-9:] and cut.output_token_ids == alone.output_token_ids
