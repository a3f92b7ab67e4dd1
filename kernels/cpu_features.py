"""What this CPU computes natively, read at run time, and the dtype the CPU engine should default to because of it.

bf16 pays on the CPU only where the cores multiply it natively (AVX512_BF16 dot products, AMX tiles): there oneDNN
runs bf16 GEMMs at up to twice (AVX512_BF16) or many times (AMX) the fp32 rate, and the weights and the KV cache
are half the bytes. Elsewhere torch converts every bf16 operand to fp32 and back, which is slower than fp32.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names (Linux x86)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86, arm64
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16() -> str | None:
    """The flag that makes bf16 native on this CPU (``amx_bf16``, ``avx512_bf16``), or None."""
    flags = cpu_flags()
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def default_cpu_dtype() -> tuple[str, str]:
    """(dtype name, the reason, for the startup log): bfloat16 where the CPU has native bf16, float32 elsewhere."""
    flag = native_bf16()
    if flag:
        return "bfloat16", f"the CPU has native bf16 ({flag})"
    return "float32", f"no native bf16 on this CPU ({platform.machine()}: no {' or '.join(NATIVE_BF16_FLAGS)})"
