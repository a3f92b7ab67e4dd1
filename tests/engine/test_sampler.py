import math

import torch
from hypothesis import given, settings, strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper)

from pdpool.engine.sampler import Sampler, make_generator
from pdpool.engine.sampling_ops import apply_penalties, filtered_probs
from pdpool.engine.sampling_params import SamplingParams

VOCAB = 64


def make_batch(rows, vocab=VOCAB, seed=0, history=12):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    prompts = [torch.randint(0, vocab, (history,), generator=gen).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (i % history,), generator=gen).tolist() for i in range(rows)]
    return logits, prompts, outputs


def hf_processed(logits_row, prompt, output, p):
    """The HF logits-processor chain for one request: [1, V] processed logits."""
    chain = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        chain.append(MinPLogitsWarper(p.min_p))
    return chain(torch.tensor([prompt + output]), logits_row[None].clone())


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.8]),
    top_k=st.sampled_from([-1, 0, 2, 5, 20, VOCAB, VOCAB + 10]),
    top_p=st.sampled_from([0.05, 0.5, 0.8, 0.9, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.02, 0.1, 0.5]),
    repetition_penalty=st.sampled_from([0.5, 1.0, 1.3, 2.0]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(params_strategy, min_size=1, max_size=6), st.integers(0, 2**16))
def test_filtered_distribution_matches_hf_logits_processors(batch_params, seed):
    logits, prompts, outputs = make_batch(len(batch_params), seed=seed)
    processed = logits.clone()
    if any(p.has_penalties for p in batch_params):
        apply_penalties(processed, batch_params, prompts, outputs)
    probs = filtered_probs(processed, batch_params)
    for i, p in enumerate(batch_params):
        expected = hf_processed(logits[i], prompts[i], outputs[i], p)[0]
        assert torch.equal(probs[i] == 0, expected == float("-inf")), p
        torch.testing.assert_close(probs[i], expected.softmax(-1), rtol=1e-5, atol=1e-7)


def test_presence_and_frequency_follow_the_openai_formula():
    logits, prompts, outputs = make_batch(3)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25), SamplingParams(),
              SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0)]
    penalized = apply_penalties(logits.clone(), params, prompts, outputs)
    for i, p in enumerate(params):
        # OpenAI: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence, c over generated tokens only
        counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=VOCAB).float()
        expected = logits[i] - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
        torch.testing.assert_close(penalized[i], expected)


def test_penalties_apply_before_greedy_argmax():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    out = Sampler().sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], [[0]], [[]], [None])
    assert out.token_ids == [1]
    out = Sampler().sample(logits, [SamplingParams(temperature=0, presence_penalty=1.5)], [[]], [[0]], [None])
    assert out.token_ids == [1]
    assert logits.tolist() == [[5.0, 4.0, 0.0]]  # the caller's logits are left untouched


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits, prompts, outputs = make_batch(8)
    params = [SamplingParams(temperature=0, logprobs=5 if i % 2 else None) for i in range(4)] + \
             [SamplingParams(top_k=1, logprobs=3), SamplingParams(temperature=0.5, top_p=0.5, logprobs=0),
              SamplingParams(temperature=1.5, repetition_penalty=1.5, presence_penalty=1.0, logprobs=20),
              SamplingParams(seed=3, min_p=0.1)]
    out = Sampler(seed=0).sample(logits, params, prompts, outputs, [None] * 7 + [make_generator(3)])
    assert out.token_ids[:5] == logits[:5].argmax(-1).tolist()
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs), raw[torch.arange(8), out.token_ids])
    for i, p in enumerate(params):
        n = p.logprobs or 0
        values, indices = raw[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in out.top_logprobs[i]] == indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in out.top_logprobs[i]]), values)
    greedy_only = Sampler().sample(logits, [SamplingParams(temperature=0)] * 8, prompts, outputs, [None] * 8)
    assert greedy_only.top_logprobs is None and greedy_only.token_ids == logits.argmax(-1).tolist()
    assert all(math.isnan(v) for v in greedy_only.logprobs)  # not computed when no request asks
    assert greedy_only.ranks is None


