"""/v1/completions through the openai client: prompt forms, streaming, usage, echo, logprobs, stop strings."""

from __future__ import annotations

import asyncio
import collections

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hypothesis_profiles import scaled

PROMPT = "The three primary colors are"
LOGPROB_TOL = 2e-3  # float32 engine vs float32 HF: different matmul orders, same math


def greedy(client, prompt, max_tokens=8, **kw):
    return client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def test_string_prompt_non_streaming(client, hf_reference):
    r = greedy(client, PROMPT, max_tokens=6)
    assert r.object == "text_completion" and r.model == "demo" and r.id.startswith("cmpl-")
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    prompt_ids = hf_reference.encode(PROMPT)
    expected_ids = hf_reference.greedy(prompt_ids, 6)
    assert choice.text == hf_reference.tokenizer.decode(expected_ids)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == len(prompt_ids) + 6


def test_prompt_forms_give_one_choice_each_in_order(client, hf_reference):
    other = "Water boils at"
    ids_a, ids_b = hf_reference.encode(PROMPT), hf_reference.encode(other)
    by_text = greedy(client, [PROMPT, other], max_tokens=4)
    by_ids = greedy(client, [ids_a, ids_b], max_tokens=4)
    single_ids = greedy(client, ids_b, max_tokens=4)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert single_ids.choices[0].text == by_text.choices[1].text
    assert by_text.usage.prompt_tokens == len(ids_a) + len(ids_b)
    assert by_text.usage.completion_tokens == 8


def test_streaming_matches_non_streaming_and_reports_usage(client):
    full = greedy(client, PROMPT, max_tokens=12).choices[0]
    chunks = list(greedy(client, PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert all(c.usage is None for c in text_chunks)



@settings(max_examples=scaled(5), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_prompts=st.integers(1, 3), n=st.integers(1, 2), max_tokens=st.integers(1, 4), echo=st.booleans())
def test_continuous_usage_is_each_choices_own(client, num_prompts, n, max_tokens, echo):
    """``continuous_usage_stats`` as vLLM's: a chunk's usage is its own choice's prompt and its completion tokens
    so far; only the final chunk sums every prompt (once per prompt, not per choice) and every choice. Was a
    running total over every choice, so a batch's first chunk said ``prompt_tokens: 1`` with 3 in total."""
    prompts = ["Hi", "Water boils at", "One two three four five six"][:num_prompts]   # prompt lengths differ
    chunks = list(client.completions.create(
        model="demo", prompt=prompts, n=n, max_tokens=max_tokens, temperature=1.0, seed=3, echo=echo, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"return_token_ids": True}))
    prompt_len: dict[int, int] = {}
    streamed: collections.Counter = collections.Counter()
    for c in chunks[:-1]:
        (choice,) = c.choices
        if getattr(choice, "prompt_token_ids", None) is not None:
            prompt_len[choice.index] = len(choice.prompt_token_ids)
        streamed[choice.index] += len(getattr(choice, "token_ids", None) or [])
        assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (
            prompt_len[choice.index], streamed[choice.index], prompt_len[choice.index] + streamed[choice.index])
    final = chunks[-1]
    assert final.choices == [] and len(prompt_len) == num_prompts * n
    assert final.usage.prompt_tokens == sum(prompt_len[p * n] for p in range(num_prompts))
    assert final.usage.completion_tokens == sum(streamed.values())


def test_echo_prepends_the_prompt(client):
    plain = greedy(client, PROMPT, max_tokens=4).choices[0].text
    echoed = greedy(client, PROMPT, max_tokens=4, echo=True).choices[0].text
    assert echoed == PROMPT + plain


def test_logprobs_match_hf_log_softmax(client, hf_reference):
    r = greedy(client, PROMPT, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    prompt_ids = hf_reference.encode(PROMPT)
    out_ids = hf_reference.greedy(prompt_ids, 6)
    ref = hf_reference.logprobs(prompt_ids, out_ids)  # [6, V]
    tok = hf_reference.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in out_ids]
    for i, t in enumerate(out_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, t].item(), abs=LOGPROB_TOL)
        top_vals, top_ids = ref[i].topk(3)
        expected = {tok.decode([int(j)]): v for j, v in zip(top_ids.tolist(), top_vals.tolist())}
        assert set(lp.top_logprobs[i]) == set(expected)
        for s, v in expected.items():
            assert lp.top_logprobs[i][s] == pytest.approx(v, abs=LOGPROB_TOL)
    assert lp.text_offset[0] == 0
    assert lp.text_offset[1] == len(lp.tokens[0])


