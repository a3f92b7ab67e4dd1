"""vLLM's ``bad_words``: tokenized as vLLM does (the word, and with a leading space when that differs only in its
first token), a one-token word never sampled, a longer word's last token banned right after its other tokens, the
batch-mates untouched, through the overlapped loop and a node."""

from __future__ import annotations

import httpx
import pytest
import torch

from pdpool import LLM, SamplingParams
from pdpool.engine.sampler import Sampler
from pdpool.engine.sampling_params import SamplingParamsError

VOCAB = 64


def sample(logits, params, outputs):
    rows = len(params)
    return Sampler(seed=0).sample(logits, params, [[1]] * rows, outputs, [None] * rows)


def with_ids(ids: list[list[int]], **kw) -> SamplingParams:
    p = SamplingParams(temperature=0.0, bad_words=["x"], **kw)
    p.bad_words_token_ids = ids
    return p


def test_one_token_words_are_never_sampled_and_longer_ones_only_after_their_prefix():
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0
    logits[:, 9] = 4.0
    out = sample(logits, [with_ids([[7]]), with_ids([[3, 7]]), with_ids([[3, 7]])], [[1], [2, 3], [3, 2]])
    assert out.token_ids == [9, 9, 7]            # banned alone; banned after 3; 3 not last: allowed
    assert not out.failed


def test_a_row_left_with_nothing_fails_alone():
    logits = torch.zeros(2, VOCAB)
    stuck = with_ids([[t] for t in range(VOCAB)])
    out = sample(logits, [stuck, SamplingParams(temperature=0.0)], [[], []])
    assert set(out.failed) == {0} and "bad_words" in out.failed[0]


@pytest.mark.parametrize("bad", [5, [1], [None], {"a": 1}])
def test_bad_values_name_the_field(bad):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(bad_words=bad)
    assert err.value.param == "bad_words"


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=128, num_kv_blocks=32)


def test_tokenized_as_vllm_does(llm):
    tok = llm.frontend.tokenizer
    ids = llm.frontend.bad_words_token_ids(["Paris", " ocean"])
    assert tok.encode("Paris", add_special_tokens=False) in ids and tok.encode(" Paris", add_special_tokens=False) in ids
    assert tok.encode("ocean", add_special_tokens=False) in ids


def test_the_engine_never_writes_a_bad_word(llm):
    prompt = "The capital of France is"
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    first_word = plain.text.split()[0]
    outs = llm.generate([prompt, prompt], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                          bad_words=[first_word]),
                                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    assert first_word not in outs[0].text.split()[:1] and outs[0].text != plain.text
    assert outs[1].output_token_ids == plain.output_token_ids
    # a word of several tokens: its last token never follows the others
    words = llm.frontend.bad_words_token_ids([plain.text.strip()])
    long = [w for w in words if len(w) > 1]
    if long:
        banned = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                       bad_words=[plain.text.strip()]))[0].output_token_ids
        for w in long:
            assert not any(banned[i:i + len(w)] == w for i in range(len(banned)))
