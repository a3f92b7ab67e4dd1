"""CPU decode attention: the torch backend (gather whole blocks + SDPA) against the cpu backend's native kernel,
through each backend's ``forward`` as the engine calls it, on one layer of a node-layout KV cache with shuffled
block tables. Checks both against the fp32 paged reference first, then times them.

    .venv/bin/python benchmarks/bench_cpu_decode.py [--rows 64] [--context 512] [--threads 2]

Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64), block 16, fp32, 30 layers in the cache.
Timed: a layer after the step's first, as the engine runs 29 of 30 (the backend's per-step plan is made on the
first layer and kept in the metadata; its cost is printed beside). Bytes = every context token's K and V of the
layer, read once. References in the same run, 256 MiB each: the copy
rate (a copy into a buffer allocated before timing, bytes read + written; a fresh ``clone`` pays a page fault per
4 KiB and measured a fraction of it) and the read rate (a sum: bytes read). The native kernel and the references
are the medians of ``--rounds`` interleaved rounds, so that a burst of load elsewhere on the machine hits all three;
the torch backend (about 15x slower) is timed once, after them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdpool.attention import AttentionMetadata, get_backend
from pdpool.kernels.paged_ref import paged_attention_ref


def timed(fn, reps: int) -> float:
    """Median seconds per call, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="mean context; lengths vary in [context/2, 3*context/2]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", default="9,3,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of references and kernels")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d = map(int, args.heads.split(","))
    bs, rng = 16, random.Random(0)
    lens = [rng.randint(args.context // 2, 3 * args.context // 2) for _ in range(args.rows)]
    need = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(need)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    kv = torch.randn(len(perm), args.layers, 2, bs, hkv, d)  # the node layout; layer 0 is attended
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    meta = AttentionMetadata.build([1] * args.rows, lens, tables, bs)
    q = torch.randn(args.rows, hq, d)
    scale = d ** -0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)

    big = torch.randn(64 * 2 ** 20)  # 256 MiB
    dst = torch.empty_like(big)
    nbytes = sum(lens) * 2 * hkv * d * 4
    def measure(name: str) -> tuple:
        """(a layer after the step's first, its relative error, the plan's cost on the first layer in ms)"""
        backend = get_backend(name)

        def first_layer():  # plans the step (the engine's first layer does, for all layers)
            m = AttentionMetadata(**{k: v for k, v in vars(meta).items() if k != "plan"})
            return backend.forward(q, k_cache, v_cache, m, scale)

        planned = AttentionMetadata(**{k: v for k, v in vars(meta).items() if k != "plan"})

        def layer():  # every later layer of the step: the plan is made
            return backend.forward(q, k_cache, v_cache, planned, scale)

        err = ((layer() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
        return layer, err, (timed(first_layer, 5) - timed(layer, 5)) * 1e3

    steps = {"cpu": measure("cpu")}
    copy, read, per_layer = [], [], {"cpu": []}
    for _ in range(args.rounds):
        copy.append(2 * big.numel() * 4 / timed(lambda: dst.copy_(big), 5) / 1e9)
        read.append(big.numel() * 4 / timed(lambda: big.sum(), 5) / 1e9)
        per_layer["cpu"].append(timed(steps["cpu"][0], args.reps))
    # the torch backend last, on its own: each call allocates and writes ~100 MB of gathered K/V, and the native
    # kernel measured 15-25% slower in the rounds after it (interleaved, or the torch backend first)
    steps["torch"] = measure("torch")
    per_layer["torch"] = [timed(steps["torch"][0], args.reps)]
    copy_gbs, read_gbs = statistics.median(copy), statistics.median(read)
    print(f"{args.rows} rows, context {sum(lens) // args.rows} mean ({min(lens)}..{max(lens)}), heads {hq}/{hkv}, "
          f"D {d}, fp32, {args.threads} threads; KV bytes {nbytes / 1e6:.1f} MB; medians of {args.rounds} rounds: "
          f"copy {copy_gbs:.1f} GB/s (rounds {' '.join(f'{x:.1f}' for x in copy)}), read {read_gbs:.1f} GB/s")
    for name in ("torch", "cpu"):
        _, err, plan_ms = steps[name]
        dt = statistics.median(per_layer[name])
        gbs = nbytes / dt / 1e9
        print(f"{name:>6}: {dt * 1e3:7.2f} ms per layer, {gbs:5.1f} GB/s = {gbs / copy_gbs:4.0%} of copy, "
              f"{gbs / read_gbs:4.0%} of read (rounds {' '.join(f'{x * 1e3:.2f}' for x in per_layer[name])} ms), "
              f"rel err {err:.1e}; the step's plan (first layer only) +{plan_ms:.2f} ms")


if __name__ == "__main__":
    main()
