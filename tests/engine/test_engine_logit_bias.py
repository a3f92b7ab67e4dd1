"""OpenAI's ``logit_bias``: parsed and clamped as vLLM does, added to the logits before penalties and sampling,
per request (a batch-mate's row never sees it), raw logprobs, and nothing to do for a batch without it."""

from __future__ import annotations

import math

import pytest
import torch

from pdpool import LLM, SamplingParams
from pdpool.engine.sampler import Sampler
from pdpool.engine.sampling_ops import SamplingPlan
from pdpool.engine.sampling_params import SamplingParamsError

VOCAB = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = "The capital of France is"


# ---- parameters ----------------------------------------------------------------------------------

def test_keys_are_parsed_values_clamped_and_empty_is_none():
    p = SamplingParams(logit_bias={"5": 1, 7: -2.5, "+9": 150, "-0": -1e300, "11": 10**400})
    assert p.logit_bias == {5: 1.0, 7: -2.5, 9: 100.0, 0: -100.0, 11: 100.0}
    assert all(type(v) is float for v in p.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams(logit_bias=None).logit_bias is None
    assert not SamplingParams().has_logit_bias and p.has_logit_bias


@pytest.mark.parametrize("bias", [
    [1, 2], "x", 3, {"a": 1}, {"1.5": 1}, {"": 1}, {" 1": 1}, {"1": True}, {"1": "1"}, {"1": None},
    {"1": float("nan")}, {"1": float("inf")}, {"1": [1]}, {"-1": 1}, {True: 1}, {1.0: 1}, {"\u0661": 1},
    {"1" * 30: 1},
])
def test_bad_logit_bias_is_an_error_naming_it(bias):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias"


def test_ids_are_checked_against_the_vocabulary_when_it_is_known():
    p = SamplingParams(logit_bias={"63": 1, "0": 1})
    p.validate(VOCAB)
    with pytest.raises(SamplingParamsError, match=r"\[0, 64\)") as err:
        SamplingParams(logit_bias={"64": 1}).validate(VOCAB)
    assert err.value.param == "logit_bias"


# ---- sampler -------------------------------------------------------------------------------------

def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(logits, params, **kw):
    rows = len(params)
    return Sampler(seed=0).sample(logits, params, [[1, 2]] * rows, [[3]] * rows, [None] * rows, **kw)


def test_bias_moves_greedy_and_logprobs_stay_raw():
    logits = _logits(3)
    top = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(logprobs=2, logit_bias={"17": 100}, **GREEDY),
              SamplingParams(logprobs=2, logit_bias={str(top[1]): -100}, **GREEDY),
              SamplingParams(logprobs=2, **GREEDY)]
    out = _sample(logits.clone(), params)
    second = logits[1].topk(2).indices[1].item()
    assert out.token_ids == [17, second, top[2]]
    raw = logits.log_softmax(dim=-1)
    for row, token in enumerate(out.token_ids):  # vLLM's raw_logprobs: before the bias
        assert math.isclose(out.logprobs[row], raw[row, token].item(), rel_tol=1e-5, abs_tol=1e-5)
        assert [t for t, _ in out.top_logprobs[row]] == raw[row].topk(2).indices.tolist()


