"""KV write kernel against its torch reference: strided inputs, shuffled slots, padding slots written nowhere."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import BLOCK, DEVICE, DTYPES, HEADS, node_cache  # noqa: I001  (sets TRITON_INTERPRET first)
from pdpool.kernels.store_kvcache import store_kvcache, store_kvcache_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_store_kvcache_matches_reference_and_skips_padding(dtype, hq, hkv, d):
    num_blocks, T = 9, 40 if DEVICE.type == "cpu" else 4000
    num_blocks = max(num_blocks, 2 * T // BLOCK)
    fused = torch.randn(T, (hq + 2 * hkv) * d, device=DEVICE).to(dtype)  # like the qkv projection's output
    k = fused[:, hq * d:(hq + hkv) * d].view(T, hkv, d)  # strided rows, as the model passes them
    v = fused[:, (hq + hkv) * d:].view(T, hkv, d)
    slots = torch.randperm(num_blocks * BLOCK, device=DEVICE)[:T]
    slots[torch.rand(T, device=DEVICE) < 0.25] = -1
    kv = node_cache(num_blocks, hkv, d, dtype)
    kv_ref = kv.clone()
    store_kvcache(k, v, kv[:, 2, 0], kv[:, 2, 1], slots)
    store_kvcache_ref(k, v, kv_ref[:, 2, 0], kv_ref[:, 2, 1], slots)
    assert torch.equal(kv.isnan(), kv_ref.isnan()), "written slots differ (padding written, or a slot missed)"
    assert torch.equal(kv.nan_to_num(), kv_ref.nan_to_num())
    written = (slots >= 0).sum().item()
    assert (~kv.isnan()).sum().item() == 2 * written * hkv * d  # one layer, K and V, the kept tokens only


def test_store_kvcache_rejects_bad_layout():
    kv = node_cache(4, 2, 16, torch.float32)
    k = torch.randn(3, 2, 16, device=DEVICE)
    with pytest.raises(AssertionError):
        store_kvcache(k, k, kv[:, 0, 0], kv[:, 0, 1], torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(AssertionError):
        strided = k[..., ::2]  # last dim not contiguous
        store_kvcache(strided, strided, kv[:, 0, 0], kv[:, 0, 1], torch.zeros(3, dtype=torch.int64, device=DEVICE))