def test_a_sampled_tokens_rank_counts_the_ids_at_least_as_likely_as_vllms():
    """vLLM's rank: how many vocabulary ids have a logprob at least the sampled token's (ties included), whether or
    not the token is among the top ones asked for; a failed row has none."""
    logits = torch.tensor([[2.0, 1.0, 2.0, 0.5, 1.0], [0.0, 9.0, 8.0, 1.0, 0.0], [3.0, 1.0, 0.0, 0.0, 0.0]])
    bad = SamplingParams(temperature=0, min_tokens=2, logprobs=0)
    bad.stop_token_ids = [10 ** 6]
    params = [SamplingParams(temperature=0, allowed_token_ids=[1], logprobs=0),
              SamplingParams(temperature=0, logprobs=None), bad]
    out = Sampler().sample(logits, params, [[0]] * 3, [[]] * 3, [None] * 3)
    assert out.token_ids == [1, 1, -1] and out.ranks == [4, 1, None]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(2, 40), seed=st.integers(0, 2 ** 16),
       asks=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=5, max_size=5),
       temperature=st.sampled_from([0.0, 0.7, 1.5]))
def test_sampled_ranks_are_vllms_for_any_batch(rows, vocab, seed, asks, temperature):
    """Ranks from logits with many ties (small integers), any batch shape and mix of rows asking for logprobs or
    not: each sampled token's rank is the count of ids whose logit is at least its own, so a greedy token's is the
    number of ids tied at the top; with no row asking, there are none."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
    params = [SamplingParams(temperature=temperature, seed=seed + i, logprobs=asks[i]) for i in range(rows)]
    gens = [make_generator(p.seed) for p in params]
    out = Sampler().sample(logits, params, [[0]] * rows, [[]] * rows, gens)
    if all(a is None for a in asks[:rows]):
        assert out.ranks is None
        return
    for i, t in enumerate(out.token_ids):
        assert out.ranks[i] == int((logits[i] >= logits[i, t]).sum())
        if temperature == 0.0:
            assert out.ranks[i] == int((logits[i] == logits[i].max()).sum())


def test_seeded_request_is_independent_of_batch_composition():
    vocab, steps = 1000, 6
    seeded = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=200, repetition_penalty=1.2)

    def run(batch):  # rows with `seeded` see the same logits in every run, the others vary from run to run
        sampler = Sampler()
        gens = [make_generator(p.seed) if p.seed is not None else None for p in batch]
        outputs = [[] for _ in batch]
        rng = torch.Generator().manual_seed(99)
        for _ in range(steps):
            logits = torch.randn(len(batch), vocab) * 5
            logits[[p is seeded for p in batch]] = torch.randn(vocab, generator=rng)
            out = sampler.sample(logits, batch, [[1, 2, 3]] * len(batch), outputs, gens)
            for o, t in zip(outputs, out.token_ids):
                o.append(t)
        return outputs

    alone = run([seeded])[0]
    mixed = run([seeded, SamplingParams(temperature=0), SamplingParams(), SamplingParams(seed=5, min_p=0.2),
                 seeded, SamplingParams(top_k=3, frequency_penalty=1.0)])
    assert mixed[0] == alone and mixed[4] == alone
    assert run([seeded, SamplingParams(temperature=1.3)] * 3)[0] == alone
    assert len(set(alone)) > 1  # it really samples


def test_sampling_frequencies_follow_the_filtered_distribution():
    rows = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -8.0]]).expand(rows, -1)
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * rows
    out = Sampler(seed=0).sample(logits, params, [[]] * rows, [[]] * rows, [None] * rows)
    expected = filtered_probs(logits[:1], params[:1])[0]
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=6).float() / rows
    assert expected[-1] == 0 and freq[-1] == 0  # top-p removed the tail
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]]).repeat(3, 1)
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], logprobs=0),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]),
              SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)]
    out = Sampler(eos_token_ids=[1]).sample(logits, params, [[0]] * 3, [[3], [3, 3], [3]], [None] * 3)
    assert out.token_ids == [3, 1, 1]
    assert out.logprobs[0] == logits.log_softmax(-1)[0, 3].item()  # logprobs stay raw


# ---- one request's failure is its own ------------------------------------------------------------

def _rows_alone(logits, params, prompts, outputs, seeds):
    """Each row sampled in a batch of its own (fresh generators from `seeds`)."""
    return [Sampler(eos_token_ids=[1]).sample(logits[i:i + 1], [params[i]], [prompts[i]], [outputs[i]],
                                              [make_generator(seeds[i]) if seeds[i] is not None else None])
            for i in range(len(params))]


def _break(p: SamplingParams, how: str, prompt: list[int], output: list[int]):
    """Make one request's own work raise in the sampler (values validation would refuse, set behind its back)."""
    if how == "stop_id":  # beyond the vocabulary while min_tokens holds: masking fails
        p.min_tokens, p.max_tokens, p.stop_token_ids = len(output) + 1, 64, [VOCAB + 7]
    elif how == "penalty_ids":  # a prompt id beyond the vocabulary with penalties on: the scatter fails
        p.repetition_penalty = 1.3
        prompt.append(VOCAB + 3)
    elif how == "top_p":  # not a number: the filtering fails
        p.temperature, p.top_p = 0.8, "0.5"
    return p


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(params_strategy, st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
                          st.sampled_from([None, None, "stop_id", "penalty_ids", "top_p", "generator"])),
                min_size=1, max_size=6), st.integers(0, 2**16))
