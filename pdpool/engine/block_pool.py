"""KV blocks, their ref counts, the LRU free queue and the prefix-cache map.

Every block is either referenced (``ref_cnt > 0``, in some request's block table) or in the free queue.
A free block may still hold a cached hash: it can be hit again (``touch`` takes it out of the middle of
the queue in O(1)) until ``get_new_blocks`` pops it from the head, which evicts its hash. Freed blocks go
to the tail, so the head is the least recently used.

No block is reserved as a null block: padded block-table entries are never read past ``seq_lens`` and
padded tokens write to slot -1, so any id may pad a block table.

KV events for the Redis index are the *net* change of the cached hash set since the last
``take_events()``: a hash stored then evicted in between is reported in neither list.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pdpool.block_hash import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: popleft, append and remove are O(1)."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self.head, self.tail = KVBlock(-1), KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Ids from head (evicted first) to tail."""
        ids, block = [], self.head.next_free
        while block is not self.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._stored: dict[BlockHash, None] = {}  # ordered sets
        self._removed: dict[BlockHash, None] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the head of the free queue (evicting their hashes), each with ref 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A cache hit: take a reference, and take the block out of the free queue if it was free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail in the given order (first = evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Enter full, computed ``blocks`` in the cache under ``block_hashes`` (paired by position).

        A block already cached keeps its hash; a hash already cached by another block (two requests
        computed the same prefix at once) leaves the duplicate uncached.
        """
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if block_hash in self._removed:
                del self._removed[block_hash]
            else:
                self._stored[block_hash] = None

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        del self.cached[block_hash]
        if block_hash in self._stored:
            del self._stored[block_hash]
        else:
            self._removed[block_hash] = None

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(hashes stored, hashes evicted) since the last call, as a net change."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        return stored, removed
