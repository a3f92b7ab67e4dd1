"""Paged decode kernel: this checkout's against an older one (``--old``), on the engine's shapes, in one process.

Cases (bf16, D 128, block 16, shuffled block tables, random K/V):

    b64x4096          64 rows x 4096 tokens, 32 q / 8 kv heads (the kernel section's large case)
    b1x32k            1 row x 32768 tokens, 32 / 8
    qwen-step300      the e2e workload's decode batch at step 300 (gpu_e2e.workload: prompt + 300 tokens of each
                      request still running, about 190 rows of 400-1300 tokens), 16 / 8 (Qwen3-0.6B)
    llama-step300     the same rows, 32 / 8 (Llama-3.1-8B)
    b1x512-32layers   single stream: 1 row x 512 tokens, one launch per layer of a 32-layer KV tensor in one graph
                      (67 MB of K/V per replay, more than the 50 MB L2), so per-launch gaps count as in the engine

Each code runs as its backend calls it: split count ``choose_num_splits(rows, 8, SMs)``, its own
``MIN_SPLIT_TOKENS``, its workspace made once; the new code with its rows longest first (``new``) and in batch
order (``new-unsorted``). Every output is checked against the fp32 reference (rel. error < 1.5e-2), ``new`` and
``new-unsorted`` must be bit-identical, and so must a graph replay and an eager launch. Times are medians of
``triton.testing.do_bench`` over CUDA-graph replays (kernel time without host launch overhead); GB/s counts the
K/V of every context token once, plus Q and O, against the device-to-device copy measured in the same run.

``--skinny`` times the decode-sized GEMMs (16-256 rows; ``pdpool.kernels.skinny_gemm``): every config its
autotuner would try against cuBLAS, per shape of the two e2e models and row count, one CUDA graph of a layer stack.

``--gemv`` times the batch-1 projections instead: the one-row GEMV kernel (``pdpool.kernels.gemv``) against
cuBLAS (``F.linear``; for ``down`` with SiLU folded in, against ``silu_and_mul`` + ``F.linear``) on the Llama-3.1-8B
and Qwen3-0.6B shapes, one CUDA graph of a layer stack's worth of calls on distinct weights (more than the L2), and
the fused q/k norm + rotary + KV store kernel against the separate kernels (1 and 192 tokens).

    python3 benchmarks/bench_decode_kernel.py [--old .bench_base/kernels/decode_attention.py] [--cases ...]
    python3 benchmarks/bench_decode_kernel.py --gemv
    python3 benchmarks/bench_decode_kernel.py --skinny [--skinny-rows 64,208] [--skinny-cases llama8b:gate_up]
    TRITON_INTERPRET=1 python3 benchmarks/bench_decode_kernel.py --device cpu --old ...  # CPU smoke test: small
        contexts, fp32, the checks only (no graphs, no timing that means anything)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402

from pdpool.attention import AttentionMetadata  # noqa: E402
from pdpool.attention.triton_backend import longest_first  # noqa: E402
from pdpool.kernels import decode_attention  # noqa: E402
from pdpool.kernels.paged_ref import paged_attention_ref  # noqa: E402

D = 128
BLOCK = 16
TOLERANCE = 1.5e-2


DEVICE = "cuda"
DTYPE = torch.bfloat16


def bench_ms(fn) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    if DEVICE != "cuda":
        return 50e9
    """Device-to-device copy of 2 GiB, bytes read + written per second."""
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16).repeat(2)  # 2 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def step300_contexts() -> list[int]:
    """Context lengths of the e2e workload's requests still decoding at step 300."""
    from gpu_e2e import workload

    return [len(p) + 300 for p, o in workload() if o > 300]


CASES = {  # name: (context lengths, Hq, Hkv, layers launched per replay)
    "b64x4096": (lambda: [4096] * 64, 32, 8, 1),
    "b1x32k": (lambda: [32768], 32, 8, 1),
    "qwen-step300": (step300_contexts, 16, 8, 1),
    "llama-step300": (step300_contexts, 32, 8, 1),
    "b1x512-32layers": (lambda: [512], 32, 8, 32),
}


