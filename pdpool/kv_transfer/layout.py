"""Block -> byte-range math for the KV cache, and the descriptors NIXL moves.

One KV tensor per node, block outermost (docs/architecture.md)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so block ``b`` is the single byte range ``[base + b * block_bytes, base + (b + 1) * block_bytes)``.
A transfer pairs local and remote block ids one to one; where both sides advance by one block at
the same step the pairs form a *run*, and a run of ``n`` blocks is one descriptor of ``n * block_bytes``::

    local  ids:  3  4  5 | 9 | 0  1
    remote ids: 10 11 12 | 2 | 7  8
                 run 1     r2   run 3     -> 3 descriptors for 6 blocks

Pure Python: no torch import, so the scheduler side can use it too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

# The one KV layout pdpool uses; part of the fingerprint a peer must match.
KV_LAYOUT = "blocks,layers,kv,block_size,kv_heads,head_dim"
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class KVRegion:
    """Where one rank's KV cache lives in its process: what a peer needs to address its blocks."""
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str = "DRAM"   # DRAM (host) or VRAM (GPU)
    device_id: int = 0       # GPU index for VRAM; 0 for DRAM
    rank: int = 0            # tensor-parallel rank (one rank today)

    def __post_init__(self) -> None:
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}, got {self.mem_type!r}")
        if self.base_addr <= 0 or self.num_blocks <= 0 or self.block_bytes <= 0:
            raise ValueError(f"invalid KV region: {self}")

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def block_addr(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self.num_blocks})")
        return self.base_addr + block_id * self.block_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVRegion":
        return cls(**{k: d[k] for k in ("base_addr", "num_blocks", "block_bytes", "mem_type", "device_id", "rank")
                      if k in d})


def block_bytes_of(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def region_of(kv_cache, rank: int = 0) -> KVRegion:
    """The region of a KV tensor in pdpool's layout (a torch.Tensor; duck-typed to keep torch out)."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(f"KV cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("KV cache must be contiguous: a block has to be one byte range")
    num_blocks = kv_cache.shape[0]
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    is_cuda = kv_cache.device.type == "cuda"
    return KVRegion(base_addr=kv_cache.data_ptr(), num_blocks=num_blocks, block_bytes=block_bytes,
                    mem_type="VRAM" if is_cuda else "DRAM",
                    device_id=(kv_cache.device.index or 0) if is_cuda else 0, rank=rank)


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair block ids into runs ``(local_start, remote_start, num_blocks)``, in order.

    A run grows while both the local and the remote id are one past the previous pair's.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local block ids but {len(remote_ids)} remote block ids")
    runs: list[tuple[int, int, int]] = []
    for lid, rid in zip(local_ids, remote_ids):
        if runs:
            l0, r0, n = runs[-1]
            if lid == l0 + n and rid == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((int(lid), int(rid), 1))
    return runs


def check_block_ids(region: KVRegion, block_ids: Sequence[int], side: str) -> None:
    bad = [b for b in block_ids if not 0 <= b < region.num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} outside [0, {region.num_blocks})")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"{side} block ids repeat: {list(block_ids)[:16]}")


def descriptors(local: KVRegion, remote: KVRegion, local_ids: Sequence[int],
                remote_ids: Sequence[int]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """NIXL descriptor lists ``[(addr, nbytes, device_id)]`` for the local and the remote side, one per run."""
    if local.block_bytes != remote.block_bytes:
        raise ValueError(f"block sizes differ: local {local.block_bytes} B, remote {remote.block_bytes} B")
    check_block_ids(local, local_ids, "local")
    check_block_ids(remote, remote_ids, "remote")
    local_descs, remote_descs = [], []
    for l0, r0, n in block_runs(local_ids, remote_ids):
        nbytes = n * local.block_bytes
        local_descs.append((local.block_addr(l0), nbytes, local.device_id))
        remote_descs.append((remote.block_addr(r0), nbytes, remote.device_id))
    return local_descs, remote_descs
