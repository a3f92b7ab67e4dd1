"""The KV handle: what a prefill node hands back so a decode node can take over a request's KV.

It travels as JSON (the ``kv_transfer_params`` of a completion), so it is a versioned dataclass with
``to_dict``/``from_dict`` and strict validation. Field names follow vLLM's disaggregation params where
they fit (``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``, ``remote_block_ids``,
``remote_host``, ``remote_port``); pdpool's own fields sit beside them.

Time is relative: ``lease_remaining_s`` is how long the prefill node still holds the blocks, measured when
the handle was issued, so no two nodes need to agree on a clock.

A handle is for one prompt exactly. ``block_hashes`` has the chained hash of every full block of the prompt and
``partial_block_hash`` chains the trailing partial block (empty when the prompt fills its blocks) onto them::

    | block 0 | block 1 | ... | block k-1 | tail (num_tokens % block_size tokens) |
      h[0]      h[1]            h[k-1]      partial_block_hash = H(h[k-1] or root, tail)

Version 2 added ``partial_block_hash`` and requires every full block's hash (version 1 accepted none).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

from pdpool.block_hash import BlockHash, ModelFingerprint, hash_block_tokens
from pdpool.kv_transfer.layout import KV_LAYOUT, KVRegion, block_bytes_of
from pdpool.utils import cdiv

HANDLE_VERSION = 2
TRANSFER_MODES = ("pull", "push")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class KVHandleError(ValueError):
    """A KV handle is malformed."""


class IncompatibleKVError(KVHandleError):
    """The peer's KV cache cannot be used here (different model, dtype, shape or layout)."""


