"""The oneDNN-packed CPU linear (pdpool.models.cpu_linear) against F.linear on the demo model's layer shapes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdpool.models import cpu_linear
from pdpool.models.cpu_linear import PACKED_MAX_ROWS, PackedWeight, pack_cpu_linears, packed_linear_available

# (N, K): qkv, o, gate_up, down, logits of the demo model (SmolLM2-135M shapes)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def test_available_on_this_build():
    # this CPU torch build ships oneDNN; if it did not, the fallback tests below still hold
    assert packed_linear_available() == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 64, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
def test_matches_f_linear(n, k, rows):
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen) * 0.02
    b = torch.randn(n, generator=gen) if n == 960 else None
    x = torch.randn(rows, k, generator=gen)
    torch.testing.assert_close(PackedWeight(w, b)(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_repacks_after_in_place_change():
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(32, 16, generator=gen), torch.randn(4, 16, generator=gen)
    pw = PackedWeight(w)
    pw(x)
    w.mul_(2.0)
    torch.testing.assert_close(pw(x), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_falls_back_when_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_linear, "packed_linear_available", lambda: False)
    model = nn.Sequential(nn.Linear(16, 8))
    assert pack_cpu_linears(model) == 0
    assert not hasattr(model[0], "packed_weight")


def test_skips_non_fp32():
    model = nn.Sequential(nn.Linear(16, 8).to(torch.bfloat16), nn.Linear(8, 4))
    assert pack_cpu_linears(model) == (1 if packed_linear_available() else 0)
    assert not hasattr(model[0], "packed_weight")
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[1](x), F.linear(x, model[1].weight, model[1].bias), rtol=1e-4, atol=1e-4)
