"""The "torch" attention backend: each request's context gathered from the paged cache by block table, then SDPA.
The reference the other backends are tested against, and the fallback where they are unavailable."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pdpool.attention.backend import AttentionBackend
from pdpool.attention.metadata import AttentionMetadata, current_context


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: gathers each request's context from the paged cache by block table, then SDPA.
    Decode rows (query_len 1) go in one padded batch; longer queries one request at a time."""

    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        # The (block, offset) split and the padding filter are the same for every layer: done once per step.
        ctx = current_context()
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