def paged_layers(seq_lens, hkv, layers):
    """A node KV tensor [blocks, layers, 2, BLOCK, Hkv, D] of random K/V and shuffled block tables; returns meta and
    the per-layer (k_cache, v_cache) views."""
    need = [-(-L // BLOCK) for L in seq_lens]
    num_blocks = sum(need) + 8
    kv = torch.randn(num_blocks, layers, 2, BLOCK, hkv, D, device=DEVICE, dtype=DTYPE)
    perm = torch.randperm(num_blocks).tolist()
    block_ids, at = [], 0
    for n in need:
        block_ids.append(perm[at:at + n])
        at += n
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, block_ids, BLOCK, device=DEVICE)
    return meta, [(kv[:, layer, 0], kv[:, layer, 1]) for layer in range(layers)]


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("decode_attention_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launcher(module, q, caches, outs, meta, rows, num_splits):
    """All layers' launches as the backend makes them: one workspace, the module's own minimum split length."""
    Rd, Hq = rows.numel(), q.shape[1]
    hkv = caches[0][0].shape[2]
    try:
        ws = module.decode_workspace(Rd, Hq, hkv, D, num_splits, q.device)
    except TypeError:  # before the folded reduce: (rows, heads, head_dim, splits, device)
        ws = module.decode_workspace(Rd, Hq, D, num_splits, q.device)

    def run():
        for (k, v), out in zip(caches, outs):
            module.paged_decode(q, k, v, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, rows,
                                D ** -0.5, num_splits, ws, module.MIN_SPLIT_TOKENS)
    return run


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def captured(run):
    """``run`` captured in a CUDA graph (its replay), or ``run`` itself off the GPU."""
    if DEVICE != "cuda":
        return run
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def run_case(name: str, codes: dict, copy_bw: float, sms: int) -> dict:
    lens_fn, hq, hkv, layers = CASES[name]
    torch.manual_seed(0)
    seq_lens = lens_fn()
    if DEVICE != "cuda":  # the interpreter: a few short rows, two layers
        seq_lens, layers = [max(1, n // 64) for n in seq_lens[:6]], min(layers, 2)
    meta, caches = paged_layers(seq_lens, hkv, layers)
    q = torch.randn(len(seq_lens), hq, D, device=DEVICE, dtype=DTYPE)
    num_splits = decode_attention.choose_num_splits(len(seq_lens), hkv, sms)
    ref = paged_attention_ref(q, *caches[-1], meta.query_start_loc, meta.seq_lens, meta.block_tables, D ** -0.5)
    nbytes = layers * (sum(seq_lens) * hkv * D * 2 * 2 + 2 * q.numel() * 2)
    batch_order = list(range(len(seq_lens)))
    row = dict(case=name, rows=len(seq_lens), mean_context=sum(seq_lens) / len(seq_lens), hq=hq, hkv=hkv,
               layers=layers, num_splits=num_splits, MB=nbytes / 1e6, codes={})
    results = {}
    for code, (module, order) in codes.items():
        rows = torch.tensor(longest_first(batch_order, seq_lens) if order == "longest" else batch_order,
                            dtype=torch.int32, device=DEVICE)
        outs = [torch.full_like(q, float("nan")) for _ in caches]
        run = launcher(module, q, caches, outs, meta, rows, num_splits)
        run()  # compiles (and tunes, unless PDPOOL_KERNEL_AUTOTUNE=0)
        sync()
        eager = outs[-1].clone()
        err = ((eager.float() - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE and not eager.isnan().any(), f"{name} {code}: rel err {err}"
        replay = captured(run)
        for out in outs:
            out.fill_(float("nan"))
        replay()
        sync()
        assert torch.equal(outs[-1], eager), f"{name} {code}: graph replay differs from the eager launch"
        ms = bench_ms(replay)
        results[code] = outs[-1].clone()
        row["codes"][code] = dict(us=ms * 1e3, us_per_layer=ms * 1e3 / layers, GBps=nbytes / (ms * 1e-3) / 1e9,
                                  frac_copy=nbytes / (ms * 1e-3) / copy_bw, rel_err=err)
        del replay
    if "new" in results and "new-unsorted" in results:
        assert torch.equal(results["new"], results["new-unsorted"]), f"{name}: row order changed a result"
    return row


# (model, projection, N, K, silu_x, layers): the batch-1 GEMVs of one decode step
GEMV_CASES = [("llama8b", "qkv", 6144, 4096, False, 32), ("llama8b", "o", 4096, 4096, False, 32),
              ("llama8b", "gate_up", 28672, 4096, False, 32), ("llama8b", "down+silu", 4096, 14336, True, 32),
              ("llama8b", "lm_head", 128256, 4096, False, 1), ("qwen0.6b", "qkv", 4096, 1024, False, 28),
              ("qwen0.6b", "o", 1024, 2048, False, 28), ("qwen0.6b", "gate_up", 6144, 1024, False, 28),
              ("qwen0.6b", "down+silu", 1024, 3072, True, 28)]


def run_gemv(copy_bw: float) -> dict:
    """The GEMV kernel against cuBLAS per projection shape at one row, and the fused qkv epilogue kernel."""
    import torch.nn.functional as F

    from pdpool.kernels.activation import silu_and_mul
    from pdpool.kernels.fused_qkv import rotary_store_kv
    from pdpool.kernels.gemv import gemv, gemv_ref
    from pdpool.kernels.rmsnorm import rms_norm
    from pdpool.kernels.rotary import apply_rotary
    from pdpool.kernels.store_kvcache import store_kvcache

    rows = []
    small = DEVICE != "cuda"  # CPU smoke test: the shapes / 64, two layers, checks only
    for model, proj, N, K, silu, layers in GEMV_CASES:
        if small:
            N, K, layers = N // 64, K // 64, 2
        ws = [torch.randn(N, K, device=DEVICE, dtype=DTYPE) / K ** 0.5 for _ in range(layers)]
        x = torch.randn(1, 2 * K if silu else K, device=DEVICE, dtype=DTYPE)
        ref = gemv_ref(x, ws[0], silu_x=silu)
        err = ((gemv(x, ws[0], silu_x=silu).float() - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE, f"{model} {proj}: gemv error {err:.2e}"
        outs = [torch.empty(1, N, device=DEVICE, dtype=DTYPE) for _ in range(layers)]

        def ours():
            for w, o in zip(ws, outs):
                gemv(x, w, silu_x=silu, out=o)

        def cublas():
            for w in ws:
                F.linear(silu_and_mul(x) if silu else x, w)

        ours()  # autotune outside the capture
        sync()
        us = {name: 1e3 * bench_ms(captured(fn)) / layers for name, fn in (("cublas", cublas), ("gemv", ours))}
        mb = N * K * 2 / 1e6
        row = dict(model=model, proj=proj, N=N, K=K, silu=silu, MB=mb, rel_err=err,
                   **{f"{k}_us": v for k, v in us.items()},
                   **{f"{k}_frac_copy": mb * 1e6 / (v * 1e-6) / copy_bw for k, v in us.items()})
        cfg = getattr(__import__("pdpool.kernels.gemv", fromlist=["_gemv_kernel"])._gemv_kernel, "best_config", None)
        row["gemv_config"] = str(cfg)
        rows.append(row)
        print(f"gemv {model:9s} {proj:10s} {N:6d}x{K:5d} {mb:7.1f} MB | cuBLAS {us['cublas']:7.2f} us "
              f"({100 * row['cublas_frac_copy']:5.1f}%)  gemv {us['gemv']:7.2f} us ({100 * row['gemv_frac_copy']:5.1f}%)"
              f"  err {err:.1e}  {cfg}", flush=True)
        del ws, outs
    qkv_rows = []
    for model, hq, hkv, layers, norm in (("llama8b", 32, 8, 32, False), ("qwen0.6b", 16, 8, 28, True)):
        for T in ((1, 16) if small else (1, 192)):
            d = 32 if small else 128
            layers = 2 if small else layers
            qkvs = [torch.randn(T, (hq + 2 * hkv) * d, device=DEVICE, dtype=DTYPE) for _ in range(layers)]
            pos = torch.randint(0, 1000, (T,), device=DEVICE)
            inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
            wq, wk = (torch.ones(d, device=DEVICE, dtype=DTYPE) for _ in range(2))
            cache = torch.zeros(T // 16 + 2, layers, 2, BLOCK, hkv, d, device=DEVICE, dtype=DTYPE)
            slots = torch.randperm((T // 16 + 2) * BLOCK, device=DEVICE)[:T]

            def split(t):
                return (t[:, :hq * d].view(T, hq, d), t[:, hq * d:(hq + hkv) * d].view(T, hkv, d),
                        t[:, (hq + hkv) * d:].view(T, hkv, d))

            def separate():
                for i, t in enumerate(qkvs):
                    q, k, v = split(t)
                    if norm:
                        q, k = rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6)
                    apply_rotary(q, k, pos, inv, q_out=q, k_out=k)
                    store_kvcache(k, v, cache[:, i, 0], cache[:, i, 1], slots)

            def fused():
                for i, t in enumerate(qkvs):
                    q, k, v = split(t)
                    rotary_store_kv(q, k, v, pos, inv, cache[:, i, 0], cache[:, i, 1], slots,
                                    *((wq, wk) if norm else (None, None)))

            separate()
            fused()
            sync()
            us = {name: 1e3 * bench_ms(captured(fn)) / layers for name, fn in (("separate", separate),
                                                                                 ("fused", fused))}
            qkv_rows.append(dict(model=model, tokens=T, norm=norm, **{f"{k}_us": v for k, v in us.items()}))
            print(f"qkv epilogue {model:9s} T {T:3d} ({'norm+' if norm else ''}rotary+store): separate "
                  f"{us['separate']:6.2f} us/layer, fused {us['fused']:6.2f} us/layer", flush=True)
    return dict(gemv=rows, qkv_epilogue=qkv_rows)


# (model, projection, N, K, layers in the stack): the decode GEMMs of gpu_e2e's models
SKINNY_CASES = [("llama8b", "qkv", 6144, 4096, 32), ("llama8b", "o", 4096, 4096, 32),
                ("llama8b", "gate_up", 28672, 4096, 32), ("llama8b", "down", 4096, 14336, 32),
                ("llama8b", "lm_head", 128256, 4096, 2),
                ("qwen0.6b", "qkv", 4096, 1024, 28), ("qwen0.6b", "o", 1024, 2048, 28),
                ("qwen0.6b", "gate_up", 6144, 1024, 28), ("qwen0.6b", "down", 1024, 3072, 28),
                ("qwen0.6b", "lm_head", 151936, 1024, 2)]
SKINNY_ROWS = [16, 64, 128, 192, 208, 256]


def run_skinny(copy_bw: float, rows_list: list[int], only: str | None) -> list[dict]:
    """The skinny-M GEMM (``pdpool.kernels.skinny_gemm``), every config that its autotuner would try for the key,
    against cuBLAS, per decode GEMM shape and row count: one CUDA graph of a layer stack's calls on distinct
    weights (per call time = replay / layers), as the decode graph runs them."""
    import torch.nn.functional as F

    from pdpool.kernels import skinny_gemm as sk

    results = []
    small = DEVICE != "cuda"
    for model, proj, N, K, layers in SKINNY_CASES:
        if only and f"{model}:{proj}" not in only.split(","):
            continue
        if small:
            N, K, layers = N // 64 + 3, K // 64 + 5, 2
        ws = [torch.randn(N, K, device=DEVICE, dtype=DTYPE) / K ** 0.5 for _ in range(layers)]
        for M in rows_list:
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            ref = sk.skinny_ref(x, ws[0])
            cfgs = [c for c in sk.GPU_CONFIGS if sk._fits(c, sk.row_key(M), N)] if not small else [None]
            times, errs = {}, {}

            def stack(fn):
                return lambda: [fn(x, w) for w in ws]

            def quick(fn):  # shorter than bench_ms: many configs per shape
                return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") if not small else \
                    bench_ms(fn)

            times["cublas"] = 1e3 * quick(captured(stack(F.linear))) / layers
            for cfg in cfgs:
                name = "kernel" if cfg is None else str(cfg.kwargs)[1:-1].replace("'", "") + \
                    f", w{cfg.num_warps}, s{cfg.num_stages}"
                run = stack(lambda a, b, c=cfg: sk.skinny_linear(a, b, config=c) if c else sk.skinny_linear(a, b))
                errs[name] = ((run()[0].float() - ref).norm() / ref.norm()).item()
                assert errs[name] < TOLERANCE, f"{model} {proj} M {M} {name}: error {errs[name]:.2e}"
                sync()
                times[name] = 1e3 * quick(captured(run)) / layers
            best = min((k for k in times if k != "cublas"), key=times.get)
            copy_us = N * K * 2 / copy_bw * 1e6
            row = dict(model=model, proj=proj, M=M, N=N, K=K, copy_us=copy_us, cublas_us=times["cublas"],
                       best_us=times[best], best=best, max_err=max(errs.values()), all_us=times)
            results.append(row)
            print(f"skinny {model:9s} {proj:8s} M {M:3d} {N:6d}x{K:5d} copy {copy_us:7.2f} us | cuBLAS "
                  f"{times['cublas']:7.2f} us ({copy_us / times['cublas']:5.1%})  kernel {times[best]:7.2f} us "
                  f"({copy_us / times[best]:5.1%}) x{times['cublas'] / times[best]:.2f}  [{best}]", flush=True)
        del ws
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemv", action="store_true", help="the batch-1 projections and the qkv epilogue instead")
    ap.add_argument("--skinny", action="store_true", help="the decode-sized GEMMs (16-256 rows) instead")
    ap.add_argument("--skinny-rows", default=",".join(map(str, SKINNY_ROWS)))
    ap.add_argument("--skinny-cases", default=None, help="e.g. llama8b:gate_up,llama8b:down (default: all)")
    ap.add_argument("--old", default=None, help="an older kernels/decode_attention.py, timed beside this one")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEVICE, DTYPE
    if args.device != "cuda":
        DEVICE, DTYPE = args.device, torch.float32
    copy_bw = copy_bandwidth()
    sms = decode_attention.num_multiprocessors(torch.device(DEVICE)) if DEVICE == "cuda" else 64  # CPU: splits
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"GPU {name}, {sms} SMs; device-to-device copy {copy_bw / 1e9:.0f} GB/s (read + write); autotune "
          f"{os.environ.get('PDPOOL_KERNEL_AUTOTUNE', '1')}", flush=True)
    if args.skinny:
        res = run_skinny(copy_bw, [int(r) for r in args.skinny_rows.split(",")], args.skinny_cases)
        out = os.environ.get("OUT")
        if out:
            Path(out, "bench_skinny.json").write_text(json.dumps(dict(gpu=name, copy_GBps=copy_bw / 1e9,
                                                                      cases=res), indent=1))
        return 0
    if args.gemv:
        res = run_gemv(copy_bw)
        out = os.environ.get("OUT")
        if out:
            Path(out, "bench_gemv.json").write_text(json.dumps(dict(gpu=name, copy_GBps=copy_bw / 1e9, **res),
                                                               indent=1))
        return 0
    codes = {"new": (decode_attention, "longest"), "new-unsorted": (decode_attention, "batch")}
    if args.old:
        codes["old"] = (load_old(args.old), "batch")
    results = {"gpu": name, "copy_GBps": copy_bw / 1e9, "cases": []}
    for case in args.cases.split(","):
        row = run_case(case, codes, copy_bw, sms)
        results["cases"].append(row)
        line = "  ".join(f"{c} {v['us']:8.1f} us ({v['us_per_layer']:6.1f}/layer) {100 * v['frac_copy']:5.1f}%"
                         for c, v in row["codes"].items())
        print(f"{case:16s} rows {row['rows']:3d} ctx {row['mean_context']:7.0f} splits {row['num_splits']:3d} "
              f"{row['MB']:8.1f} MB | {line}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_decode.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
