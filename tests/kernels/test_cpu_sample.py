"""The CPU sampler pass (kernels/csrc/sample_cpu.cpp via ``cpu_ops.gumbel_argmax``), compiled for real, against the
torch reference of the Triton pass (``gumbel_argmax_ref``) on the very uniforms the kernel draws, in fp32, fp16 and
bf16: greedy and random rows in one batch, first index on ties (within a chunk's lanes and across its 4096-column
chunks), rows that are -inf throughout, widths that are not a multiple of 8, strided rows; the draw's frequencies
against softmax(x / T); the sampler taking it on the CPU; bad input refused with a message."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pdpool.engine.sampler import Sampler
from pdpool.engine.sampling_params import SamplingParams
from pdpool.kernels import cpu_ops
from pdpool.kernels.sample import gumbel_argmax_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    return gumbel_argmax_ref(logits.float(), temperature, cpu_ops.sample_uniforms(*logits.shape, seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 1003, 7])
def test_ids_match_the_reference_on_the_kernels_uniforms(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
    temperature = torch.tensor([1.0, 0.0, 0.7, 2.0, 0.0, 0.3])
    for seed in (0, 1, 2**31 - 1, 2**40 + 5):
        ids = cpu_ops.gumbel_argmax(logits, temperature, seed)
        assert ids.dtype == torch.int64
        assert ids.tolist() == reference(logits, temperature, seed).tolist()
    assert ids[[1, 4]].tolist() == logits[[1, 4]].float().argmax(dim=-1).tolist()


def test_first_index_on_ties_and_rows_without_a_finite_value():
    vocab = 3 * 4096 + 5  # three full chunks and a tail
    logits = torch.randn(5, vocab).round(decimals=1)
    logits[0, [9000, 4100, 13, 12290]] = 50.0  # ties in several chunks, lanes and the tail: the first wins
    logits[1, [8193, 8195]] = 50.0  # two lanes of one vector
    logits[2] = float("-inf")  # nothing finite: index 0, as torch.argmax
    logits[3, :-3] = float("-inf")  # finite only in the tail
    logits[4, [12290, 12291]] = 50.0  # a tie inside the tail
    temperature = torch.zeros(5)
    assert cpu_ops.gumbel_argmax(logits, temperature, 3).tolist() == [13, 8193, 0,
                                                                       logits[3].argmax().item(), 12290]
    temperature[3] = 1.0  # a random row finite only in the tail draws from it
    assert cpu_ops.gumbel_argmax(logits, temperature, 3)[3] >= vocab - 3


def test_strided_rows_and_batch_mates():
    """Rows of a wider tensor; a row's draw depends on the seed and its own row only, not on the other rows."""
    wide = torch.randn(4, 3000)
    logits = wide[:, :2500]
    temperature = torch.tensor([1.0, 1.0, 0.0, 0.5])
    ids = cpu_ops.gumbel_argmax(logits, temperature, 11)
    assert ids.tolist() == cpu_ops.gumbel_argmax(logits.contiguous(), temperature, 11).tolist()
    mates = logits.clone()
    mates[[0, 2]] = torch.randn(2, 2500)
    again = cpu_ops.gumbel_argmax(mates, temperature, 11)
    assert again[1] == ids[1] and again[3] == ids[3]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 9000), seed=st.integers(0, 2**63 - 1),
       temp=st.floats(0.05, 5.0), greedy_every=st.integers(1, 4))
def test_any_shape_matches_the_reference(rows, vocab, seed, temp, greedy_every):
    logits = torch.randn(rows, vocab) * 3
    temperature = torch.tensor([0.0 if i % greedy_every == 0 else temp for i in range(rows)])
    assert cpu_ops.gumbel_argmax(logits, temperature, seed).tolist() == reference(logits, temperature, seed).tolist()


def test_frequencies_follow_the_softmax_at_the_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -8.0, 1.5, 0.2, 0.1]])
    draws = 20000
    counts = torch.zeros(9)
    for seed in range(draws):
        counts[cpu_ops.gumbel_argmax(logits, torch.tensor([0.8]), seed)[0]] += 1
    torch.testing.assert_close(counts / draws, torch.softmax(logits[0] / 0.8, dim=0), atol=0.012, rtol=0)


def test_uniforms_are_inside_the_open_interval_and_uncorrelated():
    u = cpu_ops.sample_uniforms(4, 50000, 7)
    assert 0 < u.min() and u.max() < 1  # 1.0 would give an infinite Gumbel: that column would win the row
    assert abs(u.mean().item() - 0.5) < 0.005
    flat = u.flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()) < 0.01  # neighbours
    other = cpu_ops.sample_uniforms(4, 50000, 8)
    assert abs(torch.corrcoef(torch.stack([flat, other.flatten()]))[0, 1].item()) < 0.01  # seeds


def test_the_cpu_sampler_takes_the_pass_for_random_rows():
    """Temperature rows without a seed go through the native pass: the ids are the pass's under the sampler's
    seed stream; a greedy-only batch and PDPOOL_FUSED_SAMPLER=0 keep the torch path (same contract)."""
    logits = torch.randn(8, 5000)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.9, logprobs=1)] * 5
    sampler = Sampler(seed=123)
    out = sampler.sample(logits, params, [[1]] * 8, [[]] * 8, [None] * 8)
    seed = Sampler(seed=123)._seeds.getrandbits(31)
    expected = cpu_ops.gumbel_argmax(logits, torch.tensor([0.0] * 3 + [0.9] * 5), seed)
    assert out.token_ids == expected.tolist()
    lse = torch.logsumexp(logits, dim=-1)
    assert abs(out.logprobs[5] - (logits[5, out.token_ids[5]] - lse[5]).item()) < 1e-5
    torch_path = Sampler(seed=123)
    torch_path.fused = False
    out = torch_path.sample(logits, params, [[1]] * 8, [[]] * 8, [None] * 8)
    assert out.token_ids[:3] == logits[:3].argmax(dim=-1).tolist() and all(0 <= t < 5000 for t in out.token_ids)


@pytest.mark.parametrize("args, message", [
    ((torch.randn(5), torch.ones(5)), "2-d"),
    ((torch.randn(2, 5), torch.ones(3)), "temperature"),
    ((torch.randn(2, 5), torch.ones(2, dtype=torch.float64)), "temperature"),
    ((torch.randn(2, 0), torch.ones(2)), "no columns"),
    ((torch.randn(2, 5).to(torch.int32), torch.ones(2)), "dtype"),
    ((torch.randn(5, 2).t(), torch.ones(2)), "contiguous"),
])
def test_bad_input_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        cpu_ops.gumbel_argmax(*args, seed=0)
