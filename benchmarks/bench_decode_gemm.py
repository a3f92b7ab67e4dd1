"""The decode GEMMs (``F.linear`` at 16-256 rows) under three library choices, in CUDA graphs, as the decode graph
runs them: cuBLAS's default heuristic pick, cuBLASLt preferred (``torch.backends.cuda.preferred_blas_library``),
and PyTorch TunableOp (``torch.cuda.tunable``: every cuBLAS/cuBLASLt algorithm it lists for the shape is timed and
the fastest kept). Each time is per call: one graph replays a layer stack's calls on distinct weights (so the
weights stream from HBM, not L2), divided by the layers. Copy speed is the weight bytes at the device-to-device
copy rate measured in the same process.

    python3 benchmarks/bench_decode_gemm.py [--rows 16,64,128,192,256] [--cases llama8b:gate_up,...]

Prints one line per (shape, rows) and writes ``$OUT/bench_decode_gemm.json`` (with TunableOp's chosen algorithm).

``--methods`` picks the columns (default ``cublas,cublaslt,tuned``, the sixth pass's). Issue 13, tenth pass, adds:

    tma        the Hopper Triton GEMM (``pdpool.kernels.tma_gemm``: persistent, TMA, swap-AB, stream-K or whole
               tiles), every config of ``TMA_CONFIGS`` that fits the row tile, screened, the best kept
    lt-search  cuBLASLt through ctypes (``pdpool.kernels.cublaslt``): the heuristic's top 32 and their split-K
               variants, screened, the best kept
    lt-enum    as lt-search, plus the algorithm ids' (tile, stages) configurations the library accepts

Issue 13, eleventh pass, adds:

    cutlass:all     the CUTLASS sm90a kernels (``pdpool.kernels.cutlass_gemm``; build them first with
                    ``benchmarks/build_cutlass_gemm.sh``): every kernel whose row tile fits the rows, in every
                    decomposition mode (CUTLASS's heuristic, data-parallel, stream-K, split-K 2 and 4), screened,
                    the best kept, as a per-shape dispatcher would pick
    cutlass:<cfg>   one config, e.g. ``cutlass:sw_sk_128x256x64_1x1:sk`` (several: repeat the method)

    Before screening, each CUTLASS candidate's first-layer output must be within 2e-2 of the fp32 reference in
    max abs error relative to the reference's max abs value; the per-layer sums of the four projections and the
    best config per projection are printed at the end.

Screening: each candidate's graph is replayed 5 times (median of CUDA-event times); the 3 best of each method are
then timed like the others (``do_bench`` over graph replays). Every candidate's first-layer output must be within
2e-2 of the fp32 reference (relative), and two graph replays must give identical outputs, or it is dropped.

    python3 benchmarks/bench_decode_gemm.py --methods cublas,tma,lt-search --rows 64,128,160,192,224,256 \
        --cases llama8b:qkv,llama8b:o,llama8b:gate_up,llama8b:down
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench_decode_kernel import SKINNY_CASES, captured, copy_bandwidth  # noqa: E402

TMA_CONFIGS = [  # (block_w, block_k, stages, warps, whole_tiles); pruned by shared memory for the row tile
    (128, 64, 4, 8, False), (128, 64, 4, 8, True), (128, 128, 3, 8, False), (256, 64, 4, 8, False),
    (64, 128, 4, 4, False)]


def timed_us(run, layers: int) -> float:
    return 1e3 * triton.testing.do_bench(captured(run), warmup=10, rep=80, return_mode="median") / layers


def screen_us(replay, layers: int, reps: int = 5) -> float:
    """Median of ``reps`` graph replays (CUDA events), per call."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1e3 * statistics.median(times) / layers


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ a, warmup=10, rep=100, return_mode="median")
    return 2 * 8192 ** 3 / (ms * 1e-3)


def tma_candidates(M: int, N: int, K: int):
    from pdpool.kernels import tma_gemm as tg

    for bw, bk, stages, warps, whole in TMA_CONFIGS:
        cfg = tg.TmaGemmConfig(bw, bk, stages, warps, whole_tiles=whole)
        if not tg.fits(cfg, M, K):
            continue
        yield repr(cfg), (lambda x, w, cfg=cfg: tg.tma_linear(x, w, cfg))


