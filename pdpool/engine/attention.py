"""Paged attention: the per-step metadata, the step context, the backend interface, and the torch backend.

The runner builds one ``AttentionMetadata`` per step and calls ``set_context(meta)``; every attention layer reads
it with ``get_context()`` (nano-vllm's ``Context``), so model ``forward`` signatures never carry it.

Tokens of a step are packed request after request (T tokens, R requests). Request r owns tokens
``query_start_loc[r] : query_start_loc[r+1]`` and after the step its context holds ``seq_lens[r]`` tokens,
the new ones last::

    request r's context:  | cached prefix (seq_len - query_len) | new tokens (query_len) |
    new token i sits at position seq_len - query_len + i and attends to context positions 0 .. that position

Prefill (no prefix), extend (cached prefix), decode (query_len 1) and mixed steps are one path.

Caches are the per-layer strided views of the node's KV tensor (see docs/architecture.md)::

    k_cache = kv_cache[:, layer, 0]   # [num_blocks, block_size, Hkv, D]
    slot = block_id * block_size + offset; context position p of request r lives in block
    block_tables[r, p // block_size] at offset p % block_size

A backend implements two calls: ``write_kv`` (store the step's new K/V at ``slot_mapping``, -1 = padding, written
nowhere) and ``forward`` (attend from the cache). ``get_backend(name)`` picks one: "torch" here, "cpu" (this one
with a native decode kernel, ``pdpool.kernels.cpu_attention``) and "triton" (``pdpool.kernels.attention``).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F


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


def reset_context() -> None:
    set_context(None)


class AttentionBackend:
    """The interface every attention implementation provides."""

    name = "base"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] (strided views); slot_mapping: [T]."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D]; causal per request over its cached context; Hq % Hkv == 0 (GQA)."""
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: gathers each request's context from the paged cache by block table, then SDPA.
    Decode rows (query_len 1) go in one padded batch; longer queries one request at a time."""

    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        # The (block, offset) split and the padding filter are the same for every layer: done once per step.
        ctx = getattr(_CONTEXT, "meta", None)
        cached = ctx.plan.get("torch_write") if ctx is not None and ctx.slot_mapping is slot_mapping else None
        if cached is None:
            cached = _write_plan(slot_mapping, k_cache.shape[1])
            if ctx is not None and ctx.slot_mapping is slot_mapping:
                ctx.plan["torch_write"] = cached
        keep, blocks, offsets = cached  # keep: None when no token is padding
        if keep is not None:
            k, v = k[keep], v[keep]
        k_cache.index_put_((blocks, offsets), k)  # on the strided view: writes into the node's tensor
        v_cache.index_put_((blocks, offsets), v)

    def forward(self, q, k_cache, v_cache, meta, scale):
        plan = meta.plan.get("torch") or meta.plan.setdefault("torch", _plan(meta, q.device))
        out = torch.empty_like(q)  # [T, Hq, D]
        if plan["decode_tokens"] is not None:
            self._decode(q, k_cache, v_cache, plan, scale, out)
        for start, end, blocks, length, mask in plan["prefills"]:
            context = (-1, k_cache.shape[2], k_cache.shape[3])
            k = k_cache.index_select(0, blocks).view(context)[:length].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            v = v_cache.index_select(0, blocks).view(context)[:length].transpose(0, 1).unsqueeze(0)
            qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, plan, scale, out) -> None:
        """The decode rows (query_len 1) into ``out``, in one padded batch."""
        # Whole blocks at once: one contiguous [block_size, Hkv, D] copy per block, not one per token.
        tables = plan["decode_tables"]  # [Rd, nb]
        rd, nb = tables.shape
        context = (rd, nb * k_cache.shape[1], k_cache.shape[2], k_cache.shape[3])
        k = k_cache.index_select(0, tables.flatten()).view(context).transpose(1, 2)  # [Rd, Hkv, S, D]
        v = v_cache.index_select(0, tables.flatten()).view(context).transpose(1, 2)
        qd = q[plan["decode_tokens"]].unsqueeze(2)  # [Rd, Hq, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan["decode_mask"], scale=scale,
                                           enable_gqa=True)  # [Rd, Hq, 1, D]
        out[plan["decode_tokens"]] = o.squeeze(2)


def _plan(meta: AttentionMetadata, device: torch.device) -> dict[str, Any]:
    """Gather indices and masks for the torch backend, computed once per step (on its first layer)."""
    bs = meta.block_size
    tables = meta.block_tables.to(device=device, dtype=torch.long)  # [R, max_blocks]
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    decode_rows = [r for r, n in enumerate(meta.query_lens_cpu) if n == 1]
    plan: dict[str, Any] = {"decode_tokens": None, "prefills": []}
    if decode_rows:
        rows = torch.tensor(decode_rows, device=device)
        max_len = max(meta.seq_lens_cpu[r] for r in decode_rows)
        num_blocks = -(-max_len // bs)
        pos = torch.arange(num_blocks * bs, device=device)  # [S], whole blocks
        plan["decode_tables"] = tables[rows, :num_blocks].contiguous()  # [Rd, nb]
        plan["decode_tokens"] = torch.tensor([starts[r] for r in decode_rows], device=device)
        lens = torch.tensor([meta.seq_lens_cpu[r] for r in decode_rows], device=device)
        plan["decode_mask"] = (pos[None, :] < lens[:, None])[:, None, None, :]  # [Rd, 1, 1, S]
        plan["decode_lens"] = lens
    for r, n in enumerate(meta.query_lens_cpu):
        if n == 1:
            continue
        length = meta.seq_lens_cpu[r]
        pos = torch.arange(length, device=device)  # [L]
        mask = None  # plain causal when the whole context is new
        if length != n:
            q_pos = torch.arange(length - n, length, device=device)  # [n]
            mask = pos[None, :] <= q_pos[:, None]  # [n, L]
        plan["prefills"].append((starts[r], starts[r] + n, tables[r, :-(-length // bs)], length, mask))
    return plan


def _write_plan(slot_mapping: torch.Tensor, block_size: int):
    """(keep or None, block ids, offsets) of the non-padding slots."""
    keep = None
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping = slot_mapping[keep]
    return keep, slot_mapping // block_size, slot_mapping % block_size


BACKENDS = {
    "torch": "pdpool.engine.attention:TorchAttentionBackend",
    "cpu": "pdpool.kernels.cpu_attention:CpuAttentionBackend",
    "triton": "pdpool.kernels.attention:TritonAttentionBackend",
}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
