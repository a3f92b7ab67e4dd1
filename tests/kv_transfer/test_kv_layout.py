"""Block -> byte-range math: runs, descriptors, and that they address exactly the tensor's blocks."""

from __future__ import annotations

import pytest
import torch

from pdpool.kv_transfer.layout import KVRegion, block_bytes_of, block_runs, descriptors, region_of


def test_block_runs_merge_only_where_both_sides_advance_together():
    #   local  3 4 5 | 9 | 0 1      remote 10 11 12 | 2 | 7 8
    assert block_runs([3, 4, 5, 9, 0, 1], [10, 11, 12, 2, 7, 8]) == [(3, 10, 3), (9, 2, 1), (0, 7, 2)]
    assert block_runs([0, 1, 2], [5, 7, 8]) == [(0, 5, 1), (1, 7, 2)]   # remote gap splits the run
    assert block_runs([2, 1, 0], [0, 1, 2]) == [(2, 0, 1), (1, 1, 1), (0, 2, 1)]  # descending never merges
    assert block_runs([], []) == []
    with pytest.raises(ValueError, match="2 local block ids but 1 remote"):
        block_runs([0, 1], [0])


def test_region_of_real_kv_tensor():
    kv = torch.zeros(10, 3, 2, 16, 2, 8)  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    region = region_of(kv)
    assert region.num_blocks == 10
    assert region.block_bytes == block_bytes_of(3, 16, 2, 8, 4) == 3 * 2 * 16 * 2 * 8 * 4
    assert region.base_addr == kv.data_ptr() and region.mem_type == "DRAM"
    for b in (0, 7, 9):
        assert region.block_addr(b) == kv[b].data_ptr()
    with pytest.raises(IndexError):
        region.block_addr(10)
    with pytest.raises(ValueError, match="contiguous"):
        region_of(kv.transpose(0, 1))
    with pytest.raises(ValueError, match="must be"):
        region_of(torch.zeros(10, 3, 16, 2, 8))
    assert KVRegion.from_dict(region.to_dict()) == region


def test_descriptors_cover_exactly_the_paired_blocks():
    local = KVRegion(base_addr=1 << 20, num_blocks=8, block_bytes=256)
    remote = KVRegion(base_addr=1 << 30, num_blocks=16, block_bytes=256)
    ld, rd = descriptors(local, remote, [0, 1, 2, 5], [4, 5, 6, 15])
    assert ld == [((1 << 20), 3 * 256, 0), ((1 << 20) + 5 * 256, 256, 0)]
    assert rd == [((1 << 30) + 4 * 256, 3 * 256, 0), ((1 << 30) + 15 * 256, 256, 0)]
    with pytest.raises(ValueError, match="remote block ids \\[16\\]"):
        descriptors(local, remote, [0], [16])
    with pytest.raises(ValueError, match="local block ids repeat"):
        descriptors(local, remote, [1, 1], [2, 3])
    with pytest.raises(ValueError, match="block sizes differ"):
        descriptors(local, KVRegion(base_addr=1, num_blocks=4, block_bytes=128), [0], [0])


def test_descriptors_move_the_right_bytes():
    """Apply the descriptors with plain memory copies: the result equals block-indexed assignment."""
    src = torch.randn(12, 2, 2, 4, 2, 8)
    dst = torch.zeros(6, 2, 2, 4, 2, 8)
    local_ids, remote_ids = [5, 0, 1, 2, 4], [9, 3, 4, 5, 0]
    ld, rd = descriptors(region_of(dst), region_of(src), local_ids, remote_ids)
    dst_bytes = dst.view(-1).view(torch.uint8)
    src_bytes = src.view(-1).view(torch.uint8)
    for (laddr, n, _), (raddr, n2, _) in zip(ld, rd):
        lo, ro = laddr - dst.data_ptr(), raddr - src.data_ptr()
        dst_bytes[lo:lo + n] = src_bytes[ro:ro + n2]
    expected = torch.zeros_like(dst)
    expected[local_ids] = src[remote_ids]
    assert torch.equal(dst, expected)


def test_agent_metadata_envelope():
    from pdpool.kv_transfer.agent import KVTransferError, pack_metadata, unpack_metadata

    region = KVRegion(base_addr=4096, num_blocks=3, block_bytes=64)
    data = pack_metadata("node#1", [region], b"\x00nixl\xff")
    assert unpack_metadata(data) == ("node#1", [region], b"\x00nixl\xff")
    with pytest.raises(KVTransferError, match="not pdpool KV agent metadata"):
        unpack_metadata(b"\x00nixl\xff")
    with pytest.raises(KVTransferError, match="version 9"):
        unpack_metadata(b"PDKV\x09" + data[5:])
