"""Paged attention: the per-step metadata, the step context, the backend interface and the backends.

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
nowhere) and ``forward`` (attend from the cache). ``get_backend(name)`` picks one, ``pick_backend`` resolves "auto":

    metadata.py        AttentionMetadata, set_context / get_context
    backend.py         the interface, the registry, "auto"
    torch_backend.py   "torch": gather by block table, then SDPA (the reference)
    cpu_backend.py     "cpu": torch, with decode rows in the native kernel (pdpool.kernels.cpu_decode)
    triton_backend.py  "triton": the paged Triton kernels (pdpool.kernels.decode_attention, prefill_attention)

Dependencies run one way: models -> attention -> kernels (the kernels know nothing of the engine or the models).
"""

from pdpool.attention.backend import AttentionBackend, get_backend, pick_backend
from pdpool.attention.metadata import AttentionMetadata, current_context, get_context, reset_context, set_context

__all__ = ["AttentionBackend", "AttentionMetadata", "current_context", "get_backend", "get_context", "pick_backend",
           "reset_context", "set_context"]
