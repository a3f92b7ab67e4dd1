"""The overhead benchmark's stub upstream (``benchmarks/router_stub_upstream.py``) publishes the engines' own block
hashes: its ``BlockHasher``, which memoizes blocks by their ids' JSON text, equals ``hash_prompt_blocks`` on any
forwarded body, compact or not, one prompt or several, with the memo warm, cold or emptied midway."""

import importlib.util
import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash

_spec = importlib.util.spec_from_file_location(
    "router_stub_upstream", Path(__file__).resolve().parents[2] / "benchmarks/router_stub_upstream.py")
stub = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stub)

ROOT = root_hash(ModelFingerprint("demo", "float32", 16))
SHARED = list(range(1000, 1000 + 200))
ids_lists = st.lists(st.integers(0, 2**31 - 1), max_size=120) | st.builds(
    lambda k, tail: SHARED[:k] + tail, st.integers(0, 200), st.lists(st.integers(0, 50_000), max_size=60))


def body(prompts: list[list[int]], compact: bool) -> bytes:
    head = b'{"model":"demo","prompt":"x","pdpool_prompt_token_ids":'
    return head + json.dumps(prompts, separators=(",", ":") if compact else None).encode() + b"}"


HASHER = stub.BlockHasher(16, ROOT, capacity=300)   # shared across examples: warm, and emptied now and then


@settings(max_examples=300, deadline=None)
@given(st.lists(ids_lists, min_size=1, max_size=3), st.booleans())
def test_block_hasher_equals_the_engines_hashes(prompts, compact):
    assert HASHER.prompts(body(prompts, compact)) == [hash_prompt_blocks(ids, 16, ROOT) for ids in prompts]


def test_a_shared_prefix_is_looked_up_not_hashed_again():
    hasher = stub.BlockHasher(16, ROOT)
    hasher.prompts(body([SHARED + [7] * 20], True))
    size = len(hasher.memo)
    assert hasher.prompts(body([SHARED + [9] * 20], True)) == [hash_prompt_blocks(SHARED + [9] * 20, 16, ROOT)]
    assert len(hasher.memo) == size + 1          # only the one fresh block was hashed


class _Index:
    def __init__(self) -> None:
        self.calls: list[tuple[set, set]] = []

    def publish(self, stored, removed) -> None:
        self.calls.append((set(stored), set(removed)))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(ids_lists, min_size=1, max_size=2), min_size=1, max_size=6), st.integers(2, 40))
def test_storing_at_the_step_publishes_what_storing_at_once_does(bodies, capacity):
    """``--index-work step`` (a served body's blocks stored at the next publish) against ``response`` (stored at
    once): after the step, the same cache and the same net change go to the index."""
    import asyncio

    async def run(at_step: bool):
        index = _Index()
        cache = stub.PrefixCache(index, capacity, step=0.001, at_step=at_step)
        for prompts in bodies:
            cache.served(body(prompts, True))
        assert (len(cache.queued) == len(bodies)) if at_step else not cache.queued
        await asyncio.sleep(0.01)
        assert cache.flush_at is None and not cache.queued and not cache.touched
        return list(cache.lru), index.calls

    assert asyncio.run(run(True)) == asyncio.run(run(False))
