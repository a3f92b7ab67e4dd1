"""KV handoff between two processes on CPU: NIXL READ/WRITE (UCX) against a torch copy of the same bytes.

Shape: the demo model's KV (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, block 16, float32), so one
block is 30 * 2 * 16 * 3 * 64 * 4 = 737,280 bytes. For 128, 1k and 4k tokens the decode process (this one)
pulls the prompt's blocks from a prefill process (spawned) that holds them, and pushes them back:

* READ run:   remote and local block ids both ascending -> one descriptor per transfer (fresh allocations);
* READ frag:  ids shuffled -> one descriptor per block (a fragmented pool, the worst case);
* WRITE run:  push direction, ascending ids;
* torch copy: ``dst[a:b].copy_(src[c:d])`` of the same bytes inside one process (the floor).

Each UCX_TLS setting gets its own pair of agents. Times are medians over --reps, measured around the whole
call (descriptor build, post, completion polling). The first contact's connection set-up is excluded (the agent
warms up), and reported separately.

    .venv/bin/python benchmarks/kv_handoff_cpu.py [--reps 10] [--tls tcp,self cma,tcp,self]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
TOKENS = (128, 1024, 4096)
NUM_BLOCKS = 4096 // BLOCK_SIZE + 8
SHAPE = (NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def known_kv():
    import torch
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g)


def holder(tls: str, md_queue, done_queue) -> None:
    """The prefill process: registers a KV cache with known contents and waits."""
    os.environ["OMP_NUM_THREADS"] = "1"
    from pdpool.kv_transfer.agent import KVAgent

    agent = KVAgent(f"prefill-{os.getpid()}", ucx_tls=tls)
    kv = known_kv()
    agent.register_kv_cache(kv)
    md_queue.put(agent.metadata())
    done_queue.get()  # keep the memory registered until the reader is done
    agent.close()


def timed(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run_tls(tls: str, reps: int) -> list[dict]:
    import torch

    from pdpool.kv_transfer.agent import KVAgent

    ctx = mp.get_context("spawn")
    md_queue, done_queue = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=holder, args=(tls, md_queue, done_queue), daemon=True)
    proc.start()
    agent = KVAgent(f"decode-{os.getpid()}-{tls}", ucx_tls=tls)
    kv = torch.zeros(SHAPE)
    agent.register_kv_cache(kv)
    src = known_kv()
    peer = agent.add_peer(md_queue.get(timeout=120))
    t0 = time.perf_counter()
    agent.read_blocks(peer, [0], [0], timeout=30)  # first contact: warm-up + one block
    first_contact_ms = (time.perf_counter() - t0) * 1e3
    rows = []
    rng = random.Random(0)
    for tokens in TOKENS:
        n = -(-tokens // BLOCK_SIZE)
        ids = list(range(n))
        remote_frag, local_frag = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)
        nbytes = n * kv[0].numel() * kv.element_size()

        kv.zero_()
        agent.read_blocks(peer, ids, ids, timeout=30)
        assert torch.equal(kv[:n], src[:n]), "READ moved wrong bytes"
        read_run = timed(lambda: agent.read_blocks(peer, ids, ids, timeout=30), reps)
        kv.zero_()
        agent.read_blocks(peer, remote_frag, local_frag, timeout=30)
        assert torch.equal(kv[local_frag], src[remote_frag]), "fragmented READ moved wrong bytes"
        read_frag = timed(lambda: agent.read_blocks(peer, remote_frag, local_frag, timeout=30), reps)
        kv.copy_(src)  # WRITE the same values back, so the holder's contents stay known
        write_run = timed(lambda: agent.write_blocks(peer, ids, ids, timeout=30), reps)
        dst = torch.empty_like(src)
        copy = timed(lambda: dst[:n].copy_(src[:n]), reps)
        rows.append(dict(tls=tls, tokens=tokens, blocks=n, mb=nbytes / 1e6, read_run=read_run,
                         read_frag=read_frag, write_run=write_run, copy=copy, first_contact_ms=first_contact_ms))
    done_queue.put(None)
    proc.join(30)
    agent.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tls", nargs="+", default=["tcp,self", "cma,tcp,self"])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)

    rows = [row for tls in args.tls for row in run_tls(tls, args.reps)]
    print(f"\nKV handoff, SmolLM2-135M shape ({NUM_LAYERS} layers x 2 x {BLOCK_SIZE} tok x {NUM_KV_HEADS} heads x "
          f"{HEAD_DIM} x fp32 = {NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4} B/block), "
          f"median of {args.reps}; ms and GB/s\n")
    head = (f"{'UCX_TLS':<14}{'tokens':>7}{'blocks':>7}{'MB':>8} | {'READ run':>17} | {'READ frag':>17} | "
            f"{'WRITE run':>17} | {'torch copy':>17}")
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for key in ("read_run", "read_frag", "write_run", "copy"):
            cells.append(f"{r[key] * 1e3:8.2f} {r['mb'] / 1e3 / r[key]:7.2f}GB/s")
        print(f"{r['tls']:<14}{r['tokens']:>7}{r['blocks']:>7}{r['mb']:>8.1f} | " + " | ".join(cells))
    for tls in args.tls:
        first = next(r for r in rows if r["tls"] == tls)["first_contact_ms"]
        print(f"first contact with a peer ({tls}): {first:.1f} ms (connection + warm-up + 1 block)")


if __name__ == "__main__":
    main()
