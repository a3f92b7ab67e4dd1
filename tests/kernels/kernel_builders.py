"""Builders for the kernel tests: device and precision choice, paged caches with shuffled block tables, errors.

On a machine without CUDA the kernels run under Triton's interpreter (set before anything imports triton) at small
shapes in fp32 and fp16 (the interpreter mishandles bf16); on a GPU they run compiled at serving shapes in bf16.
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("PDPOOL_KERNEL_AUTOTUNE", "0")  # first GPU config only; the benchmarks tune

from pdpool.attention import AttentionMetadata  # noqa: E402
from pdpool.kernels.store_kvcache import store_kvcache_ref  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
BLOCK = 16  # the serving block size
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
# ‖out − ref‖ / ‖ref‖ against an fp32 reference computed from the same (rounded) inputs
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
# (Hq, Hkv, D): GQA groups 1, 4 and 8 where they fit the shape budget
HEADS = [(32, 8, 128), (32, 4, 128), (8, 8, 64)] if ON_GPU else [(4, 2, 32), (4, 1, 16)]
LAYERS = 3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output: an element was not written, or a poisoned slot was read"
    return ((out.float() - ref).norm() / ref.norm()).item()


def node_cache(num_blocks: int, hkv: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_blocks, layers, 2, BLOCK, Hkv, D] filled with NaN: any read of a slot nobody wrote shows up."""
    return torch.full((num_blocks, LAYERS, 2, BLOCK, hkv, d), float("nan"), dtype=dtype, device=DEVICE)


def paged_step(query_lens: list[int], seq_lens: list[int], hkv: int, d: int, dtype: torch.dtype,
               layer: int = 1, spare_blocks: int = 3):
    """A step over a NaN-poisoned cache whose context (prefix and new tokens) is written at random block ids.

    Returns (meta, k_cache, v_cache, kv_node) with every context token's K/V already in the cache."""
    need = [-(-L // BLOCK) for L in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks).tolist()  # shuffled, non-contiguous block tables
    block_ids, at = [], 0
    for n in need:
        block_ids.append(perm[at:at + n])
        at += n
    kv = node_cache(num_blocks, hkv, d, dtype)
    k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]
    whole = AttentionMetadata.build(seq_lens, seq_lens, block_ids, BLOCK, device=DEVICE)  # every context slot
    total = whole.slot_mapping.numel()
    store_kvcache_ref(torch.randn(total, hkv, d, device=DEVICE).to(dtype),
                      torch.randn(total, hkv, d, device=DEVICE).to(dtype), k_cache, v_cache, whole.slot_mapping)
    meta = AttentionMetadata.build(query_lens, seq_lens, block_ids, BLOCK, device=DEVICE)
    return meta, k_cache, v_cache, kv


def queries(meta: AttentionMetadata, hq: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(meta.slot_mapping.numel(), hq, d, device=DEVICE).to(dtype)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))
