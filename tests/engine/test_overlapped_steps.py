"""The overlapped step loop (``LLMEngine.overlap_steps``, on by default on CUDA) gives what the plain loop gives.

It runs here on the CPU, where the device work is synchronous, so only the bookkeeping is under test: placeholder
tokens booked before sampling, filled before anything reads them, stop tokens seen one step late, the fallback
for penalties and min_tokens, preemption, abort."""

from __future__ import annotations

import pytest

from pdpool import LLM, SamplingParams
from pdpool.engine.llm_engine import PLACEHOLDER


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=3, max_model_len=256, num_kv_blocks=64)


PROMPTS = ["The capital of Italy is", "1, 2, 3, 4,", "Hello! How are", "The ocean is", "In 1969, humans"]


def run(llm, overlap: bool, params):
    llm.engine.overlap_steps = overlap
    streamed: dict[str, list[int]] = {}
    engine, processor = llm.engine, llm.output_processor
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        ids = llm.frontend.encode_prompt(prompt)
        engine.add_request(f"{overlap}-{i}", ids, p)
        processor.add(f"{overlap}-{i}", prompt, ids, p)
    final = {}
    while engine.has_unfinished_requests():
        outputs, stopped = processor.process(engine.step())
        engine.abort_request(stopped)
        for out in outputs:
            assert PLACEHOLDER not in out.new_token_ids
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert PLACEHOLDER not in out.output_token_ids
                final[out.request_id] = out
    assert engine._in_flight is None and not engine.scheduler.running
    outs = [final[f"{overlap}-{i}"] for i in range(len(PROMPTS))]
    for out in outs:
        assert streamed[out.request_id] == out.output_token_ids
    return [(o.output_token_ids, o.text, o.finish_reason, o.stop_reason,
             [(e.token_id, round(e.logprob, 4)) for e in o.logprobs or []]) for o in outs]


def test_overlapped_matches_plain_loop(llm):
    """More prompts than max_num_seqs (admission as slots free), seeded sampling, logprobs, a stop token, a stop
    string, EOS allowed."""
    plain = run(llm, False, [SamplingParams(max_tokens=12, temperature=0.0)] * len(PROMPTS))
    second = plain[0][0][1]
    text = plain[1][1]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, seed=7),
              SamplingParams(max_tokens=12, temperature=0.0, stop=[text.split()[1][:2]] if len(text.split()) > 1
                             else []),
              SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[second]),
              SamplingParams(max_tokens=30, temperature=0.9, seed=3, top_p=0.9)]
    params[3] = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[plain[3][0][2]])
    assert run(llm, True, params) == run(llm, False, params)


def test_penalties_and_min_tokens_take_the_plain_order(llm):
    params = [SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, temperature=0.0, min_tokens=6, frequency_penalty=0.5),
              SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4),
              SamplingParams(max_tokens=10, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=0.7, seed=1, presence_penalty=1.0)]
    assert run(llm, True, params) == run(llm, False, params)


def test_stop_token_on_the_length_cap_wins(llm):
    (ids, *_), *_ = run(llm, False, [SamplingParams(max_tokens=3, temperature=0.0)] * len(PROMPTS))
    params = [SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=[ids[2]])] * len(PROMPTS)
    overlapped = run(llm, True, params)
    assert overlapped == run(llm, False, params)
    assert overlapped[0][2:4] == ("stop", ids[2])


