"""vLLM offline scripts ported to ``pdpool.LLM``: the call shapes, prompt forms and output fields of vLLM 0.32's
``LLM`` and ``SamplingParams`` behave as there, and a bad argument is a ValueError/TypeError at the call."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pdpool
from pdpool import LLM, SamplingParams

QUIET = dict(use_tqdm=False)


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=48, num_kv_blocks=64)


def test_dict_prompts_are_vllms_text_and_tokens_prompts(llm):
    ids = llm.get_tokenizer().encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    (by_ids,) = llm.generate({"prompt_token_ids": ids}, greedy, **QUIET)
    assert by_ids.prompt_token_ids == ids and by_ids.prompt is None
    (by_text,) = llm.generate(pdpool.TextPrompt(prompt="The capital of France is"), greedy, **QUIET)
    assert by_text.prompt == "The capital of France is" and by_text.prompt_token_ids == ids
    both = llm.generate([pdpool.TokensPrompt(prompt_token_ids=ids), {"prompt": "The capital of France is"}, ids],
                        greedy, **QUIET)
    assert [o.outputs[0].token_ids for o in both] == [by_ids.outputs[0].token_ids] * 3
    for bad in ({"prompt_token_ids": ids, "multi_modal_data": {"image": None}}, {"text": "hi"}, {}):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, greedy, **QUIET)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompts, params, error", [
    ([3.5], None, TypeError), ([None], None, TypeError), (3, None, TypeError), (["a", b"b"], None, TypeError),
    ([[1, "x"]], None, ValueError), ({"prompt": 5}, None, TypeError),
    (["a"], {"max_tokens": 2}, TypeError), (["a", "b"], [SamplingParams(max_tokens=1)], ValueError),
])
def test_bad_prompts_or_params_are_refused_at_the_call(llm, prompts, params, error):
    with pytest.raises(error, match="prompt|SamplingParams|sampling_params"):
        llm.generate(prompts, params, **QUIET)
    assert not llm.engine.has_unfinished_requests()


def test_vllm_argument_names_and_chat_batches(llm):
    sp = SamplingParams(temperature=0, max_tokens=2)
    (out,) = llm.generate(["Hello"], sampling_params=sp, use_tqdm=False, lora_request=None, priority=[0])
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="lora"):
        llm.generate(["Hello"], sp, lora_request=object(), **QUIET)
    conv = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"}]
    one = llm.chat(conv, sampling_params=sp, use_tqdm=False)
    assert isinstance(one, list) and len(one) == 1 and isinstance(one[0], pdpool.RequestOutput)
    two = llm.chat([conv, conv[1:]], [sp, SamplingParams(temperature=0, max_tokens=1)], False)
    assert [len(o.outputs[0].token_ids) for o in two] == [2, 1]
    assert two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    with pytest.raises(NotImplementedError, match="beam search"):
        llm.beam_search([{"prompt": "Hello"}], object())
    assert not llm.engine.has_unfinished_requests()


def test_chat_takes_openai_content_parts_as_the_server_does(llm):
    """vLLM's chat takes a message's content as OpenAI's list of parts (text parts joined by newlines); the offline
    chat handed the list to the template, which failed ("can only concatenate str (not "list") to str")."""
    sp = SamplingParams(temperature=0, max_tokens=2)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    (by_parts,) = llm.chat(parts, sp, use_tqdm=False)
    (by_text,) = llm.chat([{"role": "user", "content": "Hello\nthere"}], sp, use_tqdm=False)
    assert by_parts.prompt == by_text.prompt and by_parts.outputs[0].token_ids == by_text.outputs[0].token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match="text parts") as info:
        llm.chat(image, sp, use_tqdm=False)
    assert info.value.param == "messages"
    with pytest.raises(ValueError, match="messages"):
        llm.chat(["hello"], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_output_fields_as_vllm(llm):
    (plain,) = llm.generate("Hello", SamplingParams(max_tokens=3, seed=1), **QUIET)
    assert isinstance(plain, pdpool.RequestOutput) and isinstance(plain.outputs[0], pdpool.CompletionOutput)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    assert plain.metrics is None and plain.num_cached_tokens >= 0 and plain.finished
    (scored,) = llm.generate("Hello", SamplingParams(max_tokens=3, seed=1, logprobs=0), **QUIET)
    seq = scored.outputs[0]
    assert seq.token_ids == plain.outputs[0].token_ids
    # vLLM's shape: one {token id: Logprob(logprob, rank, decoded_token)} per generated token
    assert [list(d) for d in seq.logprobs] == [[t] for t in seq.token_ids]
    total = sum(d[t].logprob for d, t in zip(seq.logprobs, seq.token_ids))
    assert math.isclose(seq.cumulative_logprob, total) and total < 0
    tok = llm.get_tokenizer()
    assert [d[t].decoded_token for d, t in zip(seq.logprobs, seq.token_ids)] == [tok.decode([t]) for t in seq.token_ids]


def test_logprobs_and_prompt_logprobs_are_vllm_dicts(llm):
    ids = llm.get_tokenizer().encode("The capital of France is")
    (out,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                                    prompt_logprobs=1), **QUIET)
    for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert next(iter(d)) == t and len(d) in (2, 3)
        assert d[t].rank == 1   # greedy: the sampled token is the model's first choice
        best = sorted((lp for tok, lp in d.items() if tok != t or lp.rank == 1), key=lambda lp: lp.rank)
        assert [lp.rank for lp in best] == [1, 2] and best[0].logprob >= best[1].logprob
    prompt = out.prompt_logprobs
    assert len(prompt) == len(ids) and prompt[0] is None
    for d, t in zip(prompt[1:], ids[1:]):
        assert next(iter(d)) == t and d[t].rank >= 1 and d[t].logprob <= 0
        assert any(lp.rank == 1 for lp in d.values())
    (bare,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                                     detokenize=False), **QUIET)
    assert all(lp.decoded_token is None for d in bare.outputs[0].logprobs for lp in d.values())


def test_detokenize_false_gives_ids_without_text(llm):
    (out,) = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, detokenize=False), **QUIET)
    (ref,) = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), **QUIET)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_from_optional_and_clone():
    sp = SamplingParams.from_optional(temperature=None, top_p=None, n=None, presence_penalty=None,
                                      frequency_penalty=None, repetition_penalty=None, max_tokens=None, seed=None,
                                      logit_bias={"7": 300})
    assert (sp.temperature, sp.top_p, sp.n, sp.max_tokens, sp.seed, sp.logit_bias) == (1.0, 1.0, 1, None, None,
                                                                                      {7: 100.0})
    assert SamplingParams.from_optional(max_tokens=5) == SamplingParams(max_tokens=5)
    original = SamplingParams(stop=["a"], max_tokens=4)
    copy = original.clone()
    assert copy == original and copy is not original
    copy.stop.append("b")
    assert original.stop == ["a"]


def test_seed_minus_one_is_no_seed_as_in_vllm():
    """vLLM's ``seed=-1`` means unseeded (random per run); pdpool seeded a generator with it, so every run sampled
    the same tokens."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams.from_optional(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0


