"""What every kernel wrapper shares: interpreter detection, autotune config lists, layout asserts."""

from __future__ import annotations

import os

import torch
import triton


# The paged kernels' metadata arguments that change from one eager step to the next: the step's offsets into its
# one upload buffer (pointer alignment) and the block-table width (``stride_bt``, passed to do_not_specialize
# apart). Triton compiles a variant for each value's divisibility by 16 (and == 1), 0.6-0.9 s each inside a
# serving step (seen as stalls at steps 2 and 4 of the e2e run); their gathers and scalar loads gain nothing.
STEP_POINTERS = ["block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "rows_ptr"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(gpu: list[triton.Config], interpreter: triton.Config) -> list[triton.Config]:
    """The GPU autotune list, or one config under the interpreter: tuning there is meaningless, and small tiles
    make the tests' small shapes cross every loop and mask boundary. PDPOOL_KERNEL_AUTOTUNE=0 keeps the first GPU
    config only (the GPU tests use it, so they compile one config per shape key instead of tuning each)."""
    if interpreting():
        return [interpreter]
    return gpu[:1] if os.environ.get("PDPOOL_KERNEL_AUTOTUNE", "1") == "0" else gpu


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 ("ieee") for fp32 inputs, which would otherwise be rounded to tf32 (about
    1e-3 relative; enough to flip greedy near-ties against an fp32 reference); the native one for bf16/fp16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def assert_last_dim_contiguous(name: str, t: torch.Tensor, ndim: int) -> None:
    assert t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}"
    assert t.stride(-1) == 1, f"{name}: last dim must be contiguous, strides {t.stride()}"


def assert_paged_cache(name: str, cache: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """A per-layer view [num_blocks, block_size, Hkv, D] of the node tensor; tokens and heads may be strided."""
    assert_last_dim_contiguous(name, cache, 4)
    if like is not None:
        assert cache.shape == like.shape and cache.stride() == like.stride(), f"{name}: K and V views differ"
        assert cache.dtype == like.dtype and cache.device == like.device


def check_attention_args(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         rows: torch.Tensor) -> tuple[int, int, int, int]:
    """The paged attention wrappers' shared checks; returns (Hq, D, block_size, Hkv)."""
    assert_last_dim_contiguous("q", q, 3)
    assert_last_dim_contiguous("out", out, 3)
    assert_paged_cache("k_cache", k_cache)
    assert_paged_cache("v_cache", v_cache, like=k_cache)
    _, Hq, D = q.shape
    _, block_size, Hkv, Dc = k_cache.shape
    assert out.shape == q.shape and Dc == D and Hq % Hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert q.dtype == k_cache.dtype == out.dtype and D == triton.next_power_of_2(D) and D >= 16
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("rows", rows)):
        assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous() and t.device == q.device, name
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1
    assert seq_lens.numel() == block_tables.shape[0] == query_start_loc.numel() - 1
    return Hq, D, block_size, Hkv


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds with ``int()``,
    which NumPy >= 2.4 refuses for 1-d arrays; kernels whose loop bounds are loaded values (every paged kernel
    here) then fail under the interpreter only. Take the element explicitly instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "pdpool_fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch.pdpool_fixed = True
    interpreter._patch_lang_tensor = patch


if interpreting():
    _fix_interpreter_scalar_index()