def test_preemption_and_abort_while_a_step_is_in_flight(demo_model_dir):
    small = LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=256, num_kv_blocks=12)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4
    prompts = PROMPTS[:4]
    small.engine.overlap_steps = False
    plain = [o.output_token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    before = small.engine.scheduler.num_preemptions
    small.engine.overlap_steps = True
    overlapped = [o.output_token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > before  # 12 blocks of 16 tokens cannot hold 4 x ~45 tokens
    assert overlapped == plain

    engine = small.engine
    total = engine.stats()["num_total_blocks"]
    engine.add_request("abort-me", small.frontend.encode_prompt("Tell me everything about"),
                       SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(["abort-me"])
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert engine.stats()["num_free_blocks"] == total


def test_next_step_takes_its_ids_from_the_device_samples(llm, monkeypatch):
    """In the overlapped loop a decode step is queued before the host read the previous step's tokens: its
    placeholder ids are gathered from the previous step's samples on the device (``PackedStep.G``), and the
    tokens still equal the plain loop's, seeded sampling included."""
    params = [SamplingParams(max_tokens=10, temperature=0.0), SamplingParams(max_tokens=10, temperature=0.8, seed=5),
              SamplingParams(max_tokens=10, temperature=0.7, seed=9, top_k=20, logprobs=1),
              SamplingParams(max_tokens=10, temperature=0.0, logprobs=2), SamplingParams(max_tokens=10, seed=11)]
    runner = llm.engine.runner
    gathered: list[int] = []
    upload = runner.upload

    def counting(packed):
        gathered.append(packed.G)
        assert not packed.holes  # every placeholder had a device source
        return upload(packed)

    plain = run(llm, False, params)
    monkeypatch.setattr(runner, "upload", counting)
    assert run(llm, True, params) == plain
    assert sum(gathered) >= 3 * 8  # 3 requests x (10 tokens - first - last) decode steps read device samples


def test_pending_sample_equals_the_synchronous_result():
    import torch

    from pdpool.engine.sampler import Sampler, make_generator

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=1, logprobs=3),
              SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, seed=2)]
    gens = lambda: [None, make_generator(1), None, make_generator(2)]  # noqa: E731
    sync = Sampler(seed=0).sample(logits, params, [[1]] * 4, [[]] * 4, gens())
    pending = Sampler(seed=0).sample_async(logits, params, [[1]] * 4, [[]] * 4, gens())
    assert pending.token_ids.tolist() == sync.token_ids
    assert pending.result() == sync


def test_kept_sampling_rows_follow_the_batch(llm):
    """The runner keeps a batch's sampling rows (params, token lists, generators, the sampler's plan) while its
    rows are the same requests in the same order, and builds them anew on any change: another order, a request
    gone, or a new request that reuses a finished one's id with other params."""
    from pdpool.engine.request import Request

    runner = llm.engine.runner
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=4, min_tokens=2, logprobs=1)
    a, b = Request("a", [1, 2], greedy), Request("b", [3], hot)
    first = runner._sampling_rows([a, b])
    assert runner._sampling_rows([a, b]) is first
    assert first.params == [greedy, hot] and first.outputs[1] is b.output_token_ids and first.index == {"a": 0, "b": 1}
    assert first.plan.min_token_rows == [1] and first.plan.any_logprobs and not first.plan.fusable
    swapped = runner._sampling_rows([b, a])
    assert swapped is not first and swapped.index == {"b": 0, "a": 1} and swapped.plan.min_token_rows == [0]
    again = Request("a", [1, 2], hot)  # the id of a finished request, other params
    reused = runner._sampling_rows([again, b])
    assert reused is not swapped and reused.params == [hot, hot] and reused.requests[0] is again
    assert runner._sampling_rows([b]).index == {"b": 0}
    runner.forget("b")
    assert runner._rows is None


def test_a_reused_request_id_samples_with_its_new_params(llm):
    """Engine level: the second request of an id (greedy first, then seeded random with logprobs) gets what it
    gets when it runs in a fresh batch of its own."""
    engine = llm.engine
    ids = llm.frontend.encode_prompt(PROMPTS[0])
    first = SamplingParams(max_tokens=4, temperature=0.0)
    second = SamplingParams(max_tokens=6, temperature=1.0, seed=21, logprobs=1)

    def generate(pairs):
        for rid, p in pairs:
            engine.add_request(rid, ids, p)
        out: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    for overlap in (False, True):
        engine.overlap_steps = overlap
        alone = generate([("x", second)])["x"]
        generate([("x", first), ("y", first)])
        assert generate([("x", second), ("y", first)])["x"] == alone


