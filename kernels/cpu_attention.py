"""The CPU attention backend: the torch backend with a native decode kernel (``csrc/paged_decode_cpu.cpp``).

The torch backend's decode gathers every decode row's blocks into one padded batch (a copy of the whole context
per layer, padded to the longest row), then SDPA reads it again. The native kernel reads K and V in place through
the block table, once, for each row's own length: on the offline benchmark (docs/performance.md) that was most of
the CPU decode time. Prefill and extend rows keep the torch path (SDPA over the gathered context).

The kernel is compiled on first use with the machine's C++ compiler (``torch.utils.cpp_extension``, cached under
``$PDPOOL_CACHE/torch_extensions``) for the host CPU (``-march=native``). ``available()`` says whether it built;
``auto`` falls back to the torch backend, with a warning, where it does not.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import sysconfig
import threading
from pathlib import Path

import torch

from pdpool.engine.attention import TorchAttentionBackend

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_lock = threading.Lock()
_module = None
_error: str | None = None


def _build_dir() -> Path:
    from pdpool.models.demo import cache_dir

    # Keyed by the machine, since -march=native code must not run on another CPU that shares the cache folder.
    where = cache_dir() / "torch_extensions" / f"{platform.machine()}-{platform.node() or 'host'}"
    where.mkdir(parents=True, exist_ok=True)
    return where


def load():
    """The compiled module (built once per process; cached on disk across processes). Raises on failure."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils.cpp_extension import load as load_extension

                _put_ninja_on_path()

                _module = load_extension(
                    name="pdpool_paged_decode_cpu", sources=[str(SOURCE)], build_directory=str(_build_dir()),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, no ninja, a compile error: reported by available()/the backend
                _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if _module is None:
            raise RuntimeError(f"the CPU decode kernel could not be built: {_error}")
        return _module


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the ``ninja`` dependency installs it beside this interpreter, whose folder is
    not on PATH when the venv is not activated (``.venv/bin/python -m ...``)."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


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


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        load()  # fail at construction, not at the first step

    def _decode(self, q, k_cache, v_cache, plan, scale, out) -> None:
        paged_decode(q, k_cache, v_cache, out, plan["decode_tokens"], plan["decode_tables"], plan["decode_lens"],
                     scale)