def test_a_failing_request_fails_alone(rows, seed):
    logits, prompts, outputs = make_batch(len(rows), seed=seed)
    params, seeds, bad = [], [], set()
    for i, (p, request_seed, how) in enumerate(rows):
        p = SamplingParams(**{**p.__dict__, "seed": request_seed})
        if how == "generator" and (request_seed is None or p.is_greedy):
            how = None  # only a seeded random row draws from its generator
        if how is not None:
            bad.add(i)
            _break(p, how, prompts[i], outputs[i])
        params.append(p)
        seeds.append(request_seed)
    gens = [make_generator(s) if s is not None else None for s in seeds]
    for i, (_, _, how) in enumerate(rows):
        if i in bad and how == "generator":
            gens[i] = object()  # stands for a generator that raises when drawn from
    out = Sampler(eos_token_ids=[1]).sample(logits, params, prompts, outputs, gens)

    assert set(out.failed) == bad
    alone = _rows_alone(logits, params, prompts, outputs, seeds)
    for i, p in enumerate(params):
        if i in bad:
            assert out.token_ids[i] == -1 and out.failed[i].startswith("sampling failed: ")
            assert math.isnan(out.logprobs[i])
            continue
        assert alone[i].failed == {}
        if p.is_greedy or p.seed is not None:  # deterministic: as if the failing rows had not been there
            assert out.token_ids[i] == alone[i].token_ids[0], (i, p)
        else:
            assert 0 <= out.token_ids[i] < VOCAB


def test_a_stop_id_beyond_the_vocabulary_fails_its_row_with_a_clear_reason():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]]).repeat(2, 1)
    bad = SamplingParams(temperature=0, min_tokens=2, logprobs=2)
    bad.stop_token_ids = [10 ** 6]
    out = Sampler().sample(logits, [bad, SamplingParams(temperature=0, logprobs=1)], [[0], [0]], [[], []],
                           [None, None])
    assert out.token_ids == [-1, 1] and out.top_logprobs[0] == [] and len(out.top_logprobs[1]) == 1
    assert "outside the vocabulary" in out.failed[0]


