"""The decode GEMMs (``F.linear`` at 16-256 rows) under three library choices, in CUDA graphs, as the decode graph
runs them: cuBLAS's default heuristic pick, cuBLASLt preferred (``torch.backends.cuda.preferred_blas_library``),
and PyTorch TunableOp (``torch.cuda.tunable``: every cuBLAS/cuBLASLt algorithm it lists for the shape is timed and
the fastest kept). Each time is per call: one graph replays a layer stack's calls on distinct weights (so the
weights stream from HBM, not L2), divided by the layers. Copy speed is the weight bytes at the device-to-device
copy rate measured in the same process.

    python3 benchmarks/bench_decode_gemm.py [--rows 16,64,128,192,256] [--cases llama8b:gate_up,...]

Prints one line per (shape, rows) and writes ``$OUT/bench_decode_gemm.json`` (with TunableOp's chosen algorithm).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench_decode_kernel import SKINNY_CASES, captured, copy_bandwidth  # noqa: E402


def timed_us(run, layers: int) -> float:
    return 1e3 * triton.testing.do_bench(captured(run), warmup=10, rep=80, return_mode="median") / layers


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,128,192,256")
    ap.add_argument("--cases", default=None, help="e.g. llama8b:gate_up,qwen0.6b:qkv (default: all)")
    ap.add_argument("--tune-ms", type=int, default=30, help="TunableOp's time per algorithm")
    args = ap.parse_args()
    tunable = torch.cuda.tunable
    tunable.set_filename(str(Path(os.environ.get("OUT", "/tmp")) / "tunableop_results.csv"))
    copy_bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, cuBLAS "
          f"{torch.backends.cuda.preferred_blas_library()}; copy {copy_bw / 1e9:.0f} GB/s", flush=True)
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

            times, errs = {}, {}
            times["cublas"] = timed_us(stack, layers)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            errs["cublaslt"] = ((stack()[0].float() - ref).norm() / ref.norm()).item()
            times["cublaslt"] = timed_us(stack, layers)
            torch.backends.cuda.preferred_blas_library("cublas")
            try:
                tunable.enable(True)
                tunable.tuning_enable(True)
                tunable.set_max_tuning_duration(args.tune_ms)
                stack()  # tunes the shape (eager), then the graph replays the pick
                torch.cuda.synchronize()
                tunable.tuning_enable(False)
                errs["tuned"] = ((stack()[0].float() - ref).norm() / ref.norm()).item()
                times["tuned"] = timed_us(stack, layers)
            except Exception as exc:  # noqa: BLE001 - report it and keep the other numbers
                print(f"tuned {model} {proj} M {M}: {type(exc).__name__}: {exc}", flush=True)
                times["tuned"] = float("nan")
            finally:
                tunable.enable(False)
            copy_us = (N * K + M * (N + K)) * 2 / copy_bw * 1e6
            row = dict(model=model, proj=proj, M=M, N=N, K=K, copy_us=copy_us, us=times, rel_err=errs)
            results.append(row)
            print(f"gemm {model:9s} {proj:8s} M {M:3d} {N:6d}x{K:5d} copy {copy_us:7.2f} us | " + "  ".join(
                f"{k} {v:7.2f} us ({copy_us / v:5.1%})" for k, v in times.items()) +
                f" | tuned/cublas x{times['cublas'] / times['tuned']:.2f}", flush=True)
        ws = None
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_decode_gemm.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_GBps=copy_bw / 1e9,
            tunable_results=[str(r) for r in (tunable.get_results() or ())], cases=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
