"""The torch attention backend on its own: paged writes with padding slots, and attention against a dense reference."""

from __future__ import annotations

import torch

from pdpool.attention import AttentionMetadata, get_backend

BLOCK, HQ, HKV, D, LAYERS = 8, 4, 2, 16, 3


def node_cache(num_blocks: int = 12) -> torch.Tensor:
    return torch.zeros(num_blocks, LAYERS, 2, BLOCK, HKV, D)  # [blocks, layers, K/V, block_size, Hkv, D]


def test_write_kv_places_tokens_by_slot_and_skips_padding():
    kv = node_cache()
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    k, v = torch.randn(4, HKV, D), torch.randn(4, HKV, D)
    get_backend("torch").write_kv(k, v, k_cache, v_cache, torch.tensor([5 * BLOCK + 3, -1, 2 * BLOCK, -1]))
    assert torch.equal(kv[5, 1, 0, 3], k[0]) and torch.equal(kv[2, 1, 1, 0], v[2])
    assert kv.count_nonzero() == 2 * 2 * HKV * D  # two tokens, K and V, nothing else (layer 1 only)


def dense_attention(q, k, v, scale):
    # q: [n, Hq, D], k/v: [L, Hkv, D]; the n queries are the last n positions of L
    n, L = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def test_mixed_step_matches_dense_attention_per_request():
    backend, kv = get_backend("torch"), node_cache()
    k_cache, v_cache = kv[:, 2, 0], kv[:, 2, 1]
    # (query_len, seq_len, blocks): decode, extend over a cached prefix, fresh prefill, decode of a 1-token context
    reqs = [(1, 13, [7, 0]), (5, 19, [3, 9, 1]), (6, 6, [11]), (1, 1, [4])]
    contexts = [(torch.randn(L, HKV, D), torch.randn(L, HKV, D)) for _, L, _ in reqs]
    for (n, L, blocks), (k, v) in zip(reqs, contexts):  # the cached prefixes, written by earlier steps
        meta = AttentionMetadata.build([L - n], [L - n], [blocks], BLOCK) if L > n else None
        if meta is not None:
            backend.write_kv(k[:L - n], v[:L - n], k_cache, v_cache, meta.slot_mapping)
    meta = AttentionMetadata.build([n for n, _, _ in reqs], [L for _, L, _ in reqs], [b for *_, b in reqs], BLOCK)
    new_k = torch.cat([k[L - n:] for (n, L, _), (k, _) in zip(reqs, contexts)])  # [T, Hkv, D]
    new_v = torch.cat([v[L - n:] for (n, L, _), (_, v) in zip(reqs, contexts)])
    backend.write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(meta.slot_mapping.shape[0], HQ, D)
    out = backend.forward(q, k_cache, v_cache, meta, scale=D ** -0.5)
    start = 0
    for (n, L, _), (k, v) in zip(reqs, contexts):
        torch.testing.assert_close(out[start:start + n], dense_attention(q[start:start + n], k, v, D ** -0.5))
        start += n
