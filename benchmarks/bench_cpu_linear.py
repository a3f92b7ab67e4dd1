"""CPU linear layers at decode sizes: torch's ``F.linear``, the oneDNN-packed path and the native small-row kernel
(``kernels/csrc/linear_cpu.cpp``), each against the machine's read rate, on SmolLM2-135M's layer shapes.

    .venv/bin/python benchmarks/bench_cpu_linear.py [--rows 1,2,4,8,16,32] [--threads 2] [--rounds 3]

A decode step streams every weight once and none of them is in cache when its layer comes (541 MB of fp32 weights
per step), so each shape gets enough copies of its weight to fill ``--mib`` (default 256 MiB) and every call takes
the next copy: the bytes are the weight's, read from memory. Reported per shape and row count: the median ms per
call of each path and the weight bytes / time as GB/s, beside the read rate (a sum over 256 MiB) and the copy rate
(into a buffer allocated before timing, bytes read + written), all as medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench_cpu_decode import timed  # benchmarks/ is the script's folder, so on sys.path
from pdpool.models import cpu_linear

# (name, N, K) of the demo model (SmolLM2-135M): fused qkv, o, fused gate_up, down, logits (tied embedding)
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("logits", 49152, 576)]


def cycling(weights: list, call):
    """A function that runs ``call`` on the next weight copy each time, so no call finds its weight in cache."""
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(weights)
        return call(weights[state["i"]])

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--mib", type=int, default=256, help="weight copies per shape fill this much memory")
    ap.add_argument("--reps", type=int, default=0, help="calls per timing (default: one pass over the copies)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--paths", default="torch,packed,native")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    paths = args.paths.split(",")
    if dtype != torch.float32 or not cpu_linear.packed_linear_available():
        paths = [p for p in paths if p != "packed"]
    if "native" in paths and not cpu_linear.native_linear_available():
        print("the native linear kernel is not available here; skipping it")
        paths.remove("native")
    big = torch.randn(64 * 2 ** 20)
    dst = torch.empty_like(big)
    print(f"{args.dtype}, {args.threads} threads, torch {torch.__version__}; weights cycled over {args.mib} MiB per "
          f"shape; medians of {args.rounds} interleaved rounds")
    header = "shape      N x K        rows " + "".join(f"{p:>22}" for p in paths) + "   read GB/s  copy GB/s"
    print(header)
    for name, n, k in SHAPES:
        if name not in args.shapes.split(","):
            continue
        wbytes = n * k * dtype.itemsize
        copies = max(2, args.mib * 2 ** 20 // wbytes)
        gen = torch.Generator().manual_seed(n + k)
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for _ in range(copies)]
        packed = [cpu_linear.PackedWeight(w) for w in weights] if "packed" in paths else []
        for p in packed:
            p.packed()
        reps = args.reps or copies
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            calls = {
                "torch": cycling(weights, lambda w: F.linear(x, w)),
                "packed": cycling(packed, lambda p: torch.ops.mkldnn._linear_pointwise(x, p.packed(), None, "none",
                                                                                       [], "")),
                "native": cycling(weights, lambda w: cpu_linear.native_linear(x, w)),
            }
            ref = F.linear(x.float(), weights[0].float())
            if "native" in paths:
                got = cpu_linear.native_linear(x, weights[0]).float()
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"native {name} rows {rows}: rel err {err}"
            per = {p: [] for p in paths}
            read, copy = [], []
            for _ in range(args.rounds):
                read.append(big.numel() * 4 / timed(lambda: big.sum(), 3) / 1e9)
                copy.append(2 * big.numel() * 4 / timed(lambda: dst.copy_(big), 3) / 1e9)
                for p in paths:
                    per[p].append(timed(calls[p], reps))
            cells = ""
            for p in paths:
                dt = statistics.median(per[p])
                cells += f"{dt * 1e3:9.3f} ms {wbytes / dt / 1e9:5.1f} GB/s"
            print(f"{name:<8} {n:>5} x {k:<5} {rows:>4} {cells}   {statistics.median(read):9.1f}  "
                  f"{statistics.median(copy):9.1f}", flush=True)
        del weights, packed


if __name__ == "__main__":
    main()
