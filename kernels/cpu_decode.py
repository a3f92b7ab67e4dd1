"""The native CPU paged decode kernel (``csrc/paged_decode_cpu.cpp``): ``paged_decode`` checks the layout and calls it;
``store_kv`` writes a step's K and V rows into the paged cache. ``load()`` also serves ``cpu_ops`` (the same module).

The torch attention backend gathers every decode row's blocks into one padded batch (a copy of the whole context per
layer, padded to the longest row), then SDPA reads it again. This kernel reads K and V in place through the block
table, once, for each row's own length, in one pass per block with an online softmax: on the offline benchmark
(docs/performance.md) that was most of the CPU decode time. The ``cpu`` attention backend
(``pdpool.attention.cpu_backend``) sends its decode rows here.

It is compiled for the host CPU (``-march=native``) ahead of serving by ``pdpool build-kernels`` (``make install``
runs it), or at the first use where that did not happen; see ``build.py``. ``available()`` says whether it loaded.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from pdpool.kernels import build

log = logging.getLogger(__name__)

_lock = threading.Lock()
_module = None
_error: str | None = None


def load():
    """The compiled module (loaded once per process; built once per install). Raises RuntimeError on failure."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                _module = build.load()
            except Exception as e:  # a build error, a wait past its bound, an unreadable folder, a bad library
                _error = f"{type(e).__name__}: {e}"
        if _module is None:
            raise RuntimeError(f"the CPU decode kernel is unavailable: {_error}")
        return _module


def available() -> bool:
    if os.environ.get("PDPOOL_CPU_KERNELS", "1") == "0":
        return False
    try:
        load()
        return True
    except RuntimeError as e:
        log.warning("%s", e)
        return False


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 tokens: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float) -> None:
    """out[tokens[r]] = attention of q[tokens[r]] over the first lens[r] tokens in blocks tables[r] (in place).

    q, out: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D] strided views, last dim contiguous; tokens, lens:
    [R] int64; tables: [R, W] int64 (every length must fit its table: checked by the kernel)."""
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out, tokens=tokens, tables=tables, lens=lens)
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the CPU decode kernel takes CPU tensors")
    if q.dim() != 3 or out.shape != q.shape or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q/out [T, Hq, D], caches [num_blocks, block_size, Hkv, D]; got q {tuple(q.shape)}, out "
                         f"{tuple(out.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (head dim, GQA group)")
    if any(t.stride(-1) != 1 for t in (q, out, k_cache, v_cache)):
        raise ValueError("q, out and the caches need a contiguous last dim")
    if len({q.dtype, out.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"one dtype for q, out and caches; got {q.dtype}, {out.dtype}, {k_cache.dtype}")
    for name in ("tokens", "tables", "lens"):
        t = tensors[name]
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64, got {t.dtype}")
    if tables.dim() != 2 or tokens.shape != (tables.shape[0],) or lens.shape != tokens.shape:
        raise ValueError(f"tables [R, W], tokens and lens [R]; got {tuple(tables.shape)}, {tuple(tokens.shape)}, "
                         f"{tuple(lens.shape)}")
    error = load().paged_decode(q, k_cache, v_cache, out, tokens, tables, lens, float(scale))
    if error:
        raise ValueError(f"paged_decode (cpu): {error}")



def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot // block_size, slot % block_size] = k[t] (and v) for every slot >= 0 (-1: padding, skipped).

    k, v: [T, Hkv, D] (rows may be strided); caches: [num_blocks, block_size, Hkv, D] strided views, last dim
    contiguous; slot_mapping: [T] int64 (each slot must be inside the cache: checked by the kernel)."""
    for name, t in dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping).items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the CPU KV store takes CPU tensors")
    if k.dim() != 3 or v.shape != k.shape or k_cache.dim() != 4 or v_cache.shape != k_cache.shape \
            or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k/v [T, Hkv, D], caches [num_blocks, block_size, Hkv, D]; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("k, v and the caches need a contiguous last dim")
    if len({k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"one dtype for k, v and caches; got {k.dtype}, {v.dtype}, {k_cache.dtype}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must be contiguous int64 [{k.shape[0]}]; got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    error = load().store_kv(k, v, k_cache, v_cache, slot_mapping)
    if error:
        raise ValueError(f"store_kv (cpu): {error}")
