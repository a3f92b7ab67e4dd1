"""vLLM's ``allowed_token_ids``: only those ids are sampled (greedy or random, seeded or not), the rest of the
batch untouched, raw logprobs; a row left with nothing to sample fails alone; the field through a node."""

from __future__ import annotations

import httpx
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pdpool import LLM, SamplingParams
from pdpool.engine.sampler import Sampler
from pdpool.engine.sampling_params import SamplingParamsError

VOCAB = 64


def sample(logits, params, outputs=None):
    rows = len(params)
    return Sampler(seed=0).sample(logits, params, [[1, 2]] * rows, outputs or [[3]] * rows,
                                  [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
                                   for p in params])


@settings(max_examples=60, deadline=None)
@given(allowed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
       temperature=st.sampled_from([0.0, 0.7, 1.5]), top_k=st.sampled_from([0, 3]), seed=st.integers(0, 5))
def test_only_allowed_ids_are_sampled_and_batch_mates_are_untouched(allowed, temperature, top_k, seed):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    mates = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=seed)]
    restricted = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, allowed_token_ids=allowed,
                                logprobs=1)
    out = sample(logits, [mates[0], restricted, mates[1]])
    alone = sample(logits[[0, 2]], mates)
    assert not out.failed
    assert out.token_ids[1] in allowed
    assert [out.token_ids[0], out.token_ids[2]] == alone.token_ids
    raw = torch.log_softmax(logits[1], -1)[out.token_ids[1]].item()
    assert out.logprobs[1] == pytest.approx(raw, abs=1e-5)          # logprobs stay the raw model's
    if temperature == 0.0:
        assert out.token_ids[1] == max(allowed, key=lambda t: logits[1, t].item())


def test_nothing_left_to_sample_fails_that_row_alone():
    eos = 5
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    stuck = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[eos], allowed_token_ids=[eos])
    ok = SamplingParams(temperature=0.0)
    out = Sampler(seed=0).sample(logits, [stuck, ok], [[1]] * 2, [[]] * 2, [None] * 2)
    assert set(out.failed) == {0} and "allowed" in out.failed[0]
    assert out.token_ids[1] == logits[1].argmax().item()


@pytest.mark.parametrize("bad", [[], "1", [1.5], [True], [-1], 7])
def test_bad_values_name_the_field(bad):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(allowed_token_ids=bad).validate(VOCAB)
    assert err.value.param == "allowed_token_ids"


def test_ids_beyond_the_vocabulary_are_refused_when_it_is_known():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(allowed_token_ids=[VOCAB]).validate(VOCAB)
    assert err.value.param == "allowed_token_ids"


def test_the_engine_generates_only_allowed_ids():
    llm = LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=128, num_kv_blocks=32)
    ids = llm.frontend.encode_prompt("The capital of France is")
    allowed = [28, 260, 314, 1345]
    outs = llm.generate([ids, ids], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                    allowed_token_ids=allowed),
                                     SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    plain = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert set(outs[0].output_token_ids) <= set(allowed)
    assert outs[1].output_token_ids == plain.output_token_ids
