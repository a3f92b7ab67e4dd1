"""BlockPool: LRU free queue, ref counts, hash map, eviction and KV events."""

from __future__ import annotations

import pytest

from pdpool.block_hash import BlockHash
from pdpool.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def free_ids(pool: BlockPool) -> list[int]:
    return pool.free_queue.block_ids()


def test_free_queue_links():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 2, 0] and len(q) == 5
    with pytest.raises(ValueError):
        q.remove(KVBlock(9))
    for _ in range(5):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1] and [b.ref_cnt for b in blocks] == [1, 1]
    assert free_ids(pool) == [2, 3, 4, 5]
    assert pool.num_free_blocks == 4 and pool.usage == pytest.approx(2 / 6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 4


def test_free_appends_in_given_order_and_rejects_double_free():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [3, 2, 1, 0]
    with pytest.raises(ValueError):
        pool.free_blocks([a[0]])


def test_touch_takes_a_free_cached_block_out_of_the_middle():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(1), h(2)])
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [2, 3, 4, 1, 0]
    hit = pool.get_cached_block(h(2))
    assert hit is a[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [2, 3, 4, 0]
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 4
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 4
    pool.free_blocks([hit])
    assert free_ids(pool) == [2, 3, 4, 0, 1]


def test_reuse_of_a_free_cached_block_evicts_its_hash():
    pool = BlockPool(3)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a[:2], [h(1), h(2)])
    pool.free_blocks(a)  # queue: 0, 1, 2
    assert pool.take_events() == ([h(1), h(2)], [])
    [b] = pool.get_new_blocks(1)
    assert b.block_id == 0 and b.block_hash is None
    assert pool.get_cached_block(h(1)) is None and pool.get_cached_block(h(2)) is a[1]
    assert pool.take_events() == ([], [h(1)])
    assert pool.take_events() == ([], [])


def test_events_are_the_net_change():
    pool = BlockPool(2)
    [a] = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [h(7)])
    pool.free_blocks([a])
    pool.get_new_blocks(2)  # evicts h(7) before anyone saw it stored
    assert pool.take_events() == ([], [])

    pool = BlockPool(2)
    [a] = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [h(7)])
    assert pool.take_events() == ([h(7)], [])
    pool.free_blocks([a])
    [a] = pool.get_new_blocks(1)  # block 1 (head), h(7) survives in block 0
    assert pool.take_events() == ([], [])
    [b] = pool.get_new_blocks(1)  # block 0: evicts h(7)
    pool.cache_full_blocks([b], [h(7)])  # and stores it again
    assert pool.take_events() == ([], [])


def test_a_hash_maps_to_one_block_and_a_cached_block_keeps_its_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(1)])
    pool.cache_full_blocks([b], [h(1)])  # computed the same prefix concurrently
    assert b.block_hash is None and pool.get_cached_block(h(1)) is a
    pool.cache_full_blocks([a], [h(2)])
    assert a.block_hash == h(1) and pool.get_cached_block(h(2)) is None


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)])
    assert pool.get_cached_block(h(1)) is None and pool.take_events() == ([], [])
