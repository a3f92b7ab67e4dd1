"""vLLM 0.32 offline behaviours that ``pdpool.LLM`` did not match: a sampled token's rank, the fate of a batch whose
one request fails, and ``SamplingParams`` values vLLM takes or refuses differently."""

from __future__ import annotations

import pytest

from pdpool import LLM, SamplingParams

QUIET = dict(use_tqdm=False)


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=48, num_kv_blocks=64)


def test_a_sampled_token_outside_the_top_ones_has_its_vocabulary_rank(llm):
    """vLLM ranks every sampled token in the vocabulary (the count of ids whose logprob is at least its own); pdpool
    gave None whenever the sampled token was not among the ``logprobs`` best. The ranks are checked against the
    prompt logprobs of the same text, which rank each prompt token the same way."""
    ids = llm.get_tokenizer().encode("Once upon a time")
    (out,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=2.0, seed=3, max_tokens=12,
                                                                    logprobs=1, ignore_eos=True), **QUIET)
    seq = out.outputs[0]
    ranks = [d[t].rank for d, t in zip(seq.logprobs, seq.token_ids)]
    assert all(isinstance(r, int) and r >= 1 for r in ranks), ranks
    assert any(r > 1 for r in ranks), ranks   # some sampled token was not the model's first choice
    for d, t in zip(seq.logprobs, seq.token_ids):
        best = next(lp for tok, lp in d.items() if lp.rank == 1)
        assert (d[t].rank == 1) == (d[t].logprob == best.logprob)
    (scored,) = llm.generate({"prompt_token_ids": ids + seq.token_ids[:-1]},
                             SamplingParams(max_tokens=1, prompt_logprobs=0), **QUIET)
    # the prompt's logprobs rank its last token but one (the last is what it would generate)
    assert [d[t].rank for d, t in zip(scored.prompt_logprobs[len(ids):], seq.token_ids)] == ranks[:-1]


@pytest.mark.parametrize("kwargs", [dict(temperature=2.5), dict(temperature=3e38), dict(repetition_penalty=0.0),
                                    dict(repetition_penalty=float("inf"))])
def test_sampling_params_vllm_refuses_are_refused(kwargs):
    """vLLM 0.32 checks temperature in [0, 2] (pdpool took any finite one) and repetition_penalty > 0, finite."""
    with pytest.raises(ValueError, match=next(iter(kwargs))) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))


def test_sampling_params_vllm_takes_are_taken(llm):
    """vLLM 0.32 maps logprobs=True and prompt_logprobs=True to 1 and takes any positive finite repetition_penalty
    (pdpool refused the booleans and penalties above 2)."""
    params = SamplingParams(logprobs=True, prompt_logprobs=True, repetition_penalty=3.5, max_tokens=3,
                            seed=0)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    assert SamplingParams(temperature=2.0).temperature == 2.0 and SamplingParams(temperature=0).temperature == 0
    (out,) = llm.generate("Hello there", params, **QUIET)
    seq = out.outputs[0]
    assert len(seq.token_ids) == 3 and all(len(d) in (1, 2) for d in seq.logprobs)
    assert all(d is None or len(d) in (1, 2) for d in out.prompt_logprobs)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("final_only", [True, False], ids=["plain", "with-logprobs"])
def test_one_request_failing_mid_batch_keeps_the_others_results(llm, final_only):
    """vLLM's offline generate collects every finished output, and a request its engine fails alone (its grammar
    rejects a token, say) finishes with finish_reason "error", its tokens so far kept. pdpool raised for the whole
    call, so the batch's other results were lost. Here the bad request may only generate " the" and must never
    generate " the the": its second token has nothing left to sample. Its blocks go back as the others' do."""
    the = llm.get_tokenizer().encode(" the", add_special_tokens=False)
    extra = {} if final_only else dict(logprobs=1)
    bad = SamplingParams(max_tokens=5, temperature=0, allowed_token_ids=the, bad_words=[" the the"], **extra)
    good = SamplingParams(max_tokens=4, temperature=0, **extra)
    free = llm.engine.kv_cache_manager.num_free_blocks
    outs = llm.generate(["Hello", "Once upon a time", "World"], [good, bad, good], **QUIET)
    alone = llm.generate(["Hello", "World"], good, **QUIET)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [a.outputs[0].token_ids for a in alone]
    failed = outs[1].outputs[0]
    assert failed.token_ids == the and failed.text == " the" and failed.stop_reason is None and outs[1].finished
    if not final_only:
        assert len(failed.logprobs) == 1 and failed.cumulative_logprob == failed.logprobs[0][the[0]].logprob
    assert llm.engine.kv_cache_manager.num_free_blocks == free and not llm.engine.has_unfinished_requests()


