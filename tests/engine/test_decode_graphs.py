"""Decode CUDA graphs (``pdpool.engine.cuda_graphs``): what a replay reads, and the bucket's padding rows, after
batches of other sizes (the runner resets only the rows an earlier, larger batch wrote).

The static buffers are filled by the same code on any device, so the padding is checked on the CPU too; with a GPU
the graphs are captured and each replay's output is checked against what it should have read."""

from __future__ import annotations

import torch

from pdpool.attention import AttentionMetadata
from pdpool.engine.cuda_graphs import DecodeGraphs

ON_GPU = torch.cuda.is_available()


class Echo(torch.nn.Module):
    """hidden [T, 2]: each row's input id and position, so the graph's output shows what it read."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.stack([ids, positions], dim=1).float()


def test_padding_rows_hold_padding_after_any_earlier_batch():
    dev = torch.device("cuda" if ON_GPU else "cpu")
    graphs = DecodeGraphs(Echo(), max_num_seqs=32, max_model_len=64, block_size=16, device=dev)
    if ON_GPU:
        graphs.capture()
    for n in (20, 5, 18, 3, 3, 32, 1, 9, 17, 16):
        ids = torch.arange(100, 100 + n, device=dev)
        positions = torch.arange(n, device=dev) + 7
        meta = AttentionMetadata.build([1] * n, [8] * n, [[i] for i in range(n)], 16, dev)
        if ON_GPU:
            out = graphs.run(ids, positions, meta)
            assert out.tolist() == torch.stack([ids, positions], dim=1).float().tolist()
            b = next(size for size in graphs.buckets if size >= n)
        else:
            b = graphs.stage(ids, positions, meta)
        assert b == next(size for size in graphs.buckets if size >= n)
        assert graphs.input_ids[:n].tolist() == ids.tolist()
        assert graphs.positions[:n].tolist() == positions.tolist()
        assert graphs.slot_mapping[:n].tolist() == [16 * i + 7 for i in range(n)]
        assert graphs.seq_lens[:n].tolist() == [8] * n
        assert graphs.block_tables[:n, 0].tolist() == list(range(n))
        assert (graphs.slot_mapping[n:b] == -1).all() and (graphs.seq_lens[n:b] == 1).all()
