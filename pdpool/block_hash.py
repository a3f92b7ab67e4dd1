"""Prefix-cache block hashes, shared bit for bit by engines, router and Redis index.

A full block's hash chains its parent's hash with its token ids::

    root   = H(b"pdpool-root-v1", fingerprint, cache_salt)
    h[0]   = H(root,   tokens[0:B],   extra_keys)
    h[i]   = H(h[i-1], tokens[iB:(i+1)B], extra_keys)

H is SHA-256 over a canonical byte encoding, truncated to 128 bits. The root is
seeded with the model fingerprint (model id, dtype, block size) and an optional
per-request ``cache_salt``, so different models or tenants never share blocks.
Python's ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, NewType, Sequence

BlockHash = NewType("BlockHash", bytes)  # 16 bytes
HASH_BYTES = 16
_VERSION = b"pdpool-block-hash-v1"


@dataclass(frozen=True)
class ModelFingerprint:
    model_id: str
    dtype: str
    block_size: int

    def encode(self) -> bytes:
        return _encode_fields([self.model_id.encode(), self.dtype.encode(), struct.pack("<I", self.block_size)])


def _encode_fields(fields: Iterable[bytes]) -> bytes:
    # Length-prefixed, so no two different field lists encode to the same bytes.
    return b"".join(struct.pack("<I", len(f)) + f for f in fields)


def _digest(*fields: bytes) -> BlockHash:
    return BlockHash(hashlib.sha256(_encode_fields(fields)).digest()[:HASH_BYTES])


@functools.lru_cache(maxsize=1024)
def root_hash(fingerprint: ModelFingerprint, cache_salt: str | None = None) -> BlockHash:
    """Kept per (fingerprint, salt): the router asks for it once per request, and a SHA-256 object costs more
    than the lookup (4.5% of the router's CPU per request, docs/performance.md, router overhead round 7)."""
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
    return _digest(_VERSION, fingerprint.encode(), salt)


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int],
                      extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash of one full block, chained to its parent (the root for the first block)."""
    extras = _encode_fields(k.encode() for k in extra_keys)
    return _digest(parent_hash, _encode_tokens(token_ids), extras)


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, root: BlockHash,
                       extra_keys: Sequence[str] = ()) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; a trailing partial block has none."""
    return extend_block_hashes([], token_ids, block_size, root, extra_keys)


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: BlockHash,
                        extra_keys: Sequence[str] = ()) -> list[BlockHash]:
    """Append to ``hashes`` (those of the leading full blocks of ``token_ids``) the hashes of the blocks that are
    full now; returns ``hashes``. A request's hashes grow this way as its output fills blocks.

    Bit for bit ``hash_block_tokens`` chained block by block (a test checks it), but the new blocks' token ids
    are packed into one buffer and each digest hashes one concatenation of fixed framing and a slice of it::

        sha256( len(parent) | parent | len(block bytes) | tokens[iB:(i+1)B] as <u32 | len(extras) | extras )[:16]

    The loop runs in C (``hash_chain`` of ``pdpool/csrc/pieces.c``, built on first use by ``pdpool.native_text``)
    where that module builds, else in ``hashlib``: the same bytes either way (a property test checks it), about
    six times fewer µs per block in C, which every engine's admission and every router request pays.
    """
    first, num_full = len(hashes), len(token_ids) // block_size
    if num_full <= first:
        return hashes
    tokens = _encode_tokens(token_ids[first * block_size:num_full * block_size])
    extras = _encode_fields(k.encode() for k in extra_keys)
    parent = hashes[-1] if hashes else root
    tail = struct.pack("<I", len(extras)) + extras
    chain = _chain[0] if _chain else native_chain()
    if chain is not None and len(parent) == HASH_BYTES:
        hashes.extend(chain(parent, tokens, 4 * block_size, tail))
        return hashes
    return _extend_hashlib(hashes, parent, tokens, 4 * block_size, tail)


def _extend_hashlib(hashes: list[BlockHash], parent: bytes, tokens: bytes, step: int,
                    tail: bytes) -> list[BlockHash]:
    """``extend_block_hashes``' loop in Python: ``tokens`` holds whole blocks of ``step`` bytes."""
    head = struct.pack("<I", len(parent))       # every hash, the root included, is HASH_BYTES long
    middle = struct.pack("<I", step)
    sha256 = hashlib.sha256
    for start in range(0, len(tokens), step):
        parent = sha256(head + parent + middle + tokens[start:start + step] + tail).digest()[:HASH_BYTES]
        hashes.append(parent)
    return hashes


_chain: list = []   # [the native ``hash_chain``, or None], looked up once


def native_chain():
    """The native module's ``hash_chain``, or None where it cannot be had (no compiler or no ``Python.h``: logged
    once by ``pdpool.native_text``; ``PDPOOL_ROUTER_NATIVE=0``). Building it takes about a second the first time
    on a machine, so engines call this at start, not in their first step."""
    if not _chain:
        from pdpool import native_text

        _chain.append(getattr(native_text.load(), "hash_chain", None))
    return _chain[0]
