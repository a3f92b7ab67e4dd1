"""The fused sampling pass (``pdpool.kernels.sample``, used by the sampler on CUDA for greedy and plain-temperature
rows without seeds): greedy rows equal torch's argmax (first index on ties), random rows follow
softmax(logits / T). Under Triton's interpreter here; compiled where CUDA is present."""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from pdpool.engine.sampler import Sampler  # noqa: E402
from pdpool.engine.sampling_ops import _fusable  # noqa: E402
from pdpool.engine.sampling_params import SamplingParams  # noqa: E402
from pdpool.kernels.sample import gumbel_argmax, gumbel_argmax_ref, hash_uniforms_ref  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def test_greedy_rows_are_torch_argmax_with_first_index_on_ties():
    gen = torch.Generator().manual_seed(0)
    V = 700  # crosses several 256-wide blocks and a masked tail
    logits = torch.randn(6, V, generator=gen).round(decimals=1)  # many ties
    logits[2, [5, 300, 699]] = 50.0  # a tie of the maximum across blocks: the first wins
    logits[3, [699, 10]] = 60.0
    temperature = torch.zeros(6)
    got = gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), seed=123).cpu()
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[2] == 5 and got[3] == 10
    assert torch.equal(gumbel_argmax_ref(logits, temperature, torch.rand(6, V, generator=gen)), got)


def test_random_rows_follow_the_tempered_softmax():
    V, rows = 8, 1000
    base = torch.linspace(-1.5, 1.5, V)
    temperature = torch.tensor([0.7])
    logits = base.repeat(rows, 1)
    got = gumbel_argmax(logits.to(DEVICE), temperature.repeat(rows).to(DEVICE), seed=7).cpu()
    counts = torch.bincount(got, minlength=V).float()
    expected = torch.softmax(base / temperature, dim=-1) * rows
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 35, (chi2, counts.tolist(), expected.tolist())  # 7 degrees of freedom: p ~ 1e-5
    few = logits[:40].to(DEVICE), temperature.repeat(40).to(DEVICE)
    assert not torch.equal(got[:40], gumbel_argmax(*few, seed=8).cpu())  # the seed moves the draws
    assert torch.equal(got[:40], gumbel_argmax(*few, seed=7).cpu())  # and fixes them (row i's stream is its own)


def test_random_rows_are_the_reference_on_the_hash_uniforms():
    """The kernel's draw is argmax(x / T - log(-log U)) on the counter-hash uniforms of (seed, row * V + col)."""
    gen = torch.Generator().manual_seed(3)
    V = 1000
    logits = torch.randn(6, V, generator=gen) * 3
    temperature = torch.tensor([0.6, 1.0, 0.0, 1.7, 0.3, 0.9])
    for seed in (0, 5, 2**31 - 1):
        got = gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), seed=seed).cpu()
        assert torch.equal(got, gumbel_argmax_ref(logits, temperature, hash_uniforms_ref(6, V, seed)))


def test_the_hash_uniforms_are_the_cpu_passes():
    """The same seed draws the same uniforms on the GPU (this kernel) and in the CPU pass (kernels/csrc)."""
    from pdpool.kernels import cpu_ops

    assert cpu_ops.sampler_available(), "the CPU sampler extension did not build (`pdpool build-kernels` says why)"
    for seed in (0, 7, 2**31 - 1):
        assert torch.equal(hash_uniforms_ref(3, 5000, seed), cpu_ops.sample_uniforms(3, 5000, seed))
    u = hash_uniforms_ref(64, 4096, 11)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 5e-3


def test_a_row_draws_by_its_own_row_and_the_seed_only():
    """Mixed greedy and random rows: a random row's draw does not change with its batch-mates' logits."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen)
    temperature = torch.tensor([0.0, 1.0, 0.5, 0.0, 1.3])
    a = gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), seed=99).cpu()
    mates = logits.clone()
    mates[[0, 2, 3]] = torch.randn(3, 300, generator=gen)
    b = gumbel_argmax(mates.to(DEVICE), temperature.to(DEVICE), seed=99).cpu()
    assert a[1] == b[1] and a[4] == b[4]
    assert a[0] == logits[0].argmax() and a[3] == logits[3].argmax()


def test_only_plain_rows_take_the_fused_pass():
    assert _fusable(SamplingParams(temperature=0.0))
    assert _fusable(SamplingParams(temperature=0.0, seed=3))  # greedy: the seed draws nothing
    assert _fusable(SamplingParams(temperature=0.8, logprobs=2))
    assert not _fusable(SamplingParams(temperature=0.8, seed=3))  # its own generator's stream
    assert not _fusable(SamplingParams(temperature=0.8, top_p=0.9))
    assert not _fusable(SamplingParams(temperature=0.8, top_k=5))
    assert not _fusable(SamplingParams(temperature=0.8, min_p=0.1))
    assert not _fusable(SamplingParams(temperature=0.0, repetition_penalty=1.2))


def test_the_sampler_gives_greedy_tokens_and_raw_logprobs():
    """On CUDA these rows take the fused pass, elsewhere the torch path; both must give the same contract."""
    logits = torch.randn(8, 5000, device=DEVICE)
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 4 + [SamplingParams(temperature=0.9)] * 4
    out = Sampler(seed=0).sample(logits, params, [[1]] * 8, [[]] * 8, [None] * 8)
    assert out.token_ids[:4] == logits[:4].argmax(dim=-1).tolist()
    lse = torch.logsumexp(logits, dim=-1)
    assert abs(out.logprobs[0] - (logits[0].max() - lse[0]).item()) < 1e-5


def test_ids_do_not_depend_on_the_column_split():
    """Programs per row (1, 2, 4, 8, with empty trailing ranges at 8) give the same ids, greedy and random, with
    ties of the maximum across ranges (the first index wins) and rows that are -inf throughout."""
    gen = torch.Generator().manual_seed(1)
    V = 700
    logits = torch.randn(7, V, generator=gen).round(decimals=1)
    logits[1, [650, 3, 300]] = 40.0  # tie across ranges
    logits[4] = float("-inf")  # nothing finite: index 0, as one program gives
    logits[5, :600] = float("-inf")
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.3, 0.0, 0.9, 0.0])
    ids = [gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), seed=99, splits=s).cpu().tolist()
           for s in (1, 2, 4, 8)]
    assert ids[1:] == ids[:1] * 3
    assert ids[0][1] == 3 and ids[0][4] == 0 and ids[0][5] >= 600
    ids_again = [gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), seed=99, splits=s).cpu().tolist()
                 for s in (8, 4)]  # the workspace counts were left at zero
    assert ids_again == ids[:2]


def test_split_choice():
    from pdpool.kernels.sample import choose_splits

    assert choose_splits(190, 151936, 132) == 4  # 4 * 132 / 190 -> 3, up to a power of two
    assert choose_splits(1, 128256, 132) == 16  # capped by 4096-column ranges: 31 -> 16
    assert choose_splits(1024, 151936, 132) == 1
