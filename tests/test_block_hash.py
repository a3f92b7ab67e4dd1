"""Block hashes: committed vectors (router, engines and Redis index must agree bit for bit) and properties."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings, strategies as st

from pdpool.block_hash import (HASH_BYTES, ModelFingerprint, extend_block_hashes, hash_block_tokens,
                               hash_prompt_blocks, root_hash)

FP = ModelFingerprint("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 16)

# Changing any of these breaks every deployed router/Redis index: bump the hash version instead.
ROOT = "a29e5797a72ce58b6f1553a8847afb08"
ROOT_SALT_TENANT_A = "1afc2ec993d44711fd00c1dddfd5d20f"
ROOT_SALT_EMPTY = "a10aeafddc5c9bc5a54dab06de026c5b"
H0 = "57f87758cbe163ddcca6ad10c8a87409"  # tokens 0..15
H1 = "d403f06943e957ac1a79bc2f95065a6c"  # tokens 16..31
H0_EXTRA = "d138fe5fa0abd62aa3a4a657167681ee"  # tokens 0..15, extra_keys=("img:abc",)


def test_committed_vectors():
    root = root_hash(FP)
    assert root.hex() == ROOT
    assert root_hash(FP, "tenant-a").hex() == ROOT_SALT_TENANT_A
    assert root_hash(FP, "").hex() == ROOT_SALT_EMPTY
    h0 = hash_block_tokens(root, list(range(16)))
    assert h0.hex() == H0
    assert hash_block_tokens(h0, list(range(16, 32))).hex() == H1
    assert hash_block_tokens(root, list(range(16)), ("img:abc",)).hex() == H0_EXTRA
    assert [h.hex() for h in hash_prompt_blocks(list(range(40)), 16, root)] == [H0, H1]


def _fields(*fields: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(f)) + f for f in fields)


def test_vectors_follow_the_documented_encoding():
    """Re-derive the vectors from the docstring's recipe, independently of the module's helpers."""
    fp = _fields(FP.model_id.encode(), FP.dtype.encode(), struct.pack("<I", 16))
    root = hashlib.sha256(_fields(b"pdpool-block-hash-v1", fp, b"")).digest()[:16]
    assert root.hex() == ROOT
    tokens = struct.pack("<16I", *range(16))
    assert hashlib.sha256(_fields(root, tokens, b"")).digest()[:16].hex() == H0


def test_empty_salt_differs_from_no_salt():
    assert root_hash(FP) != root_hash(FP, "")


def test_partial_block_has_no_hash():
    root = root_hash(FP)
    assert hash_prompt_blocks(list(range(15)), 16, root) == []
    assert len(hash_prompt_blocks(list(range(32)), 16, root)) == 2


tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=80)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, block_size=st.sampled_from([4, 8, 16]))
def test_prompt_blocks_chain_block_by_block(tokens, block_size):
    root = root_hash(FP)
    hashes = hash_prompt_blocks(tokens, block_size, root)
    assert len(hashes) == len(tokens) // block_size
    parent = root
    for i, h in enumerate(hashes):
        assert len(h) == HASH_BYTES
        assert h == hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size])
        parent = h
    # A prefix's hashes are a prefix of the hashes.
    assert hash_prompt_blocks(tokens[:block_size * (len(hashes) // 2)], block_size, root) == \
        hashes[:len(hashes) // 2]


@settings(max_examples=60, deadline=None)
@given(a=st.lists(st.integers(0, 1000), min_size=8, max_size=8),
       b=st.lists(st.integers(0, 1000), min_size=8, max_size=8))
def test_same_tail_block_after_different_parents_differs(a, b):
    root = root_hash(FP)
    tail = list(range(8))
    ha = hash_prompt_blocks(a + tail, 8, root)
    hb = hash_prompt_blocks(b + tail, 8, root)
    assert (ha[1] == hb[1]) == (a == b)


@settings(max_examples=40, deadline=None)
@given(salt_a=st.one_of(st.none(), st.text(max_size=8)), salt_b=st.one_of(st.none(), st.text(max_size=8)))
def test_salt_isolation(salt_a, salt_b):
    tokens = list(range(32))
    ha = hash_prompt_blocks(tokens, 16, root_hash(FP, salt_a))
    hb = hash_prompt_blocks(tokens, 16, root_hash(FP, salt_b))
    assert set(ha).isdisjoint(hb) == (salt_a != salt_b)


def test_fingerprint_isolation():
    tokens = list(range(32))
    fingerprints = [FP, ModelFingerprint(FP.model_id, "float32", 16), ModelFingerprint("other/model", "bfloat16", 16),
                    ModelFingerprint(FP.model_id, "bfloat16", 32)]
    seen: set[bytes] = set()
    for fp in fingerprints:
        hashes = hash_prompt_blocks(tokens, 16, root_hash(fp))
        assert seen.isdisjoint(hashes)
        seen.update(hashes)


def test_field_boundaries_are_unambiguous():
    assert root_hash(ModelFingerprint("ab", "c", 16)) != root_hash(ModelFingerprint("a", "bc", 16))
    root = root_hash(FP)
    assert hash_block_tokens(root, [1, 2], ("ab",)) != hash_block_tokens(root, [1, 2], ("a", "b"))
    assert hash_block_tokens(root, [1]) != hash_block_tokens(root, [1, 0])


def _extend_block_by_block(hashes, tokens, block_size, root, extra_keys=()):
    """The implementation before the one-buffer fast path (a block at a time), kept as the reference."""
    hashes = list(hashes)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200), block_size=st.sampled_from([1, 3, 4, 16, 32]),
       already=st.integers(0, 10), extra_keys=st.lists(st.text(max_size=6), max_size=3),
       salt=st.one_of(st.none(), st.text(max_size=6)))
def test_one_buffer_path_equals_block_by_block(tokens, block_size, already, extra_keys, salt):
    """The engines, the router and the Redis index depend on these bits: the fast path must not change one."""
    root = root_hash(FP, salt)
    full = _extend_block_by_block([], tokens, block_size, root, extra_keys)
    assert hash_prompt_blocks(tokens, block_size, root, extra_keys) == full
    start = full[:min(already, len(full))]  # a request's hashes growing as its output fills blocks
    assert extend_block_hashes(list(start), tokens, block_size, root, extra_keys) == full


def test_one_buffer_path_refuses_what_the_block_path_refuses():
    root = root_hash(FP)
    for bad in ([-1] * 16, [2**32] * 16):
        with pytest.raises(struct.error):
            hash_prompt_blocks(bad, 16, root)
        with pytest.raises(struct.error):
            hash_block_tokens(root, bad)


@given(model=st.text(max_size=20), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       block_size=st.integers(1, 256), salt=st.none() | st.text(max_size=20))
def test_root_hash_kept_per_fingerprint_and_salt_is_the_computed_one(model, dtype, block_size, salt):
    fp = ModelFingerprint(model, dtype, block_size)
    computed = root_hash.__wrapped__(fp, salt)
    assert root_hash(fp, salt) == computed
    assert root_hash(ModelFingerprint(model, dtype, block_size), salt) == computed   # an equal fingerprint
