"""Paged attention kernels (prefill/extend, split-KV decode) and the Triton backend against the fp32 reference.

Every case draws fresh random K/V into a NaN-poisoned cache with shuffled block tables, and poisons the output
before the kernel, so an unwritten element or a read outside the context fails the test."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import (BLOCK, DEVICE, DTYPES, HEADS, ON_GPU, TOLERANCE, paged_step, poisoned_like,  # noqa: I001
                             queries, rel_err)
from pdpool.attention import AttentionMetadata, get_backend
from pdpool.attention.triton_backend import plan_step
from pdpool.engine.cuda_graphs import bucket_sizes
from pdpool.kernels.decode_attention import choose_num_splits, decode_workspace, paged_decode
from pdpool.kernels.paged_ref import paged_attention_ref
from pdpool.kernels.prefill_attention import paged_prefill

# (query_lens, seq_lens): fresh prefills, extends over cached prefixes (block-aligned and not), short chunks
PREFILL_STEPS = ([([300, 1000, 77], [300, 1800, 2100]), ([2048], [2048]), ([129, 64, 2], [4000, 64, 17])]
                 if ON_GPU else [([20, 33], [20, 70]), ([2, 16, 5], [16, 45, 5])])
# decode contexts: 1 token, block edges, long; num_splits values that leave trailing splits empty
DECODE_LENS = [1, 16, 17, 1000, 4096, 31, 2048, 4097] if ON_GPU else [1, 16, 17, 90, 31]
SPLITS = [1, 3, 40] if ON_GPU else [1, 3, 20]  # 20, 40: more than one reduce chunk of 16


def step_ref(q, k_cache, v_cache, meta, scale, rows=None):
    return paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                               rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("step", range(len(PREFILL_STEPS)))
def test_paged_prefill_matches_reference(step, hq, hkv, d, dtype):
    query_lens, seq_lens = PREFILL_STEPS[step]
    meta, k_cache, v_cache, _ = paged_step(query_lens, seq_lens, hkv, d, dtype)
    q = queries(meta, hq, d, dtype)
    out = poisoned_like(q)
    rows = torch.arange(len(query_lens), dtype=torch.int32, device=DEVICE)
    paged_prefill(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, rows,
                  max(query_lens), d ** -0.5)
    assert rel_err(out, step_ref(q, k_cache, v_cache, meta, d ** -0.5)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("num_splits", SPLITS)
def test_paged_decode_matches_reference(num_splits, hq, hkv, d, dtype):
    lens = [DECODE_LENS[i] for i in torch.randperm(len(DECODE_LENS)).tolist()]
    meta, k_cache, v_cache, _ = paged_step([1] * len(lens), lens, hkv, d, dtype)
    q = queries(meta, hq, d, dtype)
    out = poisoned_like(q)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    paged_decode(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, rows,
                 d ** -0.5, num_splits)
    assert rel_err(out, step_ref(q, k_cache, v_cache, meta, d ** -0.5)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_min_split_len_leaves_trailing_splits_empty(dtype):
    hq, hkv, d = HEADS[0]
    lens = [1, 17, 90, 31, 64] if not ON_GPU else [1, 17, 300, 1000, 4097]
    meta, k_cache, v_cache, _ = paged_step([1] * len(lens), lens, hkv, d, dtype)
    q = queries(meta, hq, d, dtype)
    out = poisoned_like(q)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    paged_decode(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, rows,
                 d ** -0.5, 8, min_split_len=32 if not ON_GPU else 256)
    assert rel_err(out, step_ref(q, k_cache, v_cache, meta, d ** -0.5)) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_sms", [4, 108, 132])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
def test_num_splits_same_for_a_batch_and_its_graph_bucket(num_kv_heads, num_sms):
    """A decode CUDA graph is planned for its bucket; the eager step it replaces must split the same way."""
    for max_num_seqs in (8, 100, 256, 512):
        buckets = bucket_sizes(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            bucket = next(b for b in buckets if b >= n)
            assert choose_num_splits(n, num_kv_heads, num_sms) == choose_num_splits(bucket, num_kv_heads, num_sms)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_row_does_not_depend_on_its_batch(dtype):
    """Through the backend: a request's output is bit-identical whatever the other rows' contexts are (the split
    count follows the row count only), so graph replays and eager steps agree token for token."""
    hq, hkv, d = HEADS[0]
    lens = [600, 300] if not ON_GPU else [3000, 3, 700, 17]  # CPU: 2 rows, so the 4 fake SMs split them
    meta, k_cache, v_cache, _ = paged_step([1] * len(lens), lens, hkv, d, dtype)
    q = queries(meta, hq, d, dtype)
    backend = get_backend("triton")
    first = backend.forward(q, k_cache, v_cache, meta, d ** -0.5)
    short = dict(vars(meta), plan={})  # the longest context gone: the old heuristic split differently
    short["seq_lens"] = meta.seq_lens.clone()
    short["seq_lens"][0] = 1
    short["seq_lens_cpu"] = [1] + meta.seq_lens_cpu[1:]
    short["max_seq_len"] = max(short["seq_lens_cpu"])
    second = backend.forward(q, k_cache, v_cache, type(meta)(**short), d ** -0.5)
    assert meta.plan["triton"].num_splits > 1
    assert torch.equal(first[1:], second[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS[:1])
def test_decode_rows_subset_leaves_other_tokens_alone(hq, hkv, d, dtype):
    meta, k_cache, v_cache, _ = paged_step([1, 1, 1, 1], [40, 3, 77, 16], hkv, d, dtype)
    q = queries(meta, hq, d, dtype)
    out = poisoned_like(q)
    rows = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE)  # request 1 is not ours
    paged_decode(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, rows,
                 d ** -0.5, 2)
    assert out[1].isnan().all()
    ref = step_ref(q, k_cache, v_cache, meta, d ** -0.5, rows=[0, 2, 3])
    assert rel_err(out[[0, 2, 3]], ref[[0, 2, 3]]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_backend_mixed_step_writes_then_attends(hq, hkv, d, dtype):
    """As the engine calls it: get_backend("triton"), write the step's K/V, then attend from the cache; a mixed
    step of decodes, an extend, a fresh prefill and padding tokens (slot -1) at the end."""
    if ON_GPU:
        query_lens, seq_lens = [1, 700, 1, 513, 1, 3], [3000, 1500, 1, 513, 260, 40]
    else:
        query_lens, seq_lens = [1, 21, 1, 18, 1], [33, 50, 1, 18, 16]
    meta, k_cache, v_cache, kv = paged_step(query_lens, seq_lens, hkv, d, dtype)
    T = meta.slot_mapping.numel()
    pad = 3
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, dtype=torch.int64, device=DEVICE)])
    k_new = torch.randn(T + pad, hkv, d, device=DEVICE).to(dtype)
    v_new = torch.randn(T + pad, hkv, d, device=DEVICE).to(dtype)
    q = torch.cat([queries(meta, hq, d, dtype), torch.randn(pad, hq, d, device=DEVICE).to(dtype)])
    backend = get_backend("triton")
    assert backend.name == "triton"
    before = kv.clone()
    backend.write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    keep = meta.slot_mapping >= 0
    bs = k_cache.shape[1]
    blocks, offsets = meta.slot_mapping[keep] // bs, meta.slot_mapping[keep] % bs
    assert torch.equal(k_cache[blocks, offsets], k_new[keep]) and torch.equal(v_cache[blocks, offsets], v_new[keep])
    other_layers = [layer for layer in range(kv.shape[1]) if layer != 1]
    assert torch.equal(kv[:, other_layers].nan_to_num(), before[:, other_layers].nan_to_num())
    out = backend.forward(q, k_cache, v_cache, meta, d ** -0.5)
    out2 = backend.forward(q, k_cache, v_cache, meta, d ** -0.5)  # second layer of the step: reuses the plan
    ref = step_ref(q, k_cache, v_cache, meta, d ** -0.5)
    assert rel_err(out[:T], ref[:T]) < TOLERANCE[dtype]
    assert torch.equal(out[:T], out2[:T])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_folded_reduce_reuses_its_workspace_and_ignores_row_order(dtype):
    """One launch combines the splits (the last split of a (row, KV head) to arrive reduces): the arrival counts
    are zero again after every launch, so one workspace serves every layer of a step and every graph replay;
    and a row's output is bit-identical whatever the order of ``rows`` (the backend lists them longest first)."""
    hq, hkv, d = HEADS[0]
    lens = [1, 16, 17, 90, 31, 64, 2] if not ON_GPU else [1, 16, 17, 1000, 4096, 31, 300, 65]
    meta, k_cache, v_cache, _ = paged_step([1] * len(lens), lens, hkv, d, dtype)
    q = queries(meta, hq, d, dtype)
    splits = 8
    workspace = decode_workspace(len(lens), hq, hkv, d, splits, DEVICE)
    ref = step_ref(q, k_cache, v_cache, meta, d ** -0.5)
    outs = []
    orders = [list(range(len(lens))), torch.randperm(len(lens)).tolist(), list(reversed(range(len(lens))))]
    for order in orders * (20 if ON_GPU else 1):  # on the GPU, repeated: a missing fence would show as a race
        out = poisoned_like(q)
        rows = torch.tensor(order, dtype=torch.int32, device=DEVICE)
        paged_decode(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, rows,
                     d ** -0.5, splits, workspace, min_split_len=16)
        assert int(workspace[2].abs().sum()) == 0, "arrival counts left non-zero"
        assert rel_err(out, ref) < TOLERANCE[dtype]
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_backend_orders_decode_rows_longest_first():
    """The eager plan and a graph replay's plan list decode rows longest context first, padding rows last."""
    meta = AttentionMetadata.build([1, 5, 1, 1], [40, 5, 300, 41], [[0, 1, 2], [3], list(range(4, 23)),
                                                                   [23, 24, 25]], BLOCK, device=DEVICE)
    plan = plan_step(meta, 2, DEVICE)
    assert plan.decode_rows.tolist() == [2, 3, 0] and plan.prefill_rows.tolist() == [1]
    backend = get_backend("triton")
    for bucket, want in ((16, [1, 2, 0] + list(range(3, 16))), (8, list(range(8)))):  # small buckets keep theirs
        graph_meta = AttentionMetadata.build([1] * bucket, [1] * bucket, [[0]] * bucket, BLOCK, device=DEVICE)
        cache = torch.zeros(1, BLOCK, 2, 16, device=DEVICE)
        backend.forward(queries(graph_meta, 4, 16, torch.float32), cache, cache.clone(), graph_meta, 0.25)  # plans
        backend.prepare_replay(graph_meta, [7, 90, 12])  # a batch of 3 in the bucket
        assert graph_meta.plan["triton"].decode_rows.tolist() == want


def test_graph_replay_keeps_its_order_only_while_every_row_grows_by_one():
    """``prepare_replay`` skips the upload when each row is one token longer than at the last replay (the order
    depends on the lengths only); any other change orders the rows again."""
    backend = get_backend("triton")
    graph_meta = AttentionMetadata.build([1] * 16, [1] * 16, [[0]] * 16, BLOCK, device=DEVICE)
    cache = torch.zeros(1, BLOCK, 2, 16, device=DEVICE)
    backend.forward(queries(graph_meta, 4, 16, torch.float32), cache, cache.clone(), graph_meta, 0.25)  # plans
    rows = graph_meta.plan["triton"].decode_rows
    for lens, first in (([7, 90, 12], [1, 2, 0]), ([8, 91, 13], [1, 2, 0]), ([9, 92, 100], [2, 1, 0]),
                        ([10, 93, 101], [2, 1, 0]), ([10, 93, 101, 5], [2, 1, 0, 3]), ([90, 1, 2], [0, 2, 1])):
        backend.prepare_replay(graph_meta, lens)
        assert rows.tolist() == first + list(range(len(lens), 16))