def lt_candidates(M: int, N: int, K: int, enumerate_ids: bool):
    from pdpool.kernels import cublaslt

    lt = cublaslt.LtGemm(M, N, K)
    cands = lt.heuristic(32)
    cands += lt.split_variants(cands[:4])
    if enumerate_ids:
        cands += lt.enumerate_ids(limit=160)
    for cand in cands:
        yield cand.label, (lambda x, w, cand=cand: lt(x, w, cand))


CUTLASS_MODES = ("heur", "dp", "sk", "s2", "s4")


def cutlass_candidates(configs: list[str], x, w0, ref, M: int):
    """The CUTLASS configs that fit ``M`` rows (batch-row tiles at most two and at most 1.5x the rows), each
    checked against the fp32 reference (max abs error over the output's max abs) before it is yielded."""
    from pdpool.kernels import cutlass_gemm as cg

    if configs == ["all"]:
        configs = []
        for name in cg.KERNELS:
            kernel = cg.Kernel.parse(name)
            tiles = -(-M // kernel.row_tile())
            if tiles <= 2 and tiles * kernel.row_tile() <= 1.5 * M:
                configs += [f"{name}:{mode}" for mode in CUTLASS_MODES] if kernel.stream_k else [name]
    scale = ref.abs().max().item()
    for config in configs:
        try:
            err = (cg.linear(x, w0, config).float() - ref).abs().max().item() / scale
        except RuntimeError as exc:  # a config the kernel refuses for this shape
            print(f"  cutlass {config}: {exc}", flush=True)
            continue
        if not err < 2e-2:
            print(f"  cutlass {config}: max abs error {err:.3g} of the output's scale, dropped", flush=True)
            continue
        yield config, (lambda x, w, config=config: cg.linear(x, w, config))


def per_layer_sums(results: list[dict]) -> None:
    """Per row count: the four projections' sum per layer for each method, and each projection's best CUTLASS."""
    for M in sorted({r["M"] for r in results}):
        rows = [r for r in results if r["M"] == M]
        methods = [m for m in rows[0]["us"] if all(m in r["us"] for r in rows)]
        sums = {m: sum(r["us"][m] for r in rows) for m in methods}
        line = "  ".join(f"{m} {v:7.2f}" for m, v in sums.items())
        picks = ", ".join(f"{r['proj']} {r['found'][m]['label']}" for r in rows for m in r["found"]
                          if m.startswith("cutlass"))
        base = sums.get("cublas")
        diffs = "  ".join(f"{m}-cublas {v - base:+7.2f}" for m, v in sums.items() if base and m != "cublas")
        print(f"layer M {M:3d} ({len(rows)} projections) us: {line} | {diffs} | {picks}", flush=True)


def search(method: str, candidates, x, ws, ref, layers: int, keep: int = 3) -> dict:
    """Screen every candidate in graph replays, time the ``keep`` best as the others are timed; the fastest."""
    screened, dropped = [], 0
    t0 = time.perf_counter()
    for label, fn in candidates:
        try:
            out0 = fn(x, ws[0])
            torch.cuda.synchronize()
            err = ((out0.float() - ref).norm() / ref.norm()).item()
            replay = captured(lambda fn=fn: [fn(x, w) for w in ws])
            outs_a = fn(x, ws[0]).clone()
            replay()
            torch.cuda.synchronize()
            if not err < 2e-2 or not torch.equal(outs_a, fn(x, ws[0])):
                dropped += 1
                continue
            screened.append((screen_us(replay, layers), label, fn, err))
        except Exception as exc:  # noqa: BLE001 - a candidate the library or the compiler refuses
            dropped += 1
            print(f"  {method} {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    screened.sort(key=lambda r: r[0])
    best = None
    for _, label, fn, err in screened[:keep]:
        us = timed_us(lambda fn=fn: [fn(x, w) for w in ws], layers)
        if best is None or us < best["us"]:
            best = dict(us=us, label=label, rel_err=err)
    return dict(best or dict(us=float("nan"), label="none", rel_err=float("nan")), screened=len(screened),
                dropped=dropped, search_s=time.perf_counter() - t0,
                top=[(round(u, 2), lab) for u, lab, _, _ in screened[:6]])


def library_columns(stack, ref, layers: int, times: dict, errs: dict, methods: list[str], label: str,
                    tune_ms: int) -> None:
    """The sixth pass's columns: cuBLASLt preferred and TunableOp (global torch switches)."""
    tunable = torch.cuda.tunable
    if "cublaslt" in methods:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        errs["cublaslt"] = ((stack()[0].float() - ref).norm() / ref.norm()).item()
        times["cublaslt"] = timed_us(stack, layers)
        torch.backends.cuda.preferred_blas_library("cublas")
    if "tuned" in methods:
        try:
            tunable.enable(True)
            tunable.tuning_enable(True)
            tunable.set_max_tuning_duration(tune_ms)
            stack()  # tunes the shape (eager), then the graph replays the pick
            torch.cuda.synchronize()
            tunable.tuning_enable(False)
            errs["tuned"] = ((stack()[0].float() - ref).norm() / ref.norm()).item()
            times["tuned"] = timed_us(stack, layers)
        except Exception as exc:  # noqa: BLE001 - report it and keep the other numbers
            print(f"tuned {label}: {type(exc).__name__}: {exc}", flush=True)
            times["tuned"] = float("nan")
        finally:
            tunable.enable(False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,128,192,256")
    ap.add_argument("--cases", default=None, help="e.g. llama8b:gate_up,qwen0.6b:qkv (default: all)")
    ap.add_argument("--methods", default="cublas,cublaslt,tuned",
                    help="cublas,cublaslt,tuned,tma,lt-search,lt-enum,cutlass:all,cutlass:<config>")
    ap.add_argument("--tune-ms", type=int, default=30, help="TunableOp's time per algorithm")
    args = ap.parse_args()
    methods = args.methods.split(",")
    torch.cuda.tunable.set_filename(str(Path(os.environ.get("OUT", "/tmp")) / "tunableop_results.csv"))
    copy_bw = copy_bandwidth()
    mm_rate = matmul_rate()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; copy "
          f"{copy_bw / 1e9:.0f} GB/s, bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    for model, proj, N, K, layers in SKINNY_CASES:
        if args.cases and f"{model}:{proj}" not in args.cases.split(","):
            continue
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(layers)]
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())

            def stack():
                return [F.linear(x, w) for w in ws]

            times, errs, found = {}, {}, {}
            times["cublas"] = timed_us(stack, layers)
            library_columns(stack, ref, layers, times, errs, methods, f"{model} {proj} M {M}", args.tune_ms)
            for method in ("tma", "lt-search", "lt-enum"):
                if method not in methods:
                    continue
                cands = (tma_candidates(M, N, K) if method == "tma"
                         else lt_candidates(M, N, K, enumerate_ids=method == "lt-enum"))
                found[method] = search(method, cands, x, ws, ref, layers)
                times[method], errs[method] = found[method]["us"], found[method]["rel_err"]
            cutlass_configs = [m.split(":", 1)[1] for m in methods if m.startswith("cutlass:")]
            if cutlass_configs:
                method = "cutlass" if cutlass_configs == ["all"] else "cutlass:" + ",".join(cutlass_configs)
                found[method] = search(method, cutlass_candidates(cutlass_configs, x, ws[0], ref, M), x, ws, ref,
                                       layers)
                times[method], errs[method] = found[method]["us"], found[method]["rel_err"]
            copy_us = (N * K + M * (N + K)) * 2 / copy_bw * 1e6
            flop_us = 2 * M * N * K / mm_rate * 1e6
            row = dict(model=model, proj=proj, M=M, N=N, K=K, copy_us=copy_us, matmul_us=flop_us, us=times,
                       rel_err=errs, found=found)
            results.append(row)
            print(f"gemm {model:9s} {proj:8s} M {M:3d} {N:6d}x{K:5d} copy {copy_us:6.2f} mm {flop_us:6.2f} us | "
                  + "  ".join(f"{k} {v:7.2f} ({copy_us / v:5.1%})" for k, v in times.items()), flush=True)
            for method, f in found.items():
                print(f"    {method:9s} best {f['label']}  ({f['screened']} ok, {f['dropped']} dropped, "
                      f"{f['search_s']:.1f} s) top {f['top'][:4]}", flush=True)
        ws = None
        torch.cuda.empty_cache()
    if any(m.startswith("cutlass:") for m in methods):
        per_layer_sums(results)
    out = os.environ.get("OUT")
    if out:
        tunable = torch.cuda.tunable
        Path(out, "bench_decode_gemm.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_GBps=copy_bw / 1e9,
            matmul_TFLOPs=mm_rate / 1e12, methods=methods,
            tunable_results=[str(r) for r in (tunable.get_results() or ())], cases=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
