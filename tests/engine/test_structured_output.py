"""Structured output (``pdpool.engine.structured``): every constraint kind enforced on the demo model, each row's
grammar its own, bad constraints refused by the field that carried them, a rejected output failing its row alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pdpool import LLM, SamplingParams
from pdpool.engine.sampler import Sampler
from pdpool.engine.sampling_params import SamplingParamsError
from pdpool.engine.structured import StructuredOutputs
from pdpool.frontend import InvalidRequestError

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=8, max_model_len=256, num_kv_blocks=96)


def test_every_kind_is_enforced_and_plain_batch_mates_are_unchanged(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate(["The ocean is"], [plain])[0].outputs[0]
    cases = [("Describe a person as JSON:", {"json": PERSON}),
             ("A product code:", {"regex": "[0-9]{3}-[a-z]{2}"}),
             ("My favourite colour is", {"choice": ["red", "green", "blue"]}),
             ("Is the sky blue?", {"grammar": LARK}),
             ("Some JSON:", {"json_object": True, "disable_any_whitespace": True})]
    params = [SamplingParams(max_tokens=48, temperature=t, seed=s, structured_outputs=so)
              for (_, so), (t, s) in zip(cases, [(0.0, None), (0.9, 1), (0.7, 2), (0.0, None), (0.0, None)])]
    outs = llm.generate([p for p, _ in cases] + ["The ocean is"], params + [plain])
    texts = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", texts[1])
    assert texts[2] in ("red", "green", "blue")
    assert texts[3] in ("The answer is yes.", "The answer is no.")
    for o in outs[:4]:
        assert o.outputs[0].finish_reason == "stop"
    if outs[4].outputs[0].finish_reason == "stop":   # a JSON object that closed within max_tokens
        assert isinstance(json.loads(texts[4]), dict)
    else:
        assert texts[4].startswith("{")
    assert outs[5].outputs[0].token_ids == alone.token_ids   # the plain row sampled as if alone


@pytest.mark.parametrize("raw, param, words", [
    ({"regex": "[0-9"}, "structured_outputs", "regex"),
    ({"json": {"type": "nonsense"}}, "structured_outputs", "nonsense"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs", "undefined_rule"),
])
def test_a_constraint_that_does_not_compile_is_an_invalid_request(llm, raw, param, words):
    params = SamplingParams(max_tokens=4, structured_outputs=raw)
    with pytest.raises(InvalidRequestError) as info:
        llm.frontend.apply_prompt_options([1, 2], params, 256)
    assert info.value.param == param and words in str(info.value)


@pytest.mark.parametrize("raw, words", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"),
    ({"regex": ""}, "non-empty string"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "JSON schema"),
    ({"json_object": "yes"}, "must be true"),
    ({"structural_tag": {"x": 1}}, "triggers must be a list"),
    ({"structural_tag": {"format": {"type": "triggered_tags"}}}, "not supported"),   # xgrammar's newer shape
    ({"structural_tag": {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]}},
     "starts with none of the triggers"),
    ({"regex": "a", "colour": 1}, "unknown fields"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "boolean"),
    ({"regex": "a", "disable_fallback": 1}, "boolean"),   # found by schemathesis: options were not type-checked
    ({"regex": "a", "whitespace_pattern": 7}, "string"),
    ("json", "must be an object"),
])
def test_malformed_constraints_are_refused_by_name(raw, words):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs=raw)
    assert info.value.param.startswith("structured_outputs") and words in str(info.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "whitespace_pattern",
                                            "disable_any_whitespace", "x"]),
                           st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                                     st.lists(st.text(max_size=4), max_size=3),
                                     st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)),
                           max_size=3))
def test_any_constraint_is_compiled_or_refused_with_a_reason(llm, raw):
    """Arbitrary constraint objects: a ``SamplingParamsError`` or ``InvalidRequestError`` naming the field, or a
    grammar; never another exception."""
    try:
        params = SamplingParams(max_tokens=2, structured_outputs=raw)
        llm.frontend.apply_prompt_options([1, 2], params, 256)
    except (SamplingParamsError, InvalidRequestError) as exc:
        assert exc.param and str(exc)
    else:
        assert params.grammar is not None


def test_sampled_tokens_are_ones_the_grammar_allows(llm):
    """The sampler's mask against llguidance's own: random logits, greedy and random rows, token after token."""
    grammar = llm.frontend.grammars.compile(StructuredOutputs.parse({"json": PERSON}))
    vocab = llm.frontend.vocab_size
    sampler = Sampler(eos_token_ids=llm.frontend.eos_token_ids, seed=0)
    params = [SamplingParams(max_tokens=64, temperature=t, seed=3) for t in (0.0, 1.0)]
    for p in params:
        p.grammar = grammar
    matchers = [grammar.matcher() for _ in params]
    checkers = [grammar.matcher() for _ in params]
    outputs: list[list[int]] = [[], []]
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        logits = torch.randn(2, vocab, generator=gen) * 4
        out = sampler.sample_async(logits, params, [[1], [1]], outputs, [None, None], matchers=matchers).result()
        assert not out.failed
        for row, token in enumerate(out.token_ids):
            bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
            checkers[row].fill(bits)
            assert bits[token // 32].item() >> (token % 32) & 1, f"row {row}: token {token} not allowed"
            if token in llm.frontend.eos_token_ids:
                continue
            outputs[row].append(token)
            assert checkers[row].advance(outputs[row]) is None


def test_an_output_the_grammar_rejects_fails_its_row_alone(llm):
    """A decode node's first token comes from a prefill node: if the grammar rejects it, that row fails, with the
    reason, and its batch-mate is sampled as without it."""
    tok = llm.frontend.tokenizer
    grammar = llm.frontend.grammars.compile(StructuredOutputs.parse({"regex": "[0-9]+"}))
    bad = SamplingParams(max_tokens=4, temperature=0.0)
    bad.grammar = grammar
    good = SamplingParams(max_tokens=4, temperature=0.0)
    logits = torch.randn(2, llm.frontend.vocab_size, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(eos_token_ids=llm.frontend.eos_token_ids)
    out = sampler.sample(logits, [bad, good], [[1], [1]], [tok.encode("abc", add_special_tokens=False), []],
                         [None, None])
    assert set(out.failed) == {0} and "the grammar stops at token id" in out.failed[0]
    assert out.failed[0].param == "structured_outputs"   # a RequestFault: the server answers 400
    assert out.token_ids[0] == -1 and out.token_ids[1] == int(logits[1].argmax())


def test_grammar_and_min_tokens_that_leave_nothing_fail_the_row(llm):
    """A finished grammar allows only EOS; min_tokens masks EOS: nothing left, the row fails with the reason."""
    grammar = llm.frontend.grammars.compile(StructuredOutputs.parse({"choice": ["7"]}))
    params = SamplingParams(max_tokens=8, min_tokens=4, temperature=0.0)
    params.grammar = grammar
    seven = llm.frontend.tokenizer.encode("7", add_special_tokens=False)
    out = Sampler(eos_token_ids=llm.frontend.eos_token_ids).sample(
        torch.zeros(1, llm.frontend.vocab_size), [params], [[1]], [seven], [None])
    assert "no token is left to sample" in out.failed[0]


@pytest.mark.parametrize("kw", [dict(repetition_penalty=5e-324), dict(repetition_penalty=5e-324, temperature=0),
                                dict(repetition_penalty=1e-40, temperature=1e-4)])
def test_extreme_penalties_keep_the_grammar_and_sample_numbers(llm, kw):
    """A repetition penalty that is 0 in float32 (5e-324 is valid: above 0) made the logits inf and NaN: a NaN row
    sampled id 0 whatever its mask, and a grammar row then failed (a 400) or a plain one returned id 0 as text."""
    params = [SamplingParams(max_tokens=6, seed=1, structured_outputs={"json_object": True}, **kw),
              SamplingParams(max_tokens=6, seed=1, **kw)]
    constrained, plain = llm.generate(["Hello Hello Hello"] * 2, params, use_tqdm=False)
    assert constrained.outputs[0].text.startswith("{")
    assert 0 not in plain.outputs[0].token_ids   # <|endoftext|>: what a NaN row drew