def test_make_generator_takes_every_valid_seed_and_refuses_others():
    from pdpool.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParamsError

    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        a, b = make_generator(seed), make_generator(seed)
        assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    for seed in (SEED_MIN - 1, SEED_MAX + 1, 10 ** 29, "1"):
        try:
            make_generator(seed)
        except SamplingParamsError as exc:
            assert exc.param == "seed"
        else:
            raise AssertionError(f"seed {seed!r} was taken")


extreme_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10 ** 40, 10 ** 40),
                           st.sampled_from([1e-300, 1e-45, 1e-7, 3.5e38, -0.0, 2.0, 1.0]))


def _num(lo, hi):  # mostly valid values, sometimes anything
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi), st.floats(lo, hi), extreme_floats)


@settings(max_examples=300, deadline=None)
@given(temperature=_num(0, 3), top_p=_num(1e-9, 1), top_k=st.integers(-3, 10 ** 30), min_p=_num(0, 1),
       repetition_penalty=_num(1e-9, 1e38), presence_penalty=_num(-2, 2), frequency_penalty=_num(-2, 2),
       seed=st.one_of(st.none(), st.integers(-2 ** 70, 2 ** 70)), min_tokens=st.integers(-1, 4),
       stop_token_ids=st.lists(st.integers(-2, VOCAB + 2), max_size=3),
       logprobs=st.one_of(st.none(), st.integers(-1, 25)))
def test_whatever_validates_samples_without_failing(**kwargs):
    """The edge check's promise: params that pass ``validate(vocab_size)`` never fail in the sampler."""
    from pdpool.engine.sampling_params import SamplingParamsError

    try:
        p = SamplingParams(max_tokens=8, **kwargs)
        p.validate(vocab_size=VOCAB)
    except SamplingParamsError:
        return
    logits, prompts, outputs = make_batch(2, seed=7)
    params = [p, SamplingParams(temperature=0.7)]
    gens = [make_generator(p.seed) if p.seed is not None else None, None]
    out = Sampler(eos_token_ids=[1]).sample(logits, params, prompts, [[], [2]], gens)
    assert out.failed == {} and all(0 <= t < VOCAB for t in out.token_ids)


def test_logits_in_the_model_dtype_sample_as_their_float32_copy():
    """On CUDA the runner hands the sampler bf16 logits (no float32 copy); penalties, min_tokens, logprobs and
    seeded draws must give exactly what the float32 copy of the same logits gives."""
    logits, prompts, outputs = make_batch(6, seed=3)
    logits = logits.to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.8, seed=7),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=1.1, top_k=5, top_p=0.9, seed=11, logprobs=2),
              SamplingParams(temperature=0.0, min_tokens=12, stop_token_ids=[int(logits[4].float().argmax())]),
              SamplingParams(temperature=0.6, min_p=0.1, frequency_penalty=0.4, seed=13)]

    def run(x):
        gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
        return Sampler(eos_token_ids=[1], seed=0).sample(x, params, prompts, outputs, gens)

    a, b = run(logits), run(logits.float())
    assert a.token_ids == b.token_ids and a.failed == b.failed == {}
    assert a.top_logprobs == b.top_logprobs
    assert all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a.logprobs, b.logprobs))
    assert a.token_ids[4] != params[4].stop_token_ids[0]


def test_a_bad_value_fails_its_row_alone_on_the_fused_path():
    """Random rows without seeds take the fused pass (native on the CPU); a row whose ``top_p`` is not a number
    (set behind validation's back) must not fail its batch-mate there: it falls back and fails alone."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    good = SamplingParams(temperature=0.7, max_tokens=4)
    bad = SamplingParams(temperature=0.8, max_tokens=4)
    bad.top_p = "0.5"
    out = Sampler(eos_token_ids=[1]).sample(logits, [good, bad], [[2, 3], [2, 3]], [[], []], [None, None])
    assert set(out.failed) == {1} and out.failed[1].startswith("sampling failed: ")
    assert 0 <= out.token_ids[0] < VOCAB and out.token_ids[1] == -1
