"""Where a decode step's host time goes inside ``launch`` (issue 13): host µs per call of each piece of one steady
decode batch, on the GPU, for the code under ``--code-root`` (default: this checkout).

Qwen3-0.6B (benchmarks/configs, dummy weights, bf16, fused ops, overlapped loop), ``--num-requests`` prompts of
``--prompt-len`` random ids, each ``--max-tokens`` tokens (ignore_eos, temperature 0.6): after the prefill every
step is a decode step of the whole batch. Each piece is wrapped with ``time.perf_counter`` (a few µs of wrapper per
call, so the pieces are upper bounds): pack, upload, run and, inside run, the graph's ``stage``, the backend's
``prepare_replay``, the replay itself, the logits; the sampler's ``sample_async`` and, inside it, its kernel call
and the host copy's ``PendingSample``. Then ``--replays`` bare replays of the batch's graph (host µs per
``replay()`` call) give the driver's graph-launch cost alone.

    python3 benchmarks/bench_decode_host.py [--code-root .bench_base] [--num-requests 256] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code-root", default=None, help="an older checkout, first on sys.path")
    ap.add_argument("--model", default="Qwen3-0.6B")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.code_root:
        sys.path.insert(0, str(Path(args.code_root).resolve()))
    sys.path.insert(1 if args.code_root else 0, str(ROOT))
    import random

    import torch

    import pdpool  # before gpu_e2e, which puts this checkout first on sys.path: the code under test stays first
    from pdpool import SamplingParams

    from benchmarks.gpu_e2e import make_llm, model_folder
    print("pdpool from", Path(pdpool.__file__).parent, flush=True)
    folder = model_folder(args.model, Path(tempfile.mkdtemp()))
    llm = make_llm(folder, "cuda", True, max_num_seqs=args.num_requests, max_num_batched_tokens=16384,
                   max_model_len=4096)  # as gpu_e2e: the whole batch in one graph bucket
    llm.engine.overlap_steps = True
    runner = llm.engine.runner
    totals: dict[str, list[float]] = {}

    def wrap(obj, name, label=None):
        fn = getattr(obj, name)
        key = label or name

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals.setdefault(key, []).append(time.perf_counter() - t0)
        setattr(obj, name, timed)

    import pdpool.engine.sampler as sampler_mod
    import pdpool.kernels.sample as sample_kernels
    wrap(runner, "pack")
    wrap(runner, "upload")
    wrap(runner, "run")
    wrap(runner, "launch")
    wrap(runner.model, "compute_logits")
    wrap(runner.sampler, "sample_async")
    wrap(sample_kernels, "gumbel_argmax")
    graphs = runner.graphs
    wrap(graphs, "stage")
    if graphs.prepare_replay is not None:
        wrap(graphs, "prepare_replay")
    pending_init = sampler_mod.PendingSample.__init__

    def timed_init(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return pending_init(self, *a, **k)
        finally:
            totals.setdefault("PendingSample", []).append(time.perf_counter() - t0)
    sampler_mod.PendingSample.__init__ = timed_init
    replay_times: list[float] = []
    graph_run = graphs.run

    def run_with_replay_timed(input_ids, positions, meta):
        # DecodeGraphs.run with the replay call timed on its own (the same steps as graphs.run)
        b = graphs.stage(input_ids, positions, meta)
        if graphs.prepare_replay is not None:
            graphs.prepare_replay(graphs.metas[b], meta.seq_lens_cpu)
        t0 = time.perf_counter()
        graphs.graphs[b].replay()
        replay_times.append(time.perf_counter() - t0)
        graphs.num_replays += 1
        return graphs.outputs[b][:meta.num_requests]
    graphs.run = run_with_replay_timed

    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True), use_tqdm=False)
    totals.clear()
    replay_times.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    graphs.run = graph_run

    # the steady part: calls after the first 10% (prefill, first replays) and before the last 10%
    def steady_us(xs):
        xs = sorted(xs[len(xs) // 10: len(xs) - len(xs) // 10] or xs)
        return dict(calls=len(xs), median_us=round(1e6 * xs[len(xs) // 2], 1),
                    mean_us=round(1e6 * sum(xs) / len(xs), 1))

    parts = {k: steady_us(v) for k, v in totals.items()}
    parts["replay"] = steady_us(replay_times)
    # bare replays of the largest captured bucket: the driver's graph launch alone
    b = max(graphs.graphs)
    bare = []
    torch.cuda.synchronize()
    for _ in range(args.replays):
        t1 = time.perf_counter()
        graphs.graphs[b].replay()
        bare.append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    small = min(graphs.graphs)
    bare_small = []
    for _ in range(args.replays):
        t1 = time.perf_counter()
        graphs.graphs[small].replay()
        bare_small.append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    result = dict(code=str(Path(pdpool.__file__).parent), wall_s=round(wall, 3), parts_us=parts,
                  bare_replay_us={str(b): steady_us(bare), str(small): steady_us(bare_small)})
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
