"""The KV handle: JSON round trip, validation, compatibility errors that name the field."""

from __future__ import annotations

import json

import pytest

from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash
from pdpool.kv_transfer.handle import (HANDLE_VERSION, IncompatibleKVError, KVFingerprint, KVHandle,
                                       KVHandleError, partial_block_hash)
from pdpool.kv_transfer.layout import KVRegion

FP = KVFingerprint(model="demo", dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)


ROOT = root_hash(ModelFingerprint("demo", "float32", 16))
TOKENS = list(range(40))  # 2 full blocks + 8 tokens


def make_handle(**overrides) -> KVHandle:
    hashes = hash_prompt_blocks(TOKENS, 16, ROOT)
    fields = dict(
        do_remote_prefill=True, do_remote_decode=False, remote_engine_id="prefill-0",
        remote_block_ids=[7, 3, 12], remote_host="10.0.0.5", remote_port=8000,
        node_id="prefill-0", incarnation="a1b2", agent_name="prefill-0#a1b2", lease_id="lease-42",
        lease_remaining_s=29.5, block_hashes=[h.hex() for h in hashes], num_tokens=40,
        partial_block_hash=partial_block_hash(TOKENS, hashes, 16, ROOT),
        first_token_id=1234, first_token_logprobs={"token_id": 1234, "logprob": -0.25, "top": [[1234, -0.25]]},
        fingerprint=FP, transfer_mode="pull",
        rank_layouts=[KVRegion(base_addr=0x7F0000000000, num_blocks=64, block_bytes=FP.block_bytes)])
    fields.update(overrides)
    return KVHandle(**fields)


def test_round_trip_through_json():
    handle = make_handle()
    wire = json.loads(json.dumps(handle.to_dict()))
    assert wire["pdpool_version"] == HANDLE_VERSION
    assert wire["fingerprint"]["num_kv_heads"] == 3 and wire["rank_layouts"][0]["rank"] == 0
    assert KVHandle.from_dict(wire) == handle


def test_unknown_fields_are_kept_aside():
    wire = make_handle().to_dict()
    wire["future_field"] = 1
    assert KVHandle.from_dict(wire).extra == {"future_field": 1}


def test_binding_names_the_blocks_and_the_prompt_the_handle_claims():
    """What the prefill node checks at notification: a handle edited to read other blocks of the lease, or to
    pass for another prompt, binds to something else; the round trip and the lease's remaining time do not."""
    handle = make_handle()
    assert KVHandle.from_dict(json.loads(json.dumps(handle.to_dict()))).binding() == handle.binding()
    assert make_handle(lease_remaining_s=3.0, first_token_id=5).binding() == handle.binding()
    hashes = handle.block_hashes
    for edit in ({"remote_block_ids": [3, 7, 12]}, {"remote_block_ids": [7, 3, 13]}, {"lease_id": "lease-43"},
                 {"block_hashes": hashes[::-1]}, {"partial_block_hash": hashes[0]},
                 {"num_tokens": 41, "block_hashes": hashes}):
        assert make_handle(**edit).binding() != handle.binding(), edit


def test_compatible_fingerprint_passes():
    make_handle().check_compatible(FP)


@pytest.mark.parametrize("field,value", [("model", "other-model"), ("dtype", "bfloat16"), ("block_size", 32),
                                         ("num_layers", 24), ("num_kv_heads", 4), ("head_dim", 128),
                                         ("layout", "layers,blocks,kv")])
def test_incompatible_fingerprint_names_the_field(field, value):
    local = KVFingerprint(**{**FP.__dict__, field: value})
    with pytest.raises(IncompatibleKVError, match=f"{field} is .* there and {value!r} here"):
        make_handle().check_compatible(local)


def test_rank_count_must_match():
    with pytest.raises(IncompatibleKVError, match="1 tensor-parallel ranks, this node 2"):
        make_handle().check_compatible(FP, num_ranks=2)