def test_bias_comes_before_the_repetition_penalty_as_in_vllm():
    """vLLM v1 adds the bias, then penalizes: a seen token whose logit the bias made positive is divided."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = -1.0   # seen (in the prompt), biased +2.5
    logits[0, 6] = 0.7    # bias first: (-1 + 2.5) / 2 = 0.75 > 0.7; penalty first: -1 * 2 + 2.5 = 0.5 < 0.7
    p = SamplingParams(repetition_penalty=2.0, logit_bias={5: 2.5}, **GREEDY)
    assert Sampler().sample(logits, [p], [[5]], [[]], [None]).token_ids == [5]


def test_a_biased_row_never_touches_its_batch_mates_and_logits_stay_untouched():
    logits = _logits(4, seed=1)
    before = logits.clone()
    plain = [SamplingParams(**GREEDY), SamplingParams(temperature=0.8, seed=11),
             SamplingParams(temperature=0.9, top_k=5, seed=12)]
    alone = [Sampler(seed=0).sample(logits[[i]], [p], [[1]], [[]], [_gen(p)]).token_ids[0]
             for i, p in zip((0, 2, 3), plain)]
    biased = SamplingParams(logit_bias={str(t): 100 for t in range(0, VOCAB, 2)}, **GREEDY)
    batch = [plain[0], biased, plain[1], plain[2]]
    out = Sampler(seed=0).sample(logits, batch, [[1]] * 4, [[]] * 4, [_gen(p) for p in batch])
    assert [out.token_ids[i] for i in (0, 2, 3)] == alone
    assert out.token_ids[1] % 2 == 0
    assert torch.equal(logits, before)


def _gen(p: SamplingParams):
    return None if p.seed is None else torch.Generator().manual_seed(p.seed)


def test_a_batch_without_bias_does_no_bias_work_and_keeps_the_fused_path():
    plan = SamplingPlan([SamplingParams(), SamplingParams(**GREEDY)])
    assert plan.bias_rows == [] and plan.fusable
    assert not SamplingPlan([SamplingParams(), SamplingParams(logit_bias={1: 1})]).fusable
    biased = SamplingPlan([SamplingParams(), SamplingParams(logit_bias={1: 1, 2: -1})])
    params = [SamplingParams(), SamplingParams(logit_bias={1: 1, 2: -1})]
    first = biased.logit_bias(params, VOCAB, torch.device("cpu"))
    assert biased.logit_bias(params, VOCAB, torch.device("cpu"))[0] is first[0]   # built once per plan
    assert first[0].tolist() == [1, 1] and first[1].tolist() == [1, 2] and first[2].tolist() == [1.0, -1.0]


def test_an_id_beyond_the_logits_fails_its_row_alone():
    logits = _logits(2)
    bad = SamplingParams(**GREEDY)
    bad.logit_bias = {VOCAB + 5: 1.0}  # past validation (a vocab larger than the logits): no device assert
    out = _sample(logits, [bad, SamplingParams(**GREEDY)])
    assert out.token_ids == [-1, logits[1].argmax().item()]
    assert "logit_bias" in out.failed[0]


# ---- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=256, num_kv_blocks=64)


def _ids(llm, prompts, params) -> list[list[int]]:
    return [out.output_token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_greedy_follows_the_bias(llm):
    (free,) = _ids(llm, PROMPT, SamplingParams(max_tokens=6, **GREEDY))
    chosen = 1234
    assert chosen not in free
    (forced,) = _ids(llm, PROMPT, SamplingParams(max_tokens=6, logit_bias={str(chosen): 100}, **GREEDY))
    assert forced == [chosen] * 6
    (banned,) = _ids(llm, PROMPT, SamplingParams(max_tokens=6, logit_bias={str(free[0]): -100}, **GREEDY))
    assert banned != free and free[0] not in banned


def test_engine_batch_isolation(llm):
    plain = SamplingParams(max_tokens=8, **GREEDY)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)
    prompts = ["The capital of Italy is", "1, 2, 3, 4,", PROMPT]
    alone = [_ids(llm, [p], [params])[0] for p, params in zip(prompts[:2], (plain, seeded))]
    biased = SamplingParams(max_tokens=8, logit_bias={"1234": 100, "42": 50}, **GREEDY)
    together = _ids(llm, prompts, [plain, seeded, biased])
    assert together[:2] == alone
    assert together[2] == [1234] * 8


def test_engine_refuses_ids_beyond_its_vocabulary(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        llm.engine.add_request("oov", [1, 2, 3], SamplingParams(logit_bias={str(vocab): 1}))