def test_decode_steps_pack_as_the_general_path_packs(llm):
    """``pack``'s column-wise path for steps whose every row computes one token builds exactly the buffer and
    fields of the request-by-request path, in both loops: steady batches, rows that finish, a request that joins
    (its prefill is a mixed step) and then decodes with the others."""
    engine, runner = llm.engine, llm.engine.runner
    fast = runner._pack_decode
    compared = []

    def both(scheduled, tables, prev, prev_rows):
        got = fast(scheduled, tables, prev, prev_rows)
        want = runner._pack_rows(scheduled, tables, prev, prev_rows)
        assert got.host.tolist() == want.host.tolist()
        assert (got.T, got.R, got.S, got.G, got.width) == (want.T, want.R, want.S, want.G, want.width)
        assert got.query_lens == want.query_lens and got.seq_lens == want.seq_lens
        assert [id(sr) for sr in got.sampling] == [id(sr) for sr in want.sampling]
        assert [(o, id(r), i) for o, r, i in got.holes] == [(o, id(r), i) for o, r, i in want.holes]
        assert got.prev is want.prev
        compared.append(got.ids_are_prev)
        return got

    runner._pack_decode = both
    try:
        for overlap in (False, True):
            engine.overlap_steps = overlap
            for i, prompt in enumerate(PROMPTS[:3]):
                engine.add_request(f"p{overlap}{i}", llm.frontend.encode_prompt(prompt),
                                   SamplingParams(max_tokens=4 + 3 * i, temperature=0.0))
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
                if steps == 3:
                    engine.add_request(f"late{overlap}", llm.frontend.encode_prompt(PROMPTS[3]),
                                       SamplingParams(max_tokens=5, temperature=0.8, seed=3))
    finally:
        del runner._pack_decode
    assert len(compared) > 10 and any(compared)  # steady batches read their ids in place


def test_bad_words_allowed_ids_and_bias_match_the_plain_loop(llm):
    """A bad word of several tokens reads the output ids (the overlapped loop waits for real ones); one-token words,
    allowed ids and a bias do not."""
    plain = run(llm, False, [SamplingParams(max_tokens=10, temperature=0.0)] * len(PROMPTS))
    out0, out1 = plain[0][0], plain[1][0]

    def banned(ids: list[list[int]], **kw) -> SamplingParams:
        p = SamplingParams(**{"max_tokens": 10, "temperature": 0.0, **kw}, bad_words=["x"])
        p.bad_words_token_ids = ids
        return p

    params = [banned([out0[2:4]]),                          # two tokens: the second never right after the first
              banned([[out1[1]]]),                          # one token
              SamplingParams(max_tokens=10, temperature=0.0, allowed_token_ids=sorted(set(out0 + out1))),
              SamplingParams(max_tokens=10, temperature=0.8, seed=5, logit_bias={str(out1[0]): 3}),
              banned([out0[:2], [out1[3]]], temperature=0.7, seed=2)]
    overlapped = run(llm, True, params)
    assert overlapped == run(llm, False, params)
    assert overlapped[0][0][:4] != out0[:4]


def test_grammar_rows_match_the_plain_loop(llm):
    """A grammar reads every output id (the overlapped loop waits for real ones), each request its own matcher."""
    constraints = [{"regex": "[0-9]{2}( [a-z]+)+"}, {"choice": ["alpha", "beta", "gamma"]},
                   {"json": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}, None,
                   {"json_object": True}]
    params = []
    for i, so in enumerate(constraints):
        p = SamplingParams(max_tokens=10, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, structured_outputs=so)
        llm.frontend.apply_prompt_options([1], p, 256)
        params.append(p)
    overlapped = run(llm, True, params)
    assert overlapped == run(llm, False, params)
    assert overlapped[1][1] in ("alpha", "beta", "gamma")