@pytest.mark.parametrize("kwargs, error", [
    (dict(tensor_parallel_size=2), ValueError), (dict(pipeline_parallel_size=2), ValueError),
    (dict(tokenizer="other/model"), ValueError), (dict(trust_remote_code="yes"), TypeError),
    (dict(swap_space=4), ValueError),
])
def test_vllm_constructor_arguments_pdpool_cannot_honour_are_refused(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        LLM("demo", **kwargs)


def test_vllm_constructor_arguments_that_ask_for_the_default_are_taken(demo_model_dir):
    llm = LLM(model="demo", tokenizer="demo", tensor_parallel_size=1, pipeline_parallel_size=1,
              trust_remote_code=True, disable_log_stats=True, seed=0, max_model_len=32, dtype="float32",
              num_threads=1, num_kv_blocks=16)
    (out,) = llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1


def test_generate_leaves_the_callers_params_as_they_were(llm):
    """vLLM clones a request's SamplingParams: generate filled the caller's own bad_words_token_ids and grammar,
    so the object no longer equalled what was written, and a grammar compiled for one LLM's tokenizer went on to
    another LLM with it."""
    sp = SamplingParams(max_tokens=2, bad_words=["Paris"], structured_outputs={"choice": ["yes", "no"]})
    before = SamplingParams(max_tokens=2, bad_words=["Paris"], structured_outputs={"choice": ["yes", "no"]})
    outs = llm.generate(["a", "b"], sp, **QUIET)
    assert [o.outputs[0].text for o in outs] and all(o.outputs[0].text in ("yes", "no") for o in outs)
    assert sp == before and sp.grammar is None and sp.bad_words_token_ids is None


def test_n_samples_are_one_result_with_n_outputs_as_vllm(llm):
    """`SamplingParams(n=3)` in a vLLM script: one RequestOutput per prompt with three CompletionOutputs, indices
    0..2. It was a ValueError ("only n=1"). With a seed, choice j is seeded seed + j, as the server's n is."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=1)
    out_a, out_b = llm.generate(["Once upon a time", "The sky"], params, **QUIET)
    for out in (out_a, out_b):
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
        assert all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in out.outputs)
        assert all(math.isclose(c.cumulative_logprob, sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids)))
                   for c in out.outputs)
    alone = [llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=5 + j, max_tokens=6),
                          **QUIET)[0].outputs[0].token_ids for j in range(3)]
    assert [c.token_ids for c in out_a.outputs] == alone
    assert len({tuple(t) for t in alone}) > 1           # the choices differ
    (greedy,) = llm.generate("Hello", SamplingParams(n=2, top_k=1, max_tokens=4), **QUIET)  # (temperature 0: refused)
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids and greedy.outputs[1].index == 1
    assert params.n == 3 and params.seed == 5            # the caller's params are left as they were
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="one sequence"):  # the engine itself samples one sequence a request
        llm.engine.add_request("direct", [1, 2, 3], SamplingParams(n=2, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_priorities_are_taken_with_the_priority_policy_and_refused_without(demo_model_dir, llm):
    """vLLM's generate(..., priority=[...]): lower runs first. With LLM(scheduling_policy="priority") and one
    sequence at a time, the prompts run in priority order (each later one finds the earlier ones' blocks cached);
    under first come, first served a nonzero priority is a clear ValueError at the call, not ignored."""
    with pytest.raises(ValueError, match="scheduling_policy"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[1, 0], **QUIET)
    one = LLM("demo", dtype="float32", num_threads=1, max_num_seqs=1, max_model_len=48, num_kv_blocks=64,
              scheduling_policy="priority")
    shared = "The quick brown fox jumps over the lazy dog and then " * 2
    prompts = [shared + "runs.", shared + "sleeps.", shared + "eats."]
    outs = one.generate(prompts, SamplingParams(temperature=0, max_tokens=2), priority=[2, 0, 1], **QUIET)
    # the first to run (priority 0) found nothing cached; the two after it found the shared prefix
    assert [o.prompt for o in outs] == prompts
    assert outs[1].num_cached_tokens == 0 and outs[2].num_cached_tokens > 0 and outs[0].num_cached_tokens > 0


def test_get_tokenizer_encodes_and_decodes(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world" and tok.eos_token_id is not None
    assert tok.decode([tok.eos_token_id]) == tok.eos_token   # transformers' default keeps special tokens
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""
    import copy
    assert copy.copy(tok).encode("Hello world") == ids   # a copy (no __init__ run) must not recurse


def test_get_tokenizer_applies_the_chat_template_as_transformers(llm):
    """vLLM scripts build prompts with ``tokenizer.apply_chat_template(conv, tokenize=False,
    add_generation_prompt=True)``: pdpool's tokenizer took no ``tokenize`` (TypeError)."""
    conv = [{"role": "user", "content": "Hello"}]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    (chat,) = llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False)
    assert text == chat.prompt
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == chat.prompt_token_ids
    assert tok.apply_chat_template(conv, tokenize=False) != text   # transformers' default: no generation prompt


def test_masks_that_leave_nothing_to_sample_finish_that_request_with_error(llm):
    """allowed_token_ids and a grammar that share no token: the request's own parameters, known only once it runs
    (the server answers 400). Offline, as vLLM's generate, that request finishes with finish_reason "error" and
    the others' results are returned (generate raised, and lost them)."""
    tok = llm.get_tokenizer()
    allowed = [t for t in range(100, 400) if not tok.decode([t]).lstrip().startswith(("a", "b"))][:3]
    params = SamplingParams(max_tokens=3, allowed_token_ids=allowed, structured_outputs={"choice": ["a", "bb"]})
    ok, failed = llm.generate(["Hello", "World"], [SamplingParams(max_tokens=2), params], **QUIET)
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 2
    assert failed.finished and failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert not llm.engine.has_unfinished_requests()
    (after,) = llm.generate("Hello", SamplingParams(max_tokens=2), **QUIET)   # the engine goes on
    assert len(after.outputs[0].token_ids) == 2


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3),
                 st.lists(st.integers(-1, 3), max_size=2), st.dictionaries(st.integers(-1, 3), st.floats(-200, 200),
                                                                           max_size=2))