@pytest.mark.parametrize("overrides,match", [
    (dict(pdpool_version=1), "version 1"),
    (dict(do_remote_decode=True), "cannot both"),
    (dict(transfer_mode="teleport"), "transfer_mode"),
    (dict(remote_port=0), "remote_port"),
    (dict(lease_remaining_s=-1.0), "lease_remaining_s"),
    (dict(lease_remaining_s=float("nan")), "lease_remaining_s"),
    (dict(remote_block_ids=[7, 3]), "2 remote_block_ids for 40 tokens"),
    (dict(remote_block_ids=[7, 7, 3]), "repeat"),
    (dict(remote_block_ids=[7, 3, 64]), "outside rank 0's 64 blocks"),
    (dict(block_hashes=["zz" * 16, "00" * 16]), "32-digit hex"),
    (dict(block_hashes=["00" * 16]), "1 block_hashes for 2 full blocks"),
    (dict(block_hashes=[]), "0 block_hashes for 2 full blocks"),
    (dict(partial_block_hash="xyz"), "partial_block_hash"),
    (dict(partial_block_hash=None), "partial_block_hash"),
    (dict(agent_name=""), "agent_name"),
    (dict(first_token_id=-1), "first_token_id"),
    (dict(rank_layouts=[]), "rank_layouts is empty"),
    (dict(rank_layouts=[KVRegion(base_addr=1, num_blocks=64, block_bytes=100)]), "block_bytes 100"),
])
def test_validation_errors(overrides, match):
    with pytest.raises(KVHandleError, match=match):
        make_handle(**overrides)


def test_from_dict_errors():
    wire = make_handle().to_dict()
    del wire["lease_id"]
    with pytest.raises(KVHandleError, match="missing \\['lease_id'\\]"):
        KVHandle.from_dict(wire)
    wire = make_handle().to_dict()
    wire["fingerprint"]["dtype"] = "int3"
    with pytest.raises(KVHandleError, match="dtype"):
        KVHandle.from_dict(wire)
    with pytest.raises(KVHandleError, match="version None"):
        KVHandle.from_dict({})
    with pytest.raises(KVHandleError, match="must be an object"):
        KVHandle.from_dict([])


def test_partial_block_hash_covers_the_tail_and_chains_on_the_full_blocks():
    hashes = hash_prompt_blocks(TOKENS, 16, ROOT)
    h = partial_block_hash(TOKENS, hashes, 16, ROOT)
    assert partial_block_hash(TOKENS[:-1] + [999], hashes, 16, ROOT) != h           # only the tail differs
    other = hash_prompt_blocks([1] + TOKENS[1:], 16, ROOT)
    assert partial_block_hash([1] + TOKENS[1:], other, 16, ROOT) != h               # only a full block differs
    salted = root_hash(ModelFingerprint("demo", "float32", 16), "salt")
    assert partial_block_hash(TOKENS[:8], [], 16, salted) != partial_block_hash(TOKENS[:8], [], 16, ROOT)
    full = TOKENS[:32]
    assert partial_block_hash(full, hashes, 16, ROOT) != partial_block_hash(full[:16], hashes[:1], 16, ROOT)
    with pytest.raises(ValueError, match="2 full blocks"):
        partial_block_hash(TOKENS, hashes[:1], 16, ROOT)


@pytest.mark.parametrize("edit,match", [
    ({"extra": "x"}, "extra must be an object"), ({"extra": [1]}, "extra must be an object"),
    ({"first_token_logprobs": {"top": None}}, "first_token_logprobs.logprob"),
    ({"first_token_logprobs": {"logprob": True}}, "first_token_logprobs.logprob"),
    ({"first_token_logprobs": {"logprob": -1.0, "top": [[1, -1.0, 2]]}}, "first_token_logprobs.top"),
    ({"first_token_logprobs": {"logprob": -1.0, "top": "x"}}, "first_token_logprobs.top"),
])
def test_a_malformed_field_is_a_handle_error(edit, match):
    """Not a TypeError or a KeyError later (a 500 at the decode node)."""
    with pytest.raises(KVHandleError, match=match):
        KVHandle.from_dict({**make_handle().to_dict(), **edit})
