"""Our model + loader + runner against HF transformers, float32, for every supported architecture.

Each case builds a tiny random checkpoint, then drives ``ModelRunner`` with steps on shuffled, non-contiguous
KV block ids: (a) full prefill, (b) prefill in two chunks (the second attends to the first's KV in the paged
cache), (c) decode steps, (d) a mixed step of a decode, a fresh prefill and an extend chunk. HF's logits of the
whole sequence at the sampled position are the reference (causal, so any split must reproduce them).
"""

from __future__ import annotations

import math

import random

import pytest
import torch

from model_builders import KINDS, hf_logits, make_request, node_config, save_tiny_model
from pdpool.engine.model_runner import ModelRunner
from pdpool.engine.scheduler import ScheduledRequest, SchedulerOutput

ATOL = 1e-4
BLOCK = 8
NUM_BLOCKS = 64


@pytest.fixture(scope="module", params=KINDS)
def case(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(request.param, path)
    runner = ModelRunner(node_config(path, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK))
    return hf, runner


class BlockAllocator:
    """Hands out shuffled block ids, so requests' blocks are scattered and non-contiguous."""

    def __init__(self, seed: int):
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def blocks_for(self, blocks: list[int], num_tokens: int) -> list[int]:
        while len(blocks) * BLOCK < num_tokens:
            blocks.append(self.free.pop())
        return blocks


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(runner, *items: tuple) -> torch.Tensor:
    logits = runner.compute_logits_for(SchedulerOutput([ScheduledRequest(r, n, b) for r, n, b in items]))
    for r, n, _ in items:
        r.num_computed_tokens += n
    return logits


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_full_prefill(case):
    hf, runner = case
    alloc = BlockAllocator(1)
    req = make_request("a", prompt(1, 21))
    logits = step(runner, (req, 21, alloc.blocks_for([], 21)))
    assert logits.shape == (1, runner.model_config.vocab_size)
    close(logits[0], hf_logits(hf, req.all_token_ids)[-1])


def test_chunked_prefill_reads_first_chunk_from_paged_cache(case):
    hf, runner = case
    alloc = BlockAllocator(2)
    req = make_request("b", prompt(2, 30))
    blocks = alloc.blocks_for([], 13)
    assert step(runner, (req, 13, blocks)).shape[0] == 0  # an intermediate chunk samples nothing
    logits = step(runner, (req, 17, alloc.blocks_for(blocks, 30)))
    close(logits[0], hf_logits(hf, req.all_token_ids)[-1])


def test_decode_steps(case):
    hf, runner = case
    alloc = BlockAllocator(3)
    req = make_request("c", prompt(3, 6))
    blocks = alloc.blocks_for([], 6)
    step(runner, (req, 6, blocks))
    for i in range(6):  # crosses a block boundary at 8
        req.append_output_token((37 * i + 11) % 256)
        logits = step(runner, (req, 1, alloc.blocks_for(blocks, len(req.all_token_ids))))
        close(logits[0], hf_logits(hf, req.all_token_ids)[-1])


def test_mixed_decode_prefill_and_extend(case):
    hf, runner = case
    alloc = BlockAllocator(4)
    dec, ext = make_request("d", prompt(4, 10)), make_request("e", prompt(5, 25))
    dec_blocks, ext_blocks = alloc.blocks_for([], 10), alloc.blocks_for([], 9)
    step(runner, (dec, 10, dec_blocks), (ext, 9, ext_blocks))
    dec.append_output_token(42)
    new = make_request("f", prompt(6, 12))
    logits = step(runner, (dec, 1, alloc.blocks_for(dec_blocks, 11)), (new, 12, alloc.blocks_for([], 12)),
                  (ext, 16, alloc.blocks_for(ext_blocks, 25)))
    assert logits.shape[0] == 3
    for row, req in enumerate((dec, new, ext)):
        close(logits[row], hf_logits(hf, req.all_token_ids)[-1])


def test_execute_samples_greedy_tokens_and_keeps_seeded_generators(case):
    from pdpool.engine.sampling_params import SamplingParams

    hf, runner = case
    alloc = BlockAllocator(5)
    greedy = make_request("g", prompt(7, 9))
    seeded = make_request("s", prompt(8, 5), SamplingParams(temperature=1.0, seed=3))
    chunk = make_request("h", prompt(9, 20))
    out = runner.execute(SchedulerOutput([ScheduledRequest(greedy, 9, alloc.blocks_for([], 9)),
                                          ScheduledRequest(seeded, 5, alloc.blocks_for([], 5)),
                                          ScheduledRequest(chunk, 8, alloc.blocks_for([], 8))]))
    assert set(out) == {"g", "s"}  # the intermediate chunk samples nothing
    assert out["g"].token_id == int(hf_logits(hf, greedy.all_token_ids)[-1].argmax())
    assert math.isnan(out["g"].logprob)  # nobody asked for logprobs: not computed
    assert "s" in runner.generators and "g" not in runner.generators
    runner.forget("s")
    assert "s" not in runner.generators
