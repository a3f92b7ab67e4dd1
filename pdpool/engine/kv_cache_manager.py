"""Block tables of requests: prefix-cache lookup, slot allocation, caching of full blocks, freeing.

The scheduler asks; this module keeps the books in a ``BlockPool``. Block hashes come from
``pdpool.block_hash`` so the router and the Redis index compute the same ones.
"""

from __future__ import annotations

from typing import Sequence

from pdpool.block_hash import ModelFingerprint, extend_block_hashes, native_chain, root_hash
from pdpool.engine.block_pool import BlockPool, KVBlock
from pdpool.engine.request import Request
from pdpool.utils import cdiv


class KVCacheManager:
    """``fingerprint`` seeds the block hashes; engines pass the real model's (the default suits tests only)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 fingerprint: ModelFingerprint | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.fingerprint = fingerprint or ModelFingerprint("pdpool-test", "none", block_size)
        if self.fingerprint.block_size != block_size:
            raise ValueError("fingerprint.block_size differs from block_size")
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same tables as ids (what allocate_slots returns)
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a table already offered to the cache
        native_chain()   # the C block hashes, built now if need be rather than in the first request's step

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of ``request.all_token_ids``."""
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            root_hash(self.fingerprint, request.cache_salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks and its token count; takes no reference.

        At most ``num_tokens - 1`` tokens hit, so the step still computes the last token and samples.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self.update_block_hashes(request)
        if request.prompt_logprobs is not None:   # its prompt's logits are needed: computed, not read
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> list[int] | None:
        """Grow the request's block table to hold its next ``num_new_tokens``; None if it does not fit.

        ::

            | <- comp -> | <- new_comp -> | <------ new ------> |
              computed     prefix-cache     tokens computed by
              and held     hit (touched)    this step (fresh blocks where needed)

            comp     = request.num_computed_tokens
            new_comp = len(new_computed_blocks) * block_size   (only at the first allocation)
            needed   = cdiv(comp + new_comp + new, block_size) - len(held blocks) - len(new_computed_blocks)

        On success the hit blocks get a reference and the whole block table's ids are returned; on None
        nothing changed and the caller decides whether to preempt.
        """
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:  # a held table grows (decode, next chunk): per step
            ids = self.req_block_ids[request.request_id]  # and request, so no per-block work unless it grows
            num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
            if num_needed > 0:
                if num_needed > self.pool.num_free_blocks:
                    return None
                new = self.pool.get_new_blocks(num_needed)
                blocks.extend(new)
                ids.extend(b.block_id for b in new)
            return ids[:]
        blocks = blocks if blocks is not None else []
        if new_computed_blocks and blocks:
            raise ValueError("new_computed_blocks are only taken at a request's first allocation")
        num_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        if request.request_id not in self.req_blocks:
            self.req_blocks[request.request_id] = blocks
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        ids = self.req_block_ids[request.request_id] = [b.block_id for b in blocks]
        return ids[:]

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's full blocks up to ``num_computed_tokens`` to the prefix cache."""
        if not self.enable_prefix_caching or request.request_id not in self.req_blocks:
            return
        blocks = self.req_blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        self.update_block_hashes(request)
        self.pool.cache_full_blocks(blocks[num_cached:num_full], request.block_hashes[num_cached:num_full])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's references; its last blocks go first in the free queue (evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_block_ids.get(request_id, ()))

    def take_events(self):
        return self.pool.take_events()