def _stop_across_tokens(tokenizer, ids: list[int]) -> tuple[str, str]:
    """A stop string made of the end of one output token and the start of the next, first found in the text
    at that boundary; and the text before it."""
    pieces = [tokenizer.decode([t]) for t in ids]
    text = "".join(pieces)
    offset = 0
    for k in range(len(pieces) - 1):
        offset += len(pieces[k])
        left, right = pieces[k], pieces[k + 1]
        if len(left.strip()) >= 2 and len(right.strip()) >= 2:
            stop = left[-2:] + right[:2]
            start = offset - 2
            if text.find(stop) == start and start > 0:
                return stop, text[:start]
    raise AssertionError(f"no two-token stop string in {pieces}")


def test_stop_string_spanning_two_tokens_is_cut(client, hf_reference):
    prompt_ids = hf_reference.encode(PROMPT)
    ids = hf_reference.greedy(prompt_ids, 24)
    stop, expected = _stop_across_tokens(hf_reference.tokenizer, ids)
    r = greedy(client, PROMPT, max_tokens=24, stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = list(greedy(client, PROMPT, max_tokens=24, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = greedy(client, PROMPT, max_tokens=24, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(server):
    seeded = dict(model="demo", prompt="Tell me a story about a dragon.", max_tokens=16, temperature=1.0,
                  top_p=0.95, seed=1234)

    async def run():
        client = server.async_client()
        alone = (await client.completions.create(**seeded)).choices[0].text
        noise = [client.completions.create(model="demo", prompt=f"Count to {i}:", max_tokens=24,
                                           temperature=1.0) for i in range(5)]
        busy, *_ = await asyncio.gather(client.completions.create(**seeded), *noise)
        again = (await client.completions.create(**seeded)).choices[0].text
        other_seed = (await client.completions.create(**dict(seeded, seed=99))).choices[0].text
        await client.close()
        return alone, busy.choices[0].text, again, other_seed

    alone, busy, again, other_seed = asyncio.run(run())
    assert alone == busy == again
    assert other_seed != alone


def test_n_choices_with_a_seed(client):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    r2 = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]


def test_extra_fields_are_accepted(client):
    r = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=8, temperature=0.7,
        extra_body={"priority": 1, "cache_salt": "tenant-a", "ignore_eos": True, "top_k": 20, "min_p": 0.05,
                    "repetition_penalty": 1.1, "stop_token_ids": [2], "min_tokens": 8,
                    "kv_transfer_params": {"do_remote_decode": False}}, seed=3)
    assert r.usage.completion_tokens == 8


@settings(max_examples=scaled(6), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 4), seed=st.integers(0, 2**31), stream=st.booleans())
def test_top_logprobs_hold_the_top_n_and_the_sampled_token(client, n, seed, stream):
    """vLLM's (and OpenAI's legacy) completions format: each position's ``top_logprobs`` maps the N most likely
    tokens and the sampled one (N + 1 entries at most), so ``logprobs=0`` gives the sampled token alone."""
    kw = dict(model="demo", prompt=PROMPT, max_tokens=6, temperature=1.5, seed=seed, logprobs=n)
    if stream:
        chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
        tokens = [t for lp in chunks if lp for t in lp.tokens]
        token_logprobs = [x for lp in chunks if lp for x in lp.token_logprobs]
        tops = [t for lp in chunks if lp for t in lp.top_logprobs]
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, token_logprobs, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    assert len(tokens) == len(token_logprobs) == len(tops) == 6
    for token, logprob, top in zip(tokens, token_logprobs, tops):
        assert isinstance(top, dict) and max(n, 1) <= len(top) <= n + 1, top
        assert top[token] == logprob
        if len(top) == n + 1:  # the sampled token is not among the top N: each of them is at least as likely
            assert all(v >= logprob for v in top.values())
