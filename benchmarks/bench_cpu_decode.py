"""CPU decode attention: the torch backend (gather whole blocks + SDPA) against the cpu backend's native kernel,
through each backend's ``forward`` as the engine calls it, on one layer of a node-layout KV cache with shuffled
block tables. Checks both against the fp32 paged reference first, then times them.

    .venv/bin/python benchmarks/bench_cpu_decode.py [--rows 64] [--context 512] [--threads 2]

Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64), block 16, fp32, 30 layers in the cache.
Bytes = every context token's K and V of the layer, read once; the copy rate is a large tensor copy in the same run.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pdpool.attention import AttentionMetadata, get_backend
from pdpool.kernels.paged_ref import paged_attention_ref


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="mean context; lengths vary in [context/2, 3*context/2]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", default="9,3,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
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
    copy_gbs = 2 * big.numel() * 4 / timed(lambda: big.clone(), 5) / 1e9
    nbytes = sum(lens) * 2 * hkv * d * 4
    print(f"{args.rows} rows, context {sum(lens) // args.rows} mean ({min(lens)}..{max(lens)}), heads {hq}/{hkv}, "
          f"D {d}, fp32, {args.threads} threads; KV bytes {nbytes / 1e6:.1f} MB; copy {copy_gbs:.1f} GB/s")
    for name in ("torch", "cpu"):
        backend = get_backend(name)

        def step():
            m = AttentionMetadata(**{k: v for k, v in vars(meta).items() if k != "plan"})  # plan made per step
            return backend.forward(q, k_cache, v_cache, m, scale)

        err = ((step() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
        dt = timed(step, args.reps)
        print(f"{name:>6}: {dt * 1e3:7.2f} ms per layer, {nbytes / dt / 1e9:5.1f} GB/s, rel err {err:.1e}")


if __name__ == "__main__":
    main()
