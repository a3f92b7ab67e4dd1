"""Paged prefill/extend through the Triton backend's own entry point, as the engine calls it.

8 x 2048 causal prefill, 32 q / 8 kv heads, D 128, bf16, block 16, shuffled block tables: TFLOP/s against
``scaled_dot_product_attention`` with the flash backend on the same shapes in the same run, and as a fraction of a
dense bf16 matmul measured in the same run; plus an extend step 8 x (1k cached + 1k new) read from the paged cache.
Run: ``python benchmarks/bench_prefill_kernel.py`` on a CUDA machine."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_decode_kernel import bench_ms, gpu_name, matmul_tflops, paged_cache, save, tuning_table
from pdpool.attention import get_backend
from pdpool.kernels import prefill_attention
from pdpool.kernels.paged_ref import paged_attention_ref

HQ, HKV, D = 32, 8, 128
TOLERANCE = 1.5e-2


def attention_flops(query_len: int, seq_len: int, batch: int) -> float:
    prefix = seq_len - query_len
    pairs = query_len * prefix + query_len * (query_len + 1) / 2  # (query, key) pairs under the causal mask
    return 4 * D * HQ * batch * pairs  # QK^T and PV, 2 flops per multiply-add each


def triton_case(batch: int, query_len: int, seq_len: int) -> dict:
    dtype = torch.bfloat16
    meta, k_cache, v_cache = paged_cache([query_len] * batch, [seq_len] * batch, HKV, D, dtype)
    T = batch * query_len
    q = torch.randn(T, HQ, D, device="cuda", dtype=dtype)
    k = torch.randn(T, HKV, D, device="cuda", dtype=dtype)
    v = torch.randn(T, HKV, D, device="cuda", dtype=dtype)
    backend = get_backend("triton")
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = D ** -0.5
    out = backend.forward(q, k_cache, v_cache, meta, scale)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE and not out.isnan().any(), f"prefill {batch}x{query_len}/{seq_len}: rel err {err}"
    del ref
    ms = bench_ms(lambda: backend.forward(q, k_cache, v_cache, meta, scale))
    write_ms = bench_ms(lambda: backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping))
    return dict(batch=batch, query_len=query_len, seq_len=seq_len, ms=ms, write_kv_ms=write_ms,
                tflops=attention_flops(query_len, seq_len, batch) / (ms * 1e-3) / 1e12, rel_err=err,
                config=str(prefill_attention._prefill_kernel.best_config),
                tuning=tuning_table(prefill_attention._prefill_kernel), q=q, k=k, v=v)


def sdpa_flash_tflops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, n: int) -> tuple[float, str]:
    qb = q.view(batch, n, HQ, D).transpose(1, 2)  # [B, Hq, N, D]
    kb = k.view(batch, n, HKV, D).transpose(1, 2)
    vb = v.view(batch, n, HKV, D).transpose(1, 2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
            ms, how = bench_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                                      enable_gqa=True)), "enable_gqa"
        except RuntimeError:  # flash without native GQA: K/V heads expanded outside the timed region
            kx, vx = kb.repeat_interleave(HQ // HKV, 1), vb.repeat_interleave(HQ // HKV, 1)
            ms, how = bench_ms(lambda: F.scaled_dot_product_attention(qb, kx, vx, is_causal=True)), "expanded kv"
    return attention_flops(n, n, batch) / (ms * 1e-3) / 1e12, how


def main() -> int:
    torch.manual_seed(0)
    mm = matmul_tflops()
    print(f"GPU {gpu_name()}; dense bf16 matmul 8192^3 {mm:.0f} TFLOP/s")
    results = {"gpu": gpu_name(), "matmul_tflops": mm, "cases": []}
    prefill = triton_case(8, 2048, 2048)
    sdpa, how = sdpa_flash_tflops(prefill.pop("q"), prefill.pop("k"), prefill.pop("v"), 8, 2048)
    prefill.update(sdpa_flash_tflops=sdpa, sdpa_gqa=how, vs_sdpa=prefill["tflops"] / sdpa,
                   frac_matmul=prefill["tflops"] / mm)
    extend = triton_case(8, 1024, 2048)
    for key in ("q", "k", "v"):
        extend.pop(key)
    extend.update(frac_matmul=extend["tflops"] / mm)
    results["cases"] = [prefill, extend]
    print(f"prefill 8 x 2048 causal: {prefill['ms']:.3f} ms  {prefill['tflops']:.0f} TFLOP/s  "
          f"SDPA flash ({how}) {sdpa:.0f} TFLOP/s  -> {prefill['vs_sdpa']:.2f}x SDPA, "
          f"{100 * prefill['frac_matmul']:.0f}% of matmul  err {prefill['rel_err']:.1e}  write_kv "
          f"{prefill['write_kv_ms'] * 1e3:.0f} us  {prefill['config']}")
    print(f"extend 8 x (1024 cached + 1024 new): {extend['ms']:.3f} ms  {extend['tflops']:.0f} TFLOP/s  "
          f"{100 * extend['frac_matmul']:.0f}% of matmul  err {extend['rel_err']:.1e}  {extend['config']}")
    print("   tuning on 8 x 2048 (ms): " + "; ".join(f"{c.split(', num_ctas')[0]} {t:.3f}"
                                                       for c, t in prefill["tuning"]))
    save("bench_prefill", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