def test_vllm_call_shapes_pdpool_has_no_use_for_are_taken_or_refused_as_vllm(llm):
    """vLLM 0.32's generate and chat take tokenization_kwargs and mm_processor_kwargs, and chat takes
    chat_template_content_format: a script passing their defaults got a TypeError. Passing more than the defaults
    is a ValueError naming the argument. encode/embed/classify/score on a generative model are vLLM's ValueError
    ("only supported for pooling models"); pdpool had no such methods (AttributeError)."""
    sp = SamplingParams(temperature=0, max_tokens=2)
    (plain,) = llm.generate("Hello", sp, **QUIET)
    (same,) = llm.generate("Hello", sp, tokenization_kwargs=None, mm_processor_kwargs={}, **QUIET)
    assert same.outputs[0].token_ids == plain.outputs[0].token_ids
    conv = [{"role": "user", "content": "Hello"}]
    (chat,) = llm.chat(conv, sp, use_tqdm=False)
    for fmt in ("auto", "string"):
        (again,) = llm.chat(conv, sp, use_tqdm=False, chat_template_content_format=fmt, tokenization_kwargs=None,
                            mm_processor_kwargs=None)
        assert again.prompt == chat.prompt and again.outputs[0].token_ids == chat.outputs[0].token_ids
    for kwargs in (dict(tokenization_kwargs={"truncation": True}), dict(mm_processor_kwargs={"fps": 1})):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            llm.generate("Hello", sp, **kwargs, **QUIET)
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(conv, sp, use_tqdm=False, chat_template_content_format="openai")
    for name in ("encode", "embed", "classify", "score"):
        with pytest.raises(ValueError, match=rf"LLM\.{name}\(\) is only supported for pooling models"):
            getattr(llm, name)("Hello")
    assert not llm.engine.has_unfinished_requests()


def test_a_special_tokens_logprob_names_it_as_vllms(llm):
    """vLLM's decoded_token is the tokenizer's decode of the id alone, special tokens kept (transformers' default):
    an EOS sampled with logprobs reads '<|im_end|>'; pdpool's skipped special tokens and gave ''."""
    tok = llm.get_tokenizer()
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1,
                                                  allowed_token_ids=[tok.eos_token_id]), **QUIET)
    seq = out.outputs[0]
    assert seq.token_ids == [tok.eos_token_id] and seq.text == ""
    assert seq.logprobs[0][tok.eos_token_id].decoded_token == tok.eos_token == "<|im_end|>"
    assert all(lp.decoded_token == tok.decode([t]) for d in [*seq.logprobs, *out.prompt_logprobs[1:]]
               for t, lp in d.items())


@pytest.mark.parametrize("make", [SamplingParams, SamplingParams.from_optional])
def test_several_greedy_samples_are_refused_as_vllm(make):
    """vLLM 0.32 refuses n > 1 with temperature 0 ("n must be 1 when using greedy sampling"): the n choices would be
    the same sequence. pdpool gave n copies. top_k=1 is greedy too, yet vLLM takes it (its check reads the
    temperature only), and so does pdpool."""
    with pytest.raises(ValueError, match="greedy") as info:
        make(n=2, temperature=0)
    assert info.value.param == "n"
    assert make(n=2, temperature=0.5).n == 2 and make(n=2, top_k=1).n == 2 and make(n=1, temperature=0).n == 1


class _Interrupting:
    """A progress bar (vLLM's use_tqdm callable) that interrupts the run at the first finished request."""

    def __init__(self, **kwargs):
        pass

    def update(self, n):
        raise KeyboardInterrupt

    def close(self):
        pass


@pytest.mark.parametrize("bad_at", [None, 2], ids=["interrupted", "third-prompt-too-long"])
def test_a_call_that_stops_early_leaves_no_request_or_block_behind(llm, bad_at):
    """A generate interrupted mid-run (Ctrl-C) or refused at its third prompt (after two were added) leaves the
    engine as it found it: no request, every KV block free, nothing in the output processor; the next call runs."""
    free = llm.engine.kv_cache_manager.num_free_blocks
    prompts = ["Hello there", "Once upon a time", "The sky is"]
    sp = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=20, ignore_eos=True),
          SamplingParams(max_tokens=20, ignore_eos=True)]
    if bad_at is None:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, sp, use_tqdm=_Interrupting)
    else:
        prompts[bad_at] = "word " * 100
        with pytest.raises(ValueError, match="context length"):
            llm.generate(prompts, sp, **QUIET)
    assert not llm.engine.has_unfinished_requests() and len(llm.output_processor) == 0
    assert llm.engine.kv_cache_manager.num_free_blocks == free
    (after,) = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0), **QUIET)
    assert len(after.outputs[0].token_ids) == 2


def test_results_have_vllms_attributes(llm):
    """vLLM 0.32's RequestOutput and CompletionOutput attributes that stay None where their feature is off (LoRA,
    an encoder, a KV connector, routed experts, a sampling mask, speculative decoding) and CompletionOutput's
    finished(): a script reading them got an AttributeError."""
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=2), **QUIET)
    for name in ("lora_request", "encoder_prompt", "encoder_prompt_token_ids", "kv_transfer_params",
                 "ec_transfer_params", "prompt_token_id_logprobs"):
        assert getattr(out, name) is None, name
    seq = out.outputs[0]
    for name in ("lora_request", "routed_experts", "sampling_mask", "spec_decode_metrics", "weight_versions"):
        assert getattr(seq, name) is None, name
    assert seq.finished() is True
