"""KVCacheManager: prefix hits, slot allocation, exact free-queue order, LRU eviction, isolation."""

from __future__ import annotations

import itertools

import pytest

from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash
from pdpool.engine.kv_cache_manager import KVCacheManager
from pdpool.engine.request import Request
from pdpool.engine.sampling_params import SamplingParams

BLOCK = 4
_ids = itertools.count()


def make_request(prompt, *, cache_salt=None, output=()) -> Request:
    return Request(f"r{next(_ids)}", list(prompt), SamplingParams(max_tokens=8), cache_salt=cache_salt,
                   output_token_ids=output)


def make_manager(num_blocks=10, caching=True, fingerprint=None) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK, caching, fingerprint=fingerprint)


def free_ids(m: KVCacheManager) -> list[int]:
    return m.pool.free_queue.block_ids()


def admit(m: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a whole prompt in one step, then the step computes it."""
    hits, num_hit = m.get_computed_blocks(request)
    block_ids = m.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert block_ids is not None
    request.num_computed_tokens = request.num_tokens
    m.cache_computed_blocks(request)
    return block_ids


def refs(m: KVCacheManager, ids) -> list[int]:
    return [m.pool.blocks[i].ref_cnt for i in ids]


def test_prefill_hits_and_exact_free_queue_order():
    m = make_manager()
    common = list(range(8))
    a = make_request(common + [100, 101, 102])  # | 0 1 2 3 | 4 5 6 7 | 100 101 102 |
    assert m.get_computed_blocks(a) == ([], 0)
    assert admit(m, a) == [0, 1, 2]
    assert a.block_hashes == hash_prompt_blocks(a.all_token_ids, BLOCK, root_hash(m.fingerprint))
    assert m.take_events() == (a.block_hashes[:2], [])
    assert free_ids(m) == [3, 4, 5, 6, 7, 8, 9]

    b = make_request(common + [200, 201, 202])
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert m.allocate_slots(b, 3, hits) == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]

    m.free(a)  # reversed: 2 goes free first; 1 and 0 still held by b
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 2]
    m.free(b)  # b's tail block first, so the shared prefix is evicted last
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert m.num_free_blocks == 10 and m.usage == 0.0


def test_lru_eviction_order_and_events():
    m = make_manager(num_blocks=6)
    a = make_request(range(13))  # 3 full blocks + 1 partial
    assert admit(m, a) == [0, 1, 2, 3]
    stored, _ = m.take_events()
    assert stored == a.block_hashes == a.block_hashes[:3]
    m.free(a)
    assert free_ids(m) == [4, 5, 3, 2, 1, 0]

    c = make_request(range(100, 112))  # 3 blocks: 4, 5 and 3 (a's uncached partial): no eviction
    assert admit(m, c) == [4, 5, 3]
    assert m.take_events() == (c.block_hashes, [])
    d = make_request(range(200, 205))  # 2 blocks: evicts a's least recently used tail first
    assert admit(m, d) == [2, 1]
    assert m.take_events() == (d.block_hashes[:1], [a.block_hashes[2], a.block_hashes[1]])

    again = make_request(range(13))
    hits, num_hit = m.get_computed_blocks(again)
    assert [blk.block_id for blk in hits] == [0] and num_hit == 4


def test_hit_on_a_free_block_takes_it_from_the_middle_of_the_queue():
    m = make_manager(num_blocks=6)
    a = make_request(range(9))
    admit(m, a)  # [0, 1, 2]
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]
    b = make_request(list(range(8)) + [50])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8 and refs(m, [0, 1]) == [0, 0]
    assert m.allocate_slots(b, 1, hits) == [0, 1, 3]
    assert free_ids(m) == [4, 5, 2] and refs(m, [0, 1, 3]) == [1, 1, 1]


def test_never_the_whole_prompt():
    m = make_manager()
    admit(m, make_request(range(8)))  # 2 full blocks, both cached
    hits, num_hit = m.get_computed_blocks(make_request(range(8)))
    assert num_hit == 4 and len(hits) == 1  # the last token must be computed to sample
    hits, num_hit = m.get_computed_blocks(make_request(range(9)))
    assert num_hit == 8


def test_does_not_fit_changes_nothing_and_counts_evictable_hits():
    m = make_manager(num_blocks=4)
    a = make_request(range(8))
    admit(m, a)
    m.free(a)  # queue: 2 3 1 0, with 0 and 1 cached
    b = make_request(list(range(8)) + list(range(300, 310)))  # hits 2 blocks, needs 3 more (18 tokens)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    before = free_ids(m)
    assert m.allocate_slots(b, 10, hits) is None  # 2 free + 2 evictable hits - the hits themselves < 3
    assert free_ids(m) == before and refs(m, range(4)) == [0, 0, 0, 0] and m.get_block_ids(b.request_id) == []
    assert m.allocate_slots(b, 8, hits) == [0, 1, 2, 3]
    assert m.num_free_blocks == 0


def test_growth_by_decode_and_output_blocks_become_cacheable():
    m = make_manager()
    r = make_request(range(6))
    assert m.allocate_slots(r, 6) == [0, 1]
    r.num_computed_tokens = 6
    m.cache_computed_blocks(r)
    assert len(m.take_events()[0]) == 1
    for token in (900, 901):  # tokens 7 and 8 complete block 1
        r.append_output_token(token)
        assert m.allocate_slots(r, 1) == [0, 1]
        r.num_computed_tokens += 1
        m.cache_computed_blocks(r)
    r.append_output_token(902)
    assert m.allocate_slots(r, 1) == [0, 1, 2]
    stored, _ = m.take_events()
    assert stored == [r.block_hashes[1]]
    assert r.block_hashes == hash_prompt_blocks(r.all_token_ids, BLOCK, root_hash(m.fingerprint))
    other = make_request(list(range(6)) + [900, 901, 5])
    assert m.get_computed_blocks(other)[1] == 8


def test_cache_salt_never_shares():
    m = make_manager()
    admit(m, make_request(range(9), cache_salt="tenant-a"))
    assert m.get_computed_blocks(make_request(range(9), cache_salt="tenant-b"))[1] == 0
    assert m.get_computed_blocks(make_request(range(9)))[1] == 0
    assert m.get_computed_blocks(make_request(range(9), cache_salt="tenant-a"))[1] == 8


def test_different_fingerprints_never_share_hashes():
    """Two models publish into one Redis index: their block hashes for the same tokens must differ."""
    m1 = make_manager(fingerprint=ModelFingerprint("org/model-a", "bfloat16", BLOCK))
    m2 = make_manager(fingerprint=ModelFingerprint("org/model-b", "bfloat16", BLOCK))
    m3 = make_manager(fingerprint=ModelFingerprint("org/model-a", "float16", BLOCK))
    published = []
    for m in (m1, m2, m3):
        admit(m, make_request(range(9)))
        published.append(set(m.take_events()[0]))
    assert all(len(p) == 2 for p in published)
    assert published[0].isdisjoint(published[1]) and published[0].isdisjoint(published[2])
    assert published[1].isdisjoint(published[2])
    with pytest.raises(ValueError):
        make_manager(fingerprint=ModelFingerprint("org/model-a", "bfloat16", 16))


def test_prefix_caching_disabled():
    m = make_manager(caching=False)
    a = make_request(range(9))
    admit(m, a)
    assert m.get_computed_blocks(make_request(range(9))) == ([], 0)
    assert m.take_events() == ([], []) and a.block_hashes == []
    m.free(a)
    assert m.num_free_blocks == 10


def test_free_unknown_and_get_block_ids():
    m = make_manager()
    r = make_request(range(5))
    m.free(r)  # never allocated: no-op
    assert m.allocate_slots(r, 5) == [0, 1]
    assert m.get_block_ids(r.request_id) == [0, 1]
    m.free(r)
    assert m.get_block_ids(r.request_id) == [] and m.num_free_blocks == m.num_total_blocks
    with pytest.raises(ValueError):
        hits, _ = m.get_computed_blocks(r)
        m.allocate_slots(r, 1)
        m.allocate_slots(r, 1, [m.pool.blocks[5]])  # hits only at the first allocation