@dataclass(frozen=True)
class KVFingerprint:
    """Everything two nodes must share for one's KV blocks to be valid in the other's cache."""
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = KV_LAYOUT

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise KVHandleError(f"fingerprint.dtype {self.dtype!r} is not one of {sorted(_ITEMSIZE)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KVHandleError(f"fingerprint.{name} must be a positive int, got {value!r}")

    @property
    def block_bytes(self) -> int:
        return block_bytes_of(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                              _ITEMSIZE[self.dtype])

    @classmethod
    def of(cls, model: ModelFingerprint, num_layers: int, num_kv_heads: int, head_dim: int) -> "KVFingerprint":
        """The KV fingerprint of an engine: its block-hash fingerprint plus the cache's shape."""
        return cls(model=model.model_id, dtype=model.dtype, block_size=model.block_size, num_layers=num_layers,
                   num_kv_heads=num_kv_heads, head_dim=head_dim)

    @property
    def model_fingerprint(self) -> ModelFingerprint:
        """The block-hash fingerprint it extends (what seeds the prefix-cache hashes)."""
        return ModelFingerprint(self.model, self.dtype, self.block_size)

    def mismatches(self, other: "KVFingerprint") -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise KVHandleError(message)


def _is_int(value: Any, lo: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class KVHandle:
    # vLLM's disaggregation params
    do_remote_prefill: bool
    do_remote_decode: bool
    remote_engine_id: str
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    # pdpool's
    node_id: str
    incarnation: str
    agent_name: str
    lease_id: str
    lease_remaining_s: float
    block_hashes: list[str]           # hex, one per full block, chained (pdpool.block_hash)
    num_tokens: int                   # prompt tokens whose KV the blocks hold
    partial_block_hash: str           # hex, the trailing partial block chained on block_hashes (see above)
    fingerprint: KVFingerprint
    rank_layouts: list[KVRegion]      # one per tensor-parallel rank (one today)
    transfer_mode: str = "pull"
    first_token_id: int | None = None
    first_token_logprobs: dict[str, Any] | None = None
    pdpool_version: int = HANDLE_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # forward-compatible slot, ignored by this version

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(self.pdpool_version == HANDLE_VERSION,
               f"KV handle version {self.pdpool_version!r}, this node speaks {HANDLE_VERSION}")
        _check(not (self.do_remote_prefill and self.do_remote_decode),
               "do_remote_prefill and do_remote_decode cannot both be set")
        for name in ("remote_engine_id", "remote_host", "node_id", "incarnation", "agent_name", "lease_id"):
            _check(isinstance(getattr(self, name), str) and getattr(self, name) != "",
                   f"{name} must be a non-empty string")
        _check(_is_int(self.remote_port, 1) and self.remote_port <= 65535,
               f"remote_port must be in 1..65535, got {self.remote_port!r}")
        _check(isinstance(self.lease_remaining_s, (int, float)) and not isinstance(self.lease_remaining_s, bool)
               and math.isfinite(self.lease_remaining_s) and self.lease_remaining_s >= 0,
               f"lease_remaining_s must be a finite number >= 0, got {self.lease_remaining_s!r}")
        _check(self.transfer_mode in TRANSFER_MODES,
               f"transfer_mode must be one of {TRANSFER_MODES}, got {self.transfer_mode!r}")
        _check(_is_int(self.num_tokens, 1), f"num_tokens must be an int >= 1, got {self.num_tokens!r}")
        _check(isinstance(self.remote_block_ids, list) and all(_is_int(b) for b in self.remote_block_ids),
               "remote_block_ids must be a list of ints >= 0")
        _check(len(set(self.remote_block_ids)) == len(self.remote_block_ids), "remote_block_ids repeat")
        bs = self.fingerprint.block_size
        _check(len(self.remote_block_ids) == cdiv(self.num_tokens, bs),
               f"{len(self.remote_block_ids)} remote_block_ids for {self.num_tokens} tokens "
               f"in blocks of {bs} (expected {cdiv(self.num_tokens, bs)})")
        _check(isinstance(self.block_hashes, list) and all(_is_hex16(h) for h in self.block_hashes),
               "block_hashes must be a list of 32-digit hex strings")
        _check(len(self.block_hashes) == self.num_tokens // bs,
               f"{len(self.block_hashes)} block_hashes for {self.num_tokens // bs} full blocks")
        _check(_is_hex16(self.partial_block_hash), "partial_block_hash must be a 32-digit hex string")
        _check(self.first_token_id is None or _is_int(self.first_token_id),
               f"first_token_id must be an int >= 0 or null, got {self.first_token_id!r}")
        lp = self.first_token_logprobs
        _check(lp is None or isinstance(lp, dict), "first_token_logprobs must be an object or null")
        if lp is not None:
            _check(_is_number(lp.get("logprob")), f"first_token_logprobs.logprob must be a number, "
                                                  f"got {lp.get('logprob')!r}")
            top = lp.get("top")
            _check(top is None or (isinstance(top, list) and all(
                isinstance(e, list) and len(e) == 2 and _is_int(e[0]) and _is_number(e[1]) for e in top)),
                "first_token_logprobs.top must be a list of [token id, logprob] pairs or null")
        _check(isinstance(self.extra, dict), f"extra must be an object, got {type(self.extra).__name__}")
        _check(isinstance(self.rank_layouts, list) and len(self.rank_layouts) >= 1, "rank_layouts is empty")
        for i, region in enumerate(self.rank_layouts):
            _check(region.rank == i, f"rank_layouts[{i}] is for rank {region.rank}")
            _check(region.block_bytes == self.fingerprint.block_bytes,
                   f"rank_layouts[{i}].block_bytes {region.block_bytes} != {self.fingerprint.block_bytes} "
                   f"implied by the fingerprint")
            bad = [b for b in self.remote_block_ids if b >= region.num_blocks]
            _check(not bad, f"remote_block_ids {bad[:4]} outside rank {i}'s {region.num_blocks} blocks")

    def binding(self) -> str:
        """What the handle claims of its lease: the blocks a decode node reads and the prompt they hold. The
        prefill node keeps the issued handle's binding with the lease and counts a notification (or a push) as
        held only when it names the same one, so a handle edited to read other blocks, or to pass for another
        prompt, never counts as held."""
        claim = [self.lease_id, self.remote_block_ids, self.num_tokens, self.block_hashes, self.partial_block_hash]
        return hashlib.sha256(json.dumps(claim, separators=(",", ":")).encode()).hexdigest()

    def check_compatible(self, local: KVFingerprint, num_ranks: int = 1) -> None:
        """Raise ``IncompatibleKVError`` naming the first field where the peer's KV differs from ours."""
        for name in local.mismatches(self.fingerprint):
            raise IncompatibleKVError(
                f"KV from node {self.node_id} is incompatible: {name} is {getattr(self.fingerprint, name)!r} "
                f"there and {getattr(local, name)!r} here")
        if len(self.rank_layouts) != num_ranks:
            raise IncompatibleKVError(f"KV from node {self.node_id} is incompatible: it has "
                                      f"{len(self.rank_layouts)} tensor-parallel ranks, this node {num_ranks}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fingerprint"] = asdict(self.fingerprint)
        d["rank_layouts"] = [r.to_dict() for r in self.rank_layouts]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVHandle":
        if not isinstance(d, dict):
            raise KVHandleError(f"KV handle must be an object, got {type(d).__name__}")
        version = d.get("pdpool_version")
        _check(version == HANDLE_VERSION, f"KV handle version {version!r}, this node speaks {HANDLE_VERSION}")
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names - set(d) if fields_required(n))
        _check(not missing, f"KV handle is missing {missing}")
        kwargs = {k: v for k, v in d.items() if k in names}
        extra = d.get("extra", {})
        _check(isinstance(extra, dict), f"extra must be an object, got {type(extra).__name__}")
        kwargs["extra"] = {**extra, **{k: v for k, v in d.items() if k not in names}}
        try:
            kwargs["fingerprint"] = KVFingerprint(**d["fingerprint"])
            kwargs["rank_layouts"] = [KVRegion.from_dict(r) for r in d["rank_layouts"]]
        except (TypeError, KeyError, ValueError) as exc:
            if isinstance(exc, KVHandleError):
                raise
            raise KVHandleError(f"KV handle fingerprint or rank_layouts malformed: {exc}") from exc
        return cls(**kwargs)


_OPTIONAL = {"transfer_mode", "first_token_id", "first_token_logprobs", "pdpool_version", "extra"}


def partial_block_hash(prompt_token_ids: Sequence[int], full_block_hashes: Sequence[BlockHash], block_size: int,
                       root: BlockHash) -> str:
    """The handle's ``partial_block_hash``: the prompt's tail after its full blocks, chained on the last one's hash
    (on ``root`` when the prompt is shorter than a block); ``full_block_hashes`` has at least the full blocks'."""
    num_full = len(prompt_token_ids) // block_size
    if len(full_block_hashes) < num_full:
        raise ValueError(f"{len(full_block_hashes)} hashes for {num_full} full blocks")
    parent = full_block_hashes[num_full - 1] if num_full else root
    return hash_block_tokens(parent, prompt_token_ids[num_full * block_size:]).hex()


def fields_required(name: str) -> bool:
    return name not in _OPTIONAL


def _is_hex16(h: Any) -> bool:
    if not isinstance(h, str) or len(h) != 32:
        return False
    try:
        int(h, 16)
    except ValueError:
        return False
    return True
