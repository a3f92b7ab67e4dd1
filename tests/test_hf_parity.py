"""Greedy completions from the served demo model equal HF transformers' greedy ``generate``.

float32: token-identical for 8 varied prompts, 32+ new tokens, all 8 sent at once (so they share batches).
bfloat16: rounding makes near-ties flip eventually, differently for different kernels. Compared with HF in
bfloat16, the first divergence is reported and the first 16 tokens must agree on at least 7 of 8 prompts (HF
bfloat16 itself leaves HF float32 within 6-8 tokens on 3 of these prompts, so float32 is not the yardstick).
"""

from __future__ import annotations

import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 12 times 7?\nA:",
    "The three laws of thermodynamics are",
    "Translate to French: 'The cat sleeps on the warm windowsill.'\nFrench:",
    "import numpy as np\n\n# Compute the mean of each row of a matrix",
    "List of the planets of the solar system, in order from the Sun:\n1.",
]
NEW_TOKENS = 32


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.fixture(scope="module")
def hf_expected(hf_reference):
    return [hf_reference.greedy(hf_reference.encode(p), NEW_TOKENS) for p in PROMPTS]


def test_float32_greedy_is_token_identical_to_hf(launch_server, hf_expected):
    server = launch_server("--dtype", "float32", "--max-num-seqs", "8")
    try:
        got = server.greedy_token_ids(PROMPTS, NEW_TOKENS)
    finally:
        server.stop()
    assert sum(len(e) == NEW_TOKENS for e in hf_expected) >= 6, "most prompts should run to max_tokens"
    for prompt, g, e in zip(PROMPTS, got, hf_expected):
        assert g == e, f"{prompt!r}: first divergence at {first_divergence(g, e)}"


def test_bfloat16_agrees_on_the_first_16_tokens(launch_server, hf_reference_bf16, hf_expected, record_property):
    hf = hf_reference_bf16
    expected = [hf.greedy(hf.encode(p), NEW_TOKENS) for p in PROMPTS]
    server = launch_server("--dtype", "bfloat16", "--max-num-seqs", "8")
    try:
        got = server.greedy_token_ids(PROMPTS, NEW_TOKENS)
    finally:
        server.stop()
    divergence = [first_divergence(g, e) for g, e in zip(got, expected)]
    vs_float32 = [first_divergence(g, e) for g, e in zip(got, hf_expected)]
    record_property("bf16_first_divergence_vs_hf_bf16", divergence)
    record_property("bf16_first_divergence_vs_hf_fp32", vs_float32)
    print(f"\nbf16 first divergence per prompt (None = identical over {NEW_TOKENS} tokens): vs HF bfloat16 "
          f"{divergence}; vs HF float32 {vs_float32}")
    agree16 = sum(g[:16] == e[:16] for g, e in zip(got, expected))
    assert agree16 >= 7, f"first divergence per prompt vs HF bfloat16: {divergence}"
