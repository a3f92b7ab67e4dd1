"""``AttentionMetadata``, the per-step slots dataclass, and the step context the attention layers read it from."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [R] int32, context length after the step (cached prefix + new tokens)
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes; -1 = padding
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, so backends plan without device syncs
    seq_lens_cpu: list[int]
    block_size: int
    plan: dict[str, Any] = field(default_factory=dict)  # per-step scratch a backend may fill on its first layer

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_ids: Sequence[Sequence[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """From host lists: request r computes its last ``query_lens[r]`` of ``seq_lens[r]`` context tokens,
        stored in blocks ``block_ids[r]`` (at least ceil(seq_lens[r] / block_size) of them)."""
        max_blocks = max(1, max(len(b) for b in block_ids))
        tables = [list(b) + [0] * (max_blocks - len(b)) for b in block_ids]
        slots: list[int] = []
        for n, length, blocks in zip(query_lens, seq_lens, block_ids):
            for p in range(length - n, length):
                slots.append(blocks[p // block_size] * block_size + p % block_size)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(query_start_loc=torch.tensor(starts, **i32), seq_lens=torch.tensor(list(seq_lens), **i32),
                   block_tables=torch.tensor(tables, **i32),
                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
                   seq_lens_cpu=list(seq_lens), block_size=block_size)


_CONTEXT = threading.local()  # per thread, so two runners in one process (tests, benchmarks) do not collide


def set_context(meta: AttentionMetadata | None) -> None:
    _CONTEXT.meta = meta


def get_context() -> AttentionMetadata:
    meta = getattr(_CONTEXT, "meta", None)
    if meta is None:
        raise RuntimeError("no attention context: the runner calls set_context(meta) before forward")
    return meta


def current_context() -> AttentionMetadata | None:
    """The step's metadata, or None outside a step (for backends that cache per-step plans in it)."""
    return getattr(_CONTEXT, "meta", None)


def reset_context() -> None:
    set_context(None)
