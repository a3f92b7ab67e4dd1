"""The offline API and the engine glue, in process: order, validation, stop strings, abort, stats."""

from __future__ import annotations

import pytest

from pdpool import LLM, SamplingParams
from pdpool.engine.llm_engine import InvalidRequestError
from pdpool.engine.sampling_params import SamplingParamsError

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=256, num_kv_blocks=64)


def test_generate_keeps_input_order_and_matches_hf(llm, hf_reference):
    prompts = ["The capital of Italy is", hf_reference.encode("My favorite fruit is"), "1, 2, 3, 4,",
               "Hello! How are", "The ocean is", "In 1969, humans"]  # more than max_num_seqs: some wait
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        ids = prompt if isinstance(prompt, list) else hf_reference.encode(prompt)
        assert out.prompt_token_ids == ids
        expected = hf_reference.greedy(ids, 8)
        assert out.output_token_ids == expected
        assert out.text == hf_reference.tokenizer.decode(expected, skip_special_tokens=True)
        assert out.finished and out.finish_reason in ("length", "stop")


def test_single_prompt_and_per_prompt_params(llm):
    (one,) = llm.generate("Roses are red,", SamplingParams(max_tokens=3, **GREEDY), use_tqdm=True)
    assert len(one.output_token_ids) == 3 and one.finish_reason == "length"
    a, b = llm.generate(["A", "B"], [SamplingParams(max_tokens=2, **GREEDY), SamplingParams(max_tokens=5, **GREEDY)],
                        use_tqdm=False)
    assert (len(a.output_token_ids), len(b.output_token_ids)) == (2, 5)


def test_too_long_is_a_clear_error_with_the_numbers(llm):
    with pytest.raises(InvalidRequestError, match=r"256.*260"):
        llm.engine.add_request("too-long", [5] * 260, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match=r"256.*300"):
        llm.engine.add_request("too-many", [5] * 10, SamplingParams(max_tokens=300))
    # max_tokens past what the prompt leaves is capped there (vLLM 0.32), not refused
    capped = llm.engine.add_request("capped", [5] * 250, SamplingParams(max_tokens=10))
    assert capped.sampling_params.max_tokens == 6
    llm.engine.abort_request("capped")
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request("empty", [], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="vocab"):
        llm.engine.add_request("oov", [10 ** 7], SamplingParams(max_tokens=1))
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(temperature=-1)
    assert info.value.param == "temperature"
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_none_fills_the_context(llm):
    (out,) = llm.generate([[5] * 250], SamplingParams(max_tokens=None, ignore_eos=True, **GREEDY), use_tqdm=False)
    assert len(out.output_token_ids) == 6 and out.finish_reason == "length"


def test_stop_string_and_stop_token(llm, hf_reference):
    ids = hf_reference.encode("The capital of Italy is")
    full = hf_reference.tokenizer.decode(hf_reference.greedy(ids, 8), skip_special_tokens=True)
    stop = full.strip().split()[1][:3]
    (out,) = llm.generate([ids], SamplingParams(max_tokens=8, stop=[stop], **GREEDY), use_tqdm=False)
    assert out.text == full[:full.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    second = hf_reference.greedy(ids, 8)[1]
    (out,) = llm.generate([ids], SamplingParams(max_tokens=8, stop_token_ids=[second], **GREEDY), use_tqdm=False)
    assert out.output_token_ids[-1] == second and len(out.output_token_ids) == 2
    assert (out.finish_reason, out.stop_reason) == ("stop", second)


def test_streaming_outputs_add_up(llm):
    engine, processor = llm.engine, llm.output_processor
    params = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    prompt_ids = llm.frontend.encode_prompt("Once upon a time")
    engine.add_request("stream", prompt_ids, params)
    processor.add("stream", "Once upon a time", prompt_ids, params)
    texts, ids, logprobs, last = [], [], [], None
    while engine.has_unfinished_requests():
        for out in processor.process(engine.step())[0]:
            texts.append(out.new_text)
            ids += out.new_token_ids
            logprobs += out.new_logprobs or []
            last = out
    assert last.finished and "".join(texts) == last.text and ids == last.output_token_ids
    assert [e.token_id for e in logprobs] == ids and all(len(e.top) == 2 for e in logprobs)
    assert all(e.logprob <= 0 for e in logprobs)


def test_abort_returns_blocks_and_stats(llm):
    engine = llm.engine
    total = engine.stats()["num_total_blocks"]
    engine.add_request("abort-me", llm.frontend.encode_prompt("Tell me everything about"),
                       SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    busy = engine.stats()
    assert busy["num_running"] == 1 and busy["num_free_blocks"] < total
    engine.abort_request(["abort-me"])
    idle = engine.stats()
    assert not engine.has_unfinished_requests()
    assert idle["num_running"] == idle["num_waiting"] == 0
    assert idle["num_free_blocks"] == total
    for key in ("kv_cache_usage", "num_prefill_chunks", "prefix_cache_hit_tokens", "num_preemptions",
                "prefix_cache_hit_rate", "block_size"):
        assert key in idle
