"""/v1/chat/completions: chat template, streaming deltas, usage, logprobs."""

from __future__ import annotations

import pytest

MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name two planets."}]


def chat(client, **kw):
    kw.setdefault("max_tokens", 10)
    return client.chat.completions.create(model="demo", messages=MESSAGES, temperature=0, **kw)


def template_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_applies_the_template_and_matches_hf(client, hf_reference):
    r = chat(client)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant"
    prompt_ids = template_ids(hf_reference.tokenizer)
    expected = hf_reference.greedy(prompt_ids, 10)
    assert msg.content == hf_reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(expected)
    ended_on_eos = expected[-1] == hf_reference.tokenizer.eos_token_id
    assert r.choices[0].finish_reason == ("stop" if ended_on_eos else "length")


def test_chat_streaming_deltas(client):
    full = chat(client, max_tokens=12)
    chunks = list(chat(client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens



@pytest.mark.parametrize("n", [1, 3])
def test_chat_continuous_usage_is_each_choices_own(client, n):
    """vLLM's ``continuous_usage_stats``: every chunk carries its own choice's usage, the role chunk too (the
    prompt, 0 completion tokens); completion_tokens counts that choice's tokens so far; the final chunk the sums."""
    chunks = list(client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=6, n=n, temperature=1.0, seed=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"return_token_ids": True}))
    final = chunks[-1]
    prompt_tokens = len(chunks[0].prompt_token_ids)
    streamed = [0] * n
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] += len(getattr(choice, "token_ids", None) or [])
        assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (
            prompt_tokens, streamed[choice.index], prompt_tokens + streamed[choice.index])
    assert final.choices == [] and final.usage.prompt_tokens == prompt_tokens
    assert final.usage.completion_tokens == sum(streamed)


def test_chat_logprobs_match_hf(client, hf_reference):
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    prompt_ids = template_ids(hf_reference.tokenizer)
    out_ids = hf_reference.greedy(prompt_ids, 5)
    ref = hf_reference.logprobs(prompt_ids, out_ids)
    assert len(content) == len(out_ids)
    for i, (entry, t) in enumerate(zip(content, out_ids)):
        assert entry.token == hf_reference.tokenizer.decode([t])
        assert entry.logprob == pytest.approx(ref[i, t].item(), abs=2e-3)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(ref[i].max().item(), abs=2e-3)
    plain = chat(client, max_tokens=5)
    assert plain.choices[0].logprobs is None


def test_chat_without_max_tokens_fills_the_context_budget(client):
    # max_completion_tokens is OpenAI's newer name; without either the engine may use the rest of the context.
    r = chat(client, max_tokens=None, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3
