"""Chunked prefill, preemption and prefix caching happen (their counters move) and change no output.

Each runs on a served demo model in float32 and compares greedy token ids with HF transformers.
"""

from __future__ import annotations

import asyncio

import pytest

LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
               "Within fifty years, presses had spread to more than two hundred cities across Europe, and "
               "the number of books in circulation grew from thousands to millions. In summary,")


@pytest.fixture(scope="module")
def chunking_server(launch_server):
    # A step takes at most 32 tokens: the ~90-token prompt needs three chunks.
    server = launch_server("--dtype", "float32", "--max-num-batched-tokens", "32", "--max-num-seqs", "4")
    yield server
    server.stop()


def test_prompt_longer_than_the_token_budget_is_chunked(chunking_server, hf_reference):
    prompt_ids = hf_reference.encode(LONG_PROMPT)
    assert len(prompt_ids) > 64
    before = chunking_server.metrics()["pdpool_prefill_chunks_total"]
    got = chunking_server.greedy_token_ids([LONG_PROMPT], 16)[0]
    after = chunking_server.metrics()["pdpool_prefill_chunks_total"]
    assert after - before >= 2, "a prompt of more than two budgets takes at least two partial chunks"
    assert got == hf_reference.greedy(prompt_ids, 16)


def test_repeated_prompt_hits_the_prefix_cache(chunking_server, hf_reference):
    prompt = "Repeat after me: " + LONG_PROMPT
    first = chunking_server.greedy_token_ids([prompt], 12)[0]
    before = chunking_server.metrics()["pdpool_prefix_cache_hit_tokens_total"]
    second = chunking_server.greedy_token_ids([prompt], 12)[0]
    hits = chunking_server.metrics()["pdpool_prefix_cache_hit_tokens_total"] - before
    prompt_len = len(hf_reference.encode(prompt))
    assert hits >= (prompt_len - 1) // 16 * 16 - 16, f"only {hits} of {prompt_len} prompt tokens were cached"
    assert hits > 0
    assert first == second == hf_reference.greedy(hf_reference.encode(prompt), 12)
    # usage reports the cached prompt tokens too
    client = chunking_server.client()
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


PREEMPT_PROMPTS = [
    "Write a poem about autumn leaves.",
    "Explain how a bicycle works.",
    "Describe the city of Paris at night.",
    "Give advice to a new programmer.",
]
PREEMPT_NEW = 64
PREEMPT_BLOCKS = 12  # 4 requests x ceil((~10 + 64) / 16) = 20 blocks wanted


def test_small_kv_pool_preempts_and_outputs_still_match(launch_server, hf_reference):
    server = launch_server("--dtype", "float32", "--num-kv-blocks", str(PREEMPT_BLOCKS), "--block-size", "16",
                           "--max-num-seqs", "8", wait=False)
    try:
        hf = hf_reference
        got, expected = server.greedy_token_ids_beside(
            lambda: [hf.greedy(hf.encode(p), PREEMPT_NEW, ignore_eos=True) for p in PREEMPT_PROMPTS],
            PREEMPT_PROMPTS, PREEMPT_NEW, ignore_eos=True)
        m = server.metrics()
    finally:
        server.stop()
    assert m["pdpool_preemptions_total"] > 0
    for prompt, g, e in zip(PREEMPT_PROMPTS, got, expected):
        assert len(g) == PREEMPT_NEW
        assert g == e, prompt


def test_requests_run_concurrently(chunking_server):
    """Several requests in flight share steps: the running gauge sees more than one at once."""
    async def run():
        client = chunking_server.async_client()
        tasks = [asyncio.ensure_future(client.completions.create(model="demo", prompt=f"Story {i}:", max_tokens=24,
                                                                 temperature=0, extra_body={"ignore_eos": True}))
                 for i in range(3)]
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, (await asyncio.to_thread(chunking_server.metrics))["pdpool_num_requests_running"])
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        await client.close()
        return peak

    assert asyncio.run(run()) >= 2
