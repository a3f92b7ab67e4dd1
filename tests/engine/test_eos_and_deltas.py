"""Every EOS id of the model stops generation; outputs are deltas; text stays off the engine's outputs."""

from __future__ import annotations

import json
import shutil

import pytest

from pdpool import LLM, SamplingParams
from pdpool.engine.llm_engine import EngineOutput

GREEDY = dict(temperature=0.0)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=256, num_kv_blocks=64)


def test_every_eos_id_of_generation_config_stops(llm, demo_model_dir, tmp_path):
    """Llama-3-Instruct lists three EOS ids in generation_config.json; each one must stop, not only the first. As
    vLLM's, an EOS id other than the tokenizer's (its eos_token_id) is one of the request's stop_token_ids: its
    stop_reason is that id (pdpool gave None); the tokenizer's own EOS gives None."""
    (free,) = llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY), use_tqdm=False)
    third = free.output_token_ids[2]
    assert third not in free.output_token_ids[:2]
    model = tmp_path / "several-eos"
    model.mkdir()
    for f in demo_model_dir.iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, third]}))
    several = LLM(str(model), served_model_name="demo", dtype="float32", num_threads=1, max_model_len=256,
                  num_kv_blocks=32)
    assert several.engine.eos_token_ids == [2, third]
    (out,) = several.generate(PROMPT, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    assert out.output_token_ids == free.output_token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == third
    assert out.outputs[0].text == several.tokenizer.decode(free.output_token_ids[:2])  # the EOS is not text
    (own,) = several.generate(PROMPT, SamplingParams(max_tokens=6, allowed_token_ids=[2], **GREEDY), use_tqdm=False)
    assert own.output_token_ids == [2] and own.finish_reason == "stop" and own.stop_reason is None
    (masked,) = several.generate(PROMPT, SamplingParams(max_tokens=6, min_tokens=4, **GREEDY), use_tqdm=False)
    assert third not in masked.output_token_ids[:4]  # min_tokens masks every EOS id


def test_results_are_vllm_shaped(llm):
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=1, **GREEDY), use_tqdm=False)
    seq = out.outputs[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    assert len(seq.token_ids) == 4 and seq.text == llm.tokenizer.decode(seq.token_ids)
    assert seq.finish_reason == "length" and len(seq.logprobs) == 4 and out.finished


def test_engine_outputs_are_token_deltas_and_request_outputs_carry_totals_once(llm):
    engine, processor = llm.engine, llm.output_processor
    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    ids = llm.frontend.encode_prompt(PROMPT)
    engine.add_request("deltas", ids, params)
    processor.add("deltas", PROMPT, ids, params)
    seen = []
    while engine.has_unfinished_requests():
        step = engine.step()
        assert all(isinstance(o, EngineOutput) and not hasattr(o, "text") for o in step)
        for out in processor.process(step)[0]:
            seen.append(out)
    *partial, final = seen
    assert all(o.output_token_ids is None and o.text is None for o in partial)
    assert [len(o.new_token_ids) for o in seen] == [1] * 12  # never the whole list again
    assert final.finished and final.output_token_ids == [t for o in seen for t in o.new_token_ids]
    assert final.num_output_tokens == 12 and final.text == "".join(o.new_text for o in seen)


def test_a_request_whose_sampling_fails_ends_alone(llm):
    """Validation normally stops such params at the edge; past it, the failure is the request's alone."""
    engine, processor = llm.engine, llm.output_processor
    ids = llm.frontend.encode_prompt(PROMPT)
    good = SamplingParams(max_tokens=5, ignore_eos=True, **GREEDY)
    bad = SamplingParams(max_tokens=5, min_tokens=3, **GREEDY)
    for rid, params in (("good", good), ("bad", bad)):
        engine.add_request(rid, ids, params)
        processor.add(rid, PROMPT, ids, params)
    object.__setattr__(engine.scheduler.requests["bad"].sampling_params, "stop_token_ids", [10 ** 9])
    finals = {}
    while engine.has_unfinished_requests():
        for out in processor.process(engine.step())[0]:
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].finish_reason == "error" and "sampling failed" in finals["bad"].error
    assert finals["good"].finish_reason == "length" and len(finals["good"].output_token_ids) == 5
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
