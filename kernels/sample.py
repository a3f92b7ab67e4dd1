"""One pass over the logits for the common sampling case: temperature (or greedy), no top-k/top-p/min-p.

Random rows take the Gumbel-max draw, ``argmax(logits / T + G)`` with ``G = -log(-log U)``, which samples from
``softmax(logits / T)`` (the same distribution as the torch sampler's exponential race, another random stream);
greedy rows (temperature 0) take the argmax, first index on ties as ``torch.argmax``. ``U`` is a counter hash
of the element's offset ``row * V + col`` under a key made from one seed per call (murmur3's 32-bit finalizer, the
same uniforms as the CPU pass in ``kernels/csrc/sample_cpu.cpp``), so a row's draw depends on the seed and its own
row only. Philox (``tl.rand``, ten rounds of 32-bit multiplies per element) made the kernel bound by its integer
arithmetic: 0.17 ms of a 188-row Qwen3-0.6B step, for 57 MB of logits that take 0.02 ms to read. The torch
sampler does ~10 passes over ``[R, V]`` float32 for this case (divide, softmax, exponentials, clamp, divide,
argmax); this kernel reads the logits once and writes ``[R]`` ids.

Each row is split into ``splits`` column ranges, one program each (``choose_splits``: about four programs per
multiprocessor), and the last program of a row to finish combines the ranges' maxima. With one program per row a
batch of 190 rows was 1.4 waves on an H100 (0.19 ms of a Qwen3-0.6B step) and batch 1 ran on one SM. The ids do
not depend on the split: every element's score is the same, and the combine keeps the first maximum.

``gumbel_argmax_ref`` is the torch reference (same Philox-free formula on given uniforms)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdpool.kernels._launch import assert_last_dim_contiguous, interpreting


@triton.jit
def _fmix32(h):
    # murmur3's 32-bit finalizer on uint32 lanes (multiplies wrap): every input bit flips each output bit with
    # probability about 1/2
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _uniform(counter, k0, k1):
    # 23 hash bits + 1/2, times 2^-23: in [2^-24, 1 - 2^-24], exact in fp32 (a 1.0 would give G = +inf)
    h = _fmix32((_fmix32(counter ^ k0) ^ k1) * 0x9E3779B1)
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit(do_not_specialize=["key0", "key1", "chunk", "splits"])
def _gumbel_argmax_kernel(logits_ptr, stride_row, temp_ptr, out_ptr, part_val_ptr, part_idx_ptr, counts_ptr, key0,
                          key1, V, chunk, splits, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    noisy = temp > 0
    inv_t = tl.where(noisy, 1.0 / tl.where(noisy, temp, 1.0), 1.0)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    cols = tl.arange(0, BLOCK)
    k0 = key0.to(tl.uint32, bitcast=True)  # the keys come as int32 (two's complement of the uint32 keys)
    k1 = key1.to(tl.uint32, bitcast=True)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    for start in range(lo, hi, BLOCK):
        offs = start + cols
        mask = offs < hi
        x = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        u = _uniform((row * V + offs).to(tl.uint32), k0, k1)
        g = -tl.log(-tl.log(u))
        score = tl.where(noisy, x * inv_t + g, x)
        score = tl.where(mask, score, float("-inf"))
        better = score > best_val  # strict: each lane keeps its first maximum
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
    if splits == 1:
        tl.store(out_ptr + row, idx.to(tl.int64))
        return
    # Each column range's (max, first index of it) goes to the workspace; the last of the row's programs to
    # arrive takes the largest, the first index on ties (the ranges are in column order): the whole row's
    # first maximum, as one program finds it. Ordering as in decode_attention: barrier, then acq_rel count.
    tl.store(part_val_ptr + row * splits + s, top)
    tl.store(part_idx_ptr + row * splits + s, idx)
    tl.debug_barrier()
    arrived = tl.atomic_add(counts_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        sp = tl.arange(0, MAX_SPLITS)
        vals = tl.load(part_val_ptr + row * splits + sp, mask=sp < splits, other=float("-inf"),
                       cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + row * splits + sp, mask=sp < splits, other=0, cache_modifier=".cg")
        best = tl.max(vals, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where((vals == best) & (sp < splits), idxs, V), axis=0).to(tl.int64))
        tl.atomic_xchg(counts_ptr + row, 0, sem="relaxed", scope="gpu")  # zero for the next launch


MIN_CHUNK = 4096  # columns per program at least
MAX_SPLITS = 64  # one compiled kernel serves every split count up to this (a runtime argument)
_WORKSPACES: dict = {}


def choose_splits(rows: int, vocab: int, num_sms: int) -> int:
    """Programs per row (a power of two): about four programs per multiprocessor over the batch, each over at
    least MIN_CHUNK columns. One row of a 128k vocabulary used to be one program on one SM.
    ``PDPOOL_SAMPLER_SPLITS`` fixes it (1: one program per row, as before)."""
    fixed = os.environ.get("PDPOOL_SAMPLER_SPLITS")
    if fixed:
        return max(1, int(fixed))
    want = triton.next_power_of_2(triton.cdiv(4 * num_sms, max(1, rows)))
    cap = 1 << (max(1, vocab // MIN_CHUNK).bit_length() - 1)
    return min(want, cap, MAX_SPLITS)


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return _SMS[device]


def _workspace(rows: int, splits: int, device: torch.device) -> tuple:
    """(part_val [rows * splits] fp32, part_idx int32, counts [rows] int32 zero), kept per device and grown; every
    launch leaves the counts zero. Launches on one stream reuse it in order."""
    ws = _WORKSPACES.get(device)
    if ws is None or ws[0].numel() < rows * splits or ws[2].numel() < rows:
        n = max(rows * splits, 2 * (ws[0].numel() if ws else 0))
        m = max(rows, 2 * (ws[2].numel() if ws else 0))
        ws = (torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.int32, device=device),
              torch.zeros(m, dtype=torch.int32, device=device))
        _WORKSPACES[device] = ws
    return ws


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: int, splits: int | None = None) -> torch.Tensor:
    """logits: [R, V] (any float dtype, last dim contiguous); temperature: [R] float32 (0 = greedy) -> ids [R]
    int64. Queues one kernel; no host sync. ``splits``: programs per row (default ``choose_splits``); the ids do
    not depend on it."""
    assert_last_dim_contiguous("logits", logits, 2)
    R, V = logits.shape
    assert temperature.shape == (R,) and temperature.dtype == torch.float32
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    block = 256 if interpreting() else 2048
    if splits is None:
        splits = choose_splits(R, V, _num_sms(logits.device))
    assert 1 <= splits <= MAX_SPLITS, f"splits: 1 .. {MAX_SPLITS}"
    chunk = triton.cdiv(triton.cdiv(V, splits), block) * block
    part_val, part_idx, counts = _workspace(R, splits, logits.device)
    key0, key1 = _signed32(seed_keys(seed))
    _gumbel_argmax_kernel[(R, splits)](logits, logits.stride(0), temperature, out, part_val, part_idx, counts, key0,
                                       key1, V, chunk, splits, MAX_SPLITS=MAX_SPLITS, BLOCK=block,
                                       num_warps=1 if interpreting() else 8)
    return out


_MASK32 = 0xFFFFFFFF


def _fmix32_ref(h):
    """murmur3's 32-bit finalizer on Python ints or int64 tensors holding uint32 values."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def seed_keys(seed: int) -> tuple[int, int]:
    """The hash keys (uint32) of one call's seed, as the CPU pass makes them."""
    return (_fmix32_ref((seed & _MASK32) ^ 0x3C6EF372), _fmix32_ref(((seed >> 32) & _MASK32) ^ 0xA54FF53A))


def _signed32(keys: tuple[int, int]) -> tuple[int, int]:
    return tuple(k - (1 << 32) if k >= 1 << 31 else k for k in keys)


def hash_uniforms_ref(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """The uniforms the kernel draws for a [rows, vocab] batch under ``seed``: [rows, vocab] fp32 (int64 torch
    arithmetic, masked to 32 bits)."""
    k0, k1 = seed_keys(seed)
    counter = torch.arange(rows * vocab, dtype=torch.int64)
    h = _fmix32_ref((_fmix32_ref(counter ^ k0) ^ k1) * 0x9E3779B1 & _MASK32)
    return (((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)).view(rows, vocab)


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The same formula in torch on given uniforms [R, V]: argmax(logits / T - log(-log U)), argmax for T = 0."""
    x = logits.float()
    noisy = temperature > 0
    g = -torch.log(-torch.log(uniforms.clamp_min(1e-20)))
    score = torch.where(noisy[:, None], x / torch.where(noisy, temperature, 1.0)[:, None] + g, x)
    return score.argmax(dim=-1)
