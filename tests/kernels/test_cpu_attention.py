"""The CPU backend's native decode kernel (kernels/csrc/paged_decode_cpu.cpp), compiled for real with the machine's
compiler, against the fp32 paged reference: shuffled block tables, a NaN-poisoned cache (a read past a row's
length shows up), mixed decode and prefill steps, GQA groups 1, 3 and 4, fp32, fp16 and bf16."""

from __future__ import annotations

import pytest
import torch

from pdpool.attention import AttentionMetadata, get_backend, pick_backend
from pdpool.kernels import cpu_decode
from pdpool.kernels.paged_ref import paged_attention_ref

BLOCK = 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def step(query_lens, seq_lens, hq, hkv, d, dtype, block=BLOCK):
    need = [-(-n // block) for n in seq_lens]
    perm = torch.randperm(sum(need) + 3).tolist()
    blocks, at = [], 0
    for n in need:
        blocks.append(perm[at:at + n])
        at += n
    kv = torch.full((len(perm), 2, 2, block, hkv, d), float("nan"), dtype=dtype)  # 2 layers; layer 1 used
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    whole = AttentionMetadata.build(seq_lens, seq_lens, blocks, block)
    total = whole.slot_mapping.numel()
    slots = whole.slot_mapping
    k_cache[slots // block, slots % block] = torch.randn(total, hkv, d).to(dtype)
    v_cache[slots // block, slots % block] = torch.randn(total, hkv, d).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, blocks, block)
    q = torch.randn(sum(query_lens), hq, d).to(dtype)
    return meta, q, k_cache, v_cache


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_decode_kernel_matches_reference(hq, hkv, d, dtype):
    seq_lens = [1, 15, 16, 17, 300, 77, 1024]
    meta, q, k_cache, v_cache = step([1] * len(seq_lens), seq_lens, hq, hkv, d, dtype)
    out = get_backend("cpu").forward(q, k_cache, v_cache, meta, d ** -0.5)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              d ** -0.5)
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_mixed_step_decode_rows_native_prefill_rows_torch():
    query_lens, seq_lens = [1, 40, 1, 7, 1], [33, 40, 200, 50, 1]  # decode, prefill, decode, extend, decode
    meta, q, k_cache, v_cache = step(query_lens, seq_lens, 9, 3, 64, torch.float32)
    out = get_backend("cpu").forward(q, k_cache, v_cache, meta, 0.125)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
    assert rel_err(out, ref) < 1e-5


def test_kernel_refuses_a_length_beyond_the_block_table():
    meta, q, k_cache, v_cache = step([1, 1], [20, 5], 4, 2, 32, torch.float32)
    tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="context length 40 outside"):
        cpu_decode.paged_decode(q, k_cache, v_cache, torch.empty_like(q), torch.tensor([0, 1]), tables,
                                   torch.tensor([40, 5]), 0.1)
    with pytest.raises(ValueError, match="contiguous int64"):
        cpu_decode.paged_decode(q, k_cache, v_cache, torch.empty_like(q), torch.tensor([0, 1]), meta.block_tables,
                                   torch.tensor([20, 5]), 0.1)


def test_auto_picks_the_native_backend_on_cpu():
    assert cpu_decode.available()
    assert pick_backend("auto", torch.device("cpu")).name == "cpu"
    assert pick_backend("torch", torch.device("cpu")).name == "torch"


def test_kernel_refuses_a_block_id_outside_the_cache():
    meta, q, k_cache, v_cache = step([1, 1], [20, 5], 4, 2, 32, torch.float32)
    tables = meta.block_tables.long().clone()
    tables[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block id .* outside"):
        cpu_decode.paged_decode(q, k_cache, v_cache, torch.empty_like(q), torch.tensor([0, 1]), tables,
                                torch.tensor([20, 5]), 0.1)


@pytest.mark.parametrize("hq,hkv", [(16, 1), (14, 2), (10, 2)])
def test_groups_beyond_eight_run_as_subgroups(hq, hkv):
    seq_lens = [3, 40, 129]
    meta, q, k_cache, v_cache = step([1] * len(seq_lens), seq_lens, hq, hkv, 64, torch.float32)
    out = get_backend("cpu").forward(q, k_cache, v_cache, meta, 0.125)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [1, 4, 8, 32, 256])
def test_block_sizes_tile_and_prefetch(block, dtype):
    """Blocks below the kernel's 16-token tile are taken several per softmax pass (and prefetched as a group); a
    block above it is its own tile. Lengths end inside a tile, on a block edge and on a tile edge."""
    seq_lens = [1, block, 16, 17, 33, 200, 513]
    meta, q, k_cache, v_cache = step([1] * len(seq_lens), seq_lens, 9, 3, 64, dtype, block=block)
    out = get_backend("cpu").forward(q, k_cache, v_cache, meta, 0.125)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
    assert rel_err(out, ref) < TOLERANCE[dtype]