_FIELDS = ("min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output",
           "skip_special_tokens", "n", "logit_bias", "prompt_logprobs", "truncate_prompt_tokens", "allowed_token_ids",
           "bad_words", "detokenize")


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kwargs=st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=4),
       max_tokens=st.sampled_from([None, 1, 2, 0, -1, 2.0, "2"]))
def test_sampling_params_construct_or_refuse_and_then_run(llm, kwargs, max_tokens):
    """Every combination constructs or raises ValueError/TypeError naming an argument; one that constructs runs."""
    try:
        params = SamplingParams(max_tokens=max_tokens, **kwargs)
    except (ValueError, TypeError) as exc:
        assert any(name in str(exc) for name in (*kwargs, "max_tokens")), exc
        return
    try:
        (out,) = llm.generate([[1, 2, 3]], params, **QUIET)
    except ValueError as exc:   # refused at the call against the vocabulary/context (a clear error), never deeper
        assert any(name in str(exc) for name in (*kwargs, "max_tokens", "prompt")), exc
    else:
        assert out.finished and len(out.outputs) == params.n
        # "error": the request's own masks left nothing to sample (vLLM finishes it so too)
        masks = {"allowed_token_ids", "bad_words", "min_tokens"} & set(kwargs)
        assert all(c.finish_reason in ("stop", "length", *(("error",) if masks else ())) for c in out.outputs)
    assert not llm.engine.has_unfinished_requests()
