"""The decoder layer's elementwise ops on the CPU, in the native extension (``csrc/fused_ops_cpu.cpp``): RMSNorm
with the residual add, rotary on q and k in place, SiLU-and-mul; and the sampler's one pass (``csrc/sample_cpu.cpp``). The CPU counterparts of the Triton kernels in
``rmsnorm.py``, ``rotary.py`` and ``activation.py`` (same signatures where the op is the same), each one pass over
its rows instead of 3 to 6 torch kernels with a temporary between each. The wrappers check the layout; the module
is the one ``cpu_decode`` loads (``build.py`` compiles it ahead of serving).

    residual_out = round(x + residual)
    out = round(weight * round(residual_out * rsqrt(mean(residual_out^2) + eps)))   (HF's order and roundings)
    rotary: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin   (neox halves; cos, sin: [T, D/2] fp32, once per forward)
    silu_and_mul: out = round(silu(gate) * up)
    gumbel_argmax: id = argmax(logits / T + G), G = -log(-log U) (T > 0), argmax(logits) (T = 0)
"""

from __future__ import annotations

import functools

import torch

from pdpool.kernels import cpu_decode

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(name: str, t: torch.Tensor, dims: int, dtype: torch.dtype | None = None) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the CPU ops take CPU tensors")
    if t.dim() != dims or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name} must be {dims}-d with a contiguous last dim; got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}")
    if t.dtype not in DTYPES or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{name} has dtype {t.dtype}; expected {dtype or DTYPES}")


def _raise(error: str, op: str) -> None:
    if error:
        raise ValueError(f"{op} (cpu): {error}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] or [T, heads, H] (rows may be strided), weight: [H] -> out of x's shape; with ``residual`` (2-d x)
    -> (out, x + residual). ``out`` may be ``x``; ``residual_out`` may be ``residual``."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, H] or [T, heads, H]; got {tuple(x.shape)}")
    _check("x", x, x.dim())
    _check("weight", weight, 1, x.dtype)
    if weight.shape != x.shape[-1:] or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{x.shape[-1]}]; got {tuple(weight.shape)}")
    out = torch.empty_like(x) if out is None else out
    _check("out", out, x.dim(), x.dtype)
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} != x {tuple(x.shape)}")
    if residual is not None:
        if x.dim() != 2:
            raise ValueError("the residual add is for [T, H] hidden states")
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        for name, t in (("residual", residual), ("residual_out", residual_out)):
            _check(name, t, 2, x.dtype)
            if t.shape != x.shape:
                raise ValueError(f"{name} {tuple(t.shape)} != x {tuple(x.shape)}")
    _raise(cpu_decode.load().rms_norm(x, residual, weight, out, residual_out, float(eps)), "rms_norm")
    return out if residual is None else (out, residual_out)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int, inv_freq: [D/2] fp32 -> cos, sin: [T, D/2] fp32 (as HF computes the angles)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] (rows may be strided), rotated in place; cos, sin: [T, D/2] fp32."""
    _check("q", q, 3)
    _check("k", k, 3, q.dtype)
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or D % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: same tokens and even head dim")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(name, t, 2, torch.float32)
        if t.shape != (T, D // 2) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{T}, {D // 2}]; got {tuple(t.shape)}")
    _raise(cpu_decode.load().rotary(q, k, cos, sin), "rotary")
    return q, k


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] = gate | up (rows may be strided) -> out: [T, I]."""
    _check("x", x, 2)
    if x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I]; got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype) if out is None else out
    _check("out", out, 2, x.dtype)
    if out.shape != (x.shape[0], x.shape[1] // 2):
        raise ValueError(f"out must be [{x.shape[0]}, {x.shape[1] // 2}]; got {tuple(out.shape)}")
    _raise(cpu_decode.load().silu_and_mul(x, out), "silu_and_mul")
    return out


@functools.cache
def sampler_available() -> bool:
    """Whether ``gumbel_argmax`` can run (the extension loaded); asked once per process, by the sampler per step."""
    return cpu_decode.available()


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """logits: [R, V] (rows may be strided), temperature: [R] fp32 (0 = greedy) -> ids [R] int64: the CPU
    counterpart of ``kernels/sample.py``'s (one pass over the logits; the same distribution, another random stream:
    ``U`` is a hash of (seed, row * V + col), so a row's draw depends on the seed and its own row only)."""
    _check("logits", logits, 2)
    if temperature.shape != (logits.shape[0],) or temperature.dtype != torch.float32 or temperature.device.type != "cpu":
        raise ValueError(f"temperature must be a CPU float32 [{logits.shape[0]}]; got {tuple(temperature.shape)} "
                         f"{temperature.dtype} on {temperature.device}")
    if not logits.shape[1]:
        raise ValueError("logits have no columns")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _raise(cpu_decode.load().gumbel_argmax(logits, temperature.contiguous(), out, int(seed)), "gumbel_argmax")
    return out


def sample_uniforms(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """The uniforms ``gumbel_argmax`` draws for a [rows, vocab] batch under ``seed``: [rows, vocab] fp32 (the
    tests' reference)."""
    out = torch.empty(rows, vocab, dtype=torch.float32)
    _raise(cpu_decode.load().sample_uniforms(out, int(seed)), "sample_uniforms")
    return out
