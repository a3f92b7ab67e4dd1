"""KV write: the step's new K/V into the paged cache at ``slot_mapping`` (slot -1 = padding, written nowhere).

    k: [T, Hkv, D] (rows may be strided, e.g. a slice of the fused qkv output)
    k_cache: [num_blocks, block_size, Hkv, D], a strided per-layer view of the node tensor
    slot = block_id * block_size + offset  ->  k_cache[block_id, offset] = k[t]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import assert_last_dim_contiguous, assert_paged_cache


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_ct, stride_ch,
                          BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, DIM_P2)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + offset * stride_ct + h * stride_ch + d  # block: int64 (slot is int64)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    assert_last_dim_contiguous("k", k, 3)
    assert_last_dim_contiguous("v", v, 3)
    assert_paged_cache("k_cache", k_cache)
    assert_paged_cache("v_cache", v_cache, like=k_cache)
    T, Hkv, D = k.shape
    assert v.shape == k.shape and k.dtype == v.dtype == k_cache.dtype, "k/v/cache shapes or dtypes differ"
    assert k_cache.shape[2:] == (Hkv, D), f"cache heads/dim {tuple(k_cache.shape[2:])} != k {(Hkv, D)}"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (T,) and slot_mapping.is_contiguous()
    assert k.device == k_cache.device == slot_mapping.device
    if T == 0:
        return
    _store_kvcache_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_HEADS=Hkv, HEAD_DIM=D,
        HEADS_P2=triton.next_power_of_2(Hkv), DIM_P2=triton.next_power_of_2(D))


def store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]
