"""Paged decode through the Triton backend's own entry point, as the engine calls it (write_kv, then forward).

Batch 64 x context 4096 and batch 1 x 32k; 32 q / 8 kv heads, D 128, bf16, block 16, shuffled block tables.
Checks the output against the fp32 reference, then reports GB/s (KV read + Q + O) against the device-to-device
copy bandwidth measured in the same run. Run: ``python benchmarks/bench_decode_kernel.py`` on a CUDA machine."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

from pdpool.attention import AttentionMetadata, get_backend
from pdpool.kernels import decode_attention
from pdpool.kernels.decode_attention import paged_decode
from pdpool.kernels.paged_ref import paged_attention_ref

HQ, HKV, D = 32, 8, 128
BLOCK = 16


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second."""
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16).repeat(2)  # 2 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def paged_cache(query_lens, seq_lens, hkv, d, dtype, layers=2, layer=1):
    """A node KV tensor with random contents and shuffled block tables; the prefix of every request (the context
    before its new tokens) already in layer ``layer``. Returns meta, k_cache, v_cache."""
    need = [-(-L // BLOCK) for L in seq_lens]
    num_blocks = sum(need) + 8
    kv = torch.randn(num_blocks, layers, 2, BLOCK, hkv, d, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks).tolist()
    block_ids, at = [], 0
    for n in need:
        block_ids.append(perm[at:at + n])
        at += n
    meta = AttentionMetadata.build(query_lens, seq_lens, block_ids, BLOCK, device="cuda")
    return meta, kv[:, layer, 0], kv[:, layer, 1]


def gpu_name() -> str:
    return torch.cuda.get_device_name()


def save(name: str, results: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1)


TOLERANCE = 1.5e-2


def tuning_table(kernel) -> list[tuple[str, float]]:
    """The autotuner's last measurements (ms per config, best first), for the notes in docs/performance.md."""
    timings = getattr(kernel, "configs_timings", None) or {}
    flat = {str(c): (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
    return sorted(flat.items(), key=lambda kv: kv[1])


def case(batch: int, context: int, copy_bw: float, sweep: bool) -> dict:
    dtype = torch.bfloat16
    meta, k_cache, v_cache = paged_cache([1] * batch, [context] * batch, HKV, D, dtype)
    backend = get_backend("triton")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, HKV, D, device="cuda", dtype=dtype)
    backend.write_kv(k_new, k_new.clone(), k_cache, v_cache, meta.slot_mapping)
    scale = D ** -0.5
    out = backend.forward(q, k_cache, v_cache, meta, scale)
    ref = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE and not out.isnan().any(), f"decode {batch}x{context}: rel err {err}"
    ms = bench_ms(lambda: backend.forward(q, k_cache, v_cache, meta, scale))
    isz = dtype.itemsize
    nbytes = batch * context * HKV * D * 2 * isz + 2 * q.numel() * isz
    gbs = nbytes / (ms * 1e-3) / 1e9
    plan = meta.plan["triton"]
    graph = torch.cuda.CUDAGraph()  # kernel time without host launch overhead (the engine runs eagerly today)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(q, k_cache, v_cache, meta, scale)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        backend.forward(q, k_cache, v_cache, meta, scale)
    graph_ms = bench_ms(graph.replay)
    row = dict(batch=batch, context=context, ms=ms, GBps=gbs, graph_ms=graph_ms,
               graph_GBps=nbytes / (graph_ms * 1e-3) / 1e9, frac_copy=gbs * 1e9 / copy_bw, rel_err=err,
               num_splits=plan.num_splits, config=str(decode_attention._decode_split_kernel.best_config),
               tuning=tuning_table(decode_attention._decode_split_kernel))
    if sweep:  # the split heuristic against its neighbours, same kernel config
        rows = plan.decode_rows
        o = torch.empty_like(q)
        for s in (1, 2, 4, 8, 16, 32, 64):
            t = bench_ms(lambda: paged_decode(q, k_cache, v_cache, o, meta.query_start_loc, meta.seq_lens,
                                              meta.block_tables, rows, scale, s))
            row[f"splits_{s}_GBps"] = nbytes / (t * 1e-3) / 1e9
    return row


def main() -> int:
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"GPU {gpu_name()}; device-to-device copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    results = {"gpu": gpu_name(), "copy_GBps": copy_bw / 1e9, "cases": []}
    shapes = ((64, 4096), (1, 32768))
    for batch, context in shapes:  # each tunes its own key (one split / several) on its own shape first
        results["cases"].append(case(batch, context, copy_bw, sweep=False))
    for (batch, context), row in zip(shapes, results["cases"]):
        row.update({k: v for k, v in case(batch, context, copy_bw, sweep=True).items() if k.startswith("splits_")})
        print(f"decode {batch:3d} x {context:6d}: {row['ms'] * 1e3:8.1f} us  {row['GBps']:7.0f} GB/s  "
              f"{100 * row['frac_copy']:5.1f}% of copy  (graph replay {row['graph_ms'] * 1e3:.1f} us "
              f"{100 * row['graph_GBps'] * 1e9 / copy_bw:.1f}%)  splits {row['num_splits']}  err {row['rel_err']:.1e}  "
              f"{row['config']}")
        print("   tuning (ms): " + "; ".join(f"{c.split(', num_ctas')[0]} {t:.4f}" for c, t in row["tuning"]))
        print("   split sweep GB/s: " + "  ".join(f"{k[7:-5]}:{v:.0f}" for k, v in row.items()
                                                 if k.startswith("splits_")))
    save("bench_decode", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
