"""GPU end-to-end throughput of pdpool against HF transformers, with the workload's roofline, in one run.

Workload (nano-vllm's bench.py): 256 requests, prompts of random token ids (lengths uniform in [100, 1024]),
max_tokens uniform in [100, 1024], ignore_eos, temperature 0.6, random.Random(0). Models: the configs in
benchmarks/configs with dummy weights (``--load-format dummy``); the folder also gets a word-level tokenizer
over the whole vocabulary, since the engine detokenizes every token and these configs ship none.

Also measured in the same run, on the same GPU: device-to-device copy bandwidth (bytes read + written) and the
bf16 matmul rate (8192^3, random data). Roofline of the workload::

    t_roof = (decode_steps * weight_bytes + kv_bytes_read) / copy_bw + prefill_flops / matmul_rate
    decode_steps = max output length (all 256 requests fit at once); kv_bytes_read = sum over decode tokens of
    context_len * kv_bytes_per_token; prefill_flops = 2 * params * prompt_tokens + 2 * L * Hq * D * p^2 per prompt

Single stream (batch 1, one request of 128 prompt + 512 output tokens, greedy): tokens/s against
weight_bytes / copy_bw per token, with a torch profile of 20 steps (GPU kernel time and launches per step).

Each pdpool number is taken for the variants of ``VARIANTS`` (fused elementwise kernels on/off, overlapped step
loop on/off) in one process; HF transformers runs the first ``--hf-requests`` requests as one padded batch.

    python3 benchmarks/gpu_e2e.py [--models Qwen3-0.6B,Llama-3.1-8B] [--variants base,both] [--single-stream]
    python3 benchmarks/gpu_e2e.py --device cpu --tiny --num-requests 8 --hf-requests 4  # CPU smoke test

Every run reports wall ms per step, GPU kernel ms per step (torch profiler over steps 300-320 of a second, untimed
run of the same workload; ``E2E_PROFILE=inline`` profiles inside the timed run instead) and host ms per step by
part (``StepTimer.PARTS``), so a number shows whether it is GPU-bound or host-bound. Host sensitivity:
``--hosts unpinned,pinned`` runs each configuration in a child process, the pinned one under
``taskset -c 0,1`` (``--pin-cpus``); ``--code new,old=PATH`` also runs an older checkout (PATH first on
sys.path) in the same call, so old and new code meet on the same machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "benchmarks" / "configs"

NUM_REQUESTS = 256


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id ("t0" .. "t{V-1}"), so every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(folder))


def model_folder(name: str, root: Path, overrides: dict | None = None) -> Path:
    """benchmarks/configs/<name>/config.json (+ overrides) and a tokenizer, in a fresh folder under root."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((CONFIGS / name / "config.json").read_text()) if (CONFIGS / name).is_dir() else {}
    cfg.update(overrides or {})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(folder, cfg["vocab_size"])
    return folder


def workload(n: int = NUM_REQUESTS, seed: int = 0, max_len: int = 1024) -> list[tuple[list[int], int]]:
    """nano-vllm's: prompts first, then output lengths, from one seeded generator."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_len))] for _ in range(n)]
    outs = [rng.randint(100, max_len) for _ in range(n)]
    return list(zip(prompts, outs))


# --- ceilings ------------------------------------------------------------------------------------------------

def measure_ceilings(device: str) -> dict:
    import torch

    if device != "cuda":
        return dict(copy_bw=50e9, matmul_rate=1e12, gpu="cpu")
    n = 1 << 30  # 2 GiB of bf16 per buffer, far over the L2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    copy_bw = 2 * n * 2 / sorted(times)[len(times) // 2]
    del src, dst
    m = 8192
    x, y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda"), torch.randn(m, m, dtype=torch.bfloat16,
                                                                             device="cuda")
    for _ in range(3):
        x @ y
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        x @ y
    b.record()
    b.synchronize()
    rate = 10 * 2 * m ** 3 / (a.elapsed_time(b) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return dict(copy_bw=copy_bw, matmul_rate=rate, gpu=torch.cuda.get_device_name())


def model_numbers(cfg: dict) -> dict:
    """Parameter bytes streamed per decode step, KV bytes per token, and per-token matmul FLOPs (bf16)."""
    H, L, V, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    Hq = cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads") or Hq
    D = cfg.get("head_dim") or H // Hq
    layer = H * (Hq * D + 2 * Hkv * D) + Hq * D * H + 3 * H * inter
    body = L * layer
    head = V * H  # lm_head, or the tied embedding read as one
    return dict(weight_bytes=2 * (body + head), kv_bytes_per_token=L * 2 * Hkv * D * 2,
                matmul_params=body + head, attn_dims=L * Hq * D)


def roofline(reqs: list[tuple[list[int], int]], nums: dict, ceil: dict) -> dict:
    decode_steps = max(o for _, o in reqs)
    kv_tokens = sum(sum(len(p) + j for j in range(1, o)) for p, o in reqs)  # context read by each decode token
    prefill_flops = sum(2 * nums["matmul_params"] * len(p) + 2 * nums["attn_dims"] * len(p) ** 2 for p, _ in reqs)
    t_weights = decode_steps * nums["weight_bytes"] / ceil["copy_bw"]
    t_kv = kv_tokens * nums["kv_bytes_per_token"] / ceil["copy_bw"]
    t_prefill = prefill_flops / ceil["matmul_rate"]
    total = t_weights + t_kv + t_prefill
    out_tokens = sum(o for _, o in reqs)
    return dict(seconds=total, tokens_per_s=out_tokens / total, t_weights=t_weights, t_kv=t_kv,
                t_prefill=t_prefill)


# --- pdpool --------------------------------------------------------------------------------------------------

# The optimizations of docs/performance.md, measured on and off in one run: fused elementwise kernels in the model
# (PDPOOL_FUSED_OPS, read when the graphs are captured) and the overlapped step loop (engine.overlap_steps).
# "separate" (default since the seventh pass): the timed run has no profiler in it; the profiled steps come from a
# second, untimed run of the same workload. "inline": steps 300-320 are profiled inside the timed run, as in the
# earlier passes; its sync and the profiler's start and stop cost the GPU 80-130 ms of idle time per Qwen run.
PROFILE_PASS = os.environ.get("E2E_PROFILE", "separate")
VARIANTS = {"base": (False, False), "overlap": (False, True), "fused": (True, False), "both": (True, True)}


class StepTimer:
    """Host time of the engine's parts during one generate (wraps bound methods of one engine instance), and a
    torch profile of the steps in ``profile_steps``. With the overlapped loop the parts run while the GPU computes,
    so they need not add up to the wall time; ``wait`` (or, for engines before the split, ``sample``) holds the wait
    for the GPU. Parts that an engine version lacks are skipped, so one script times old and new code."""

    PARTS = (("scheduler", "schedule"), ("scheduler", "update_from_output"), ("runner", "pack"),
             ("runner", "launch"), ("runner", "upload"), ("runner", "run"), ("runner", "sample"),
             ("runner", "wait"), ("runner", "collect"), ("engine", "_fill_placeholders"),
             ("engine", "_make_outputs"), ("processor", "process"))
    # "launch" holds "upload" and "run" (forward + logits launch; and, where the sampler runs at launch, its
    # launch too); "collect" holds "wait". Parts outside these nest in nothing. "process" is the output
    # processor (detokenization, stop strings), after step() on the same thread in LLM.generate.
    NESTED = {"upload": "launch", "run": "launch", "wait": "collect"}

    def __init__(self, llm, profile_steps: tuple[int, int] | None = None, more_windows: tuple = ()):
        self.totals: dict[str, float] = {}
        self.steps = 0
        self.profile_steps, self.prof = profile_steps, None
        # further profiled windows (steps [a, b)), e.g. the first prefill chunks: (a, b, profile, wall seconds)
        self.windows = sorted(more_windows)
        self.window_profiles: list[tuple] = []
        self._window = None
        eng = llm.engine
        self._undo = []
        owners = dict(scheduler=eng.scheduler, runner=eng.runner, engine=eng, processor=llm.output_processor)
        self.calls: dict[str, list[float]] = {}  # per-call seconds of "launch" and "run": eager steps stand out
        self.stalls: list[tuple] = []  # (part, step, ms, allocator retries so far) of calls over 100 ms
        for owner, name in self.PARTS:
            if hasattr(owners[owner], name):
                self._wrap(owners[owner], name)
        self._wrap(eng, "step", self._count)

    def _wrap(self, obj, name, before=None):
        fn = getattr(obj, name)

        def timed(*a, **k):
            if before:
                before()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.totals[name] = self.totals.get(name, 0.0) + dt
                if name in ("launch", "run"):
                    self.calls.setdefault(name, []).append(dt)
                    if dt > 0.1:  # a stall: which step, and whether the allocator had to free and retry
                        import torch
                        retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0)
                                   if torch.cuda.is_available() else 0)
                        self.stalls.append((name, self.steps, round(1e3 * dt, 1), retries))
        setattr(obj, name, timed)
        self._undo.append((obj, name))

    def remove(self):
        for obj, name in self._undo:
            if name in vars(obj):
                delattr(obj, name)
        self._undo = []

    def call_stats(self) -> dict[str, dict[str, float]]:
        """ms per call of "launch"/"run": median, p90, max, and the share of the total in calls over 5 ms."""
        out = {}
        for name, xs in self.calls.items():
            xs = sorted(xs)
            out[name] = dict(calls=len(xs), p50=round(1e3 * xs[len(xs) // 2], 3),
                             p90=round(1e3 * xs[int(len(xs) * 0.9)], 3), max=round(1e3 * xs[-1], 3),
                             over_5ms_s=round(sum(x for x in xs if x > 5e-3), 3))
        return out

    def per_step_ms(self) -> dict[str, float]:
        return {k: round(1e3 * v / max(1, self.steps), 3) for k, v in self.totals.items() if k != "step"}

    def _count(self):
        n = self.steps
        if self._window is not None and n == self._window[1]:
            import torch
            torch.cuda.synchronize()
            a, b, prof, t0 = self._window
            prof.__exit__(None, None, None)
            self.window_profiles.append((a, b, prof, time.perf_counter() - t0))
            self._window = None
        if self._window is None and self.windows and n == self.windows[0][0]:
            import torch
            a, b = self.windows.pop(0)
            torch.cuda.synchronize()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            self._window = (a, b, prof, time.perf_counter())
        if self.profile_steps and n == self.profile_steps[0]:
            import torch
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t_prof = time.perf_counter()
        if self.prof is not None and self.profile_steps and n == self.profile_steps[1]:
            import torch
            torch.cuda.synchronize()
            self.prof_wall = time.perf_counter() - self.t_prof
            self.prof.__exit__(None, None, None)
            self.profile_steps = None
        self.steps += 1


class StepTrace:
    """Every launched step on the GPU's own clock: CUDA events at the start and end of ``launch`` and around the
    forward (``run``), plus the step's shape from its packed inputs. After the run, per step: the GPU's idle time
    before the step (its first op waited for the host), the forward's GPU span, and the step's own roofline
    (weights + the KV its decode rows read at copy speed, its prefill FLOPs at the matmul rate). Two event records
    per part, no sync: the run it watches is the timed one."""

    def __init__(self, runner, nums: dict, ceil: dict, timer: "StepTimer | None" = None):
        import torch

        self.torch, self.nums, self.ceil, self.timer = torch, nums, ceil, timer
        self.parts: list[dict] = []  # the timer's host totals at each launch: per-step host parts, by difference
        self.rows: list[tuple] = []  # (host t0, ev launch start, ev run start, ev run end, ev launch end, shape)
        self._run_evs: list = []
        self._undo = []
        launch, run = runner.launch, runner.run

        def traced_run(inputs):
            a = torch.cuda.Event(enable_timing=True)
            a.record()
            try:
                return run(inputs)
            finally:
                b = torch.cuda.Event(enable_timing=True)
                b.record()
                self._run_evs.append((a, b))

        def traced_launch(packed):
            t0 = time.perf_counter()
            s = torch.cuda.Event(enable_timing=True)
            s.record()
            self._run_evs = []
            if self.timer is not None:
                self.parts.append(dict(self.timer.totals))
            try:
                return launch(packed)
            finally:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                decode = [sl for q, sl in zip(packed.query_lens, packed.seq_lens) if q == 1]
                prefill = [(q, sl - q) for q, sl in zip(packed.query_lens, packed.seq_lens) if q > 1]
                self.rows.append((t0, time.perf_counter() - t0, s, self._run_evs, e,
                                  (len(decode), sum(decode), sum(q for q, _ in prefill),
                                   sum(q * (2 * st + q) for q, st in prefill))))

        runner.launch, runner.run = traced_launch, traced_run
        self._undo = [(runner, "launch"), (runner, "run")]
        self.gc_ms: dict[int, list[float]] = {}  # Python's collector during the run: ms per collection, by generation
        self.gc_events: list[tuple] = []  # (launches so far, generation, ms) of collections over 1 ms
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            ms = 1e3 * (time.perf_counter() - self._gc_t0)
            self.gc_ms.setdefault(info["generation"], []).append(ms)
            if ms > 1:
                self.gc_events.append((len(self.rows), info["generation"], round(ms, 2)))

    def remove(self):
        for obj, name in self._undo:
            if name in vars(obj):
                delattr(obj, name)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    BUCKETS = ((">=192", 192, 10**9), ("128-191", 128, 191), ("64-127", 64, 127), ("32-63", 32, 63),
               ("16-31", 16, 31), ("1-15", 1, 15))

    def summary(self, out_file: Path | None = None) -> dict:
        """Per step and per bucket (prefill/mixed steps; decode steps by batch size): host ms between launches,
        GPU idle ms before the launch, GPU ms of the launch (forward + sampler) and of the forward, roofline ms."""
        self.torch.cuda.synchronize()
        nums, ceil = self.nums, self.ceil
        steps = []
        for i, (t0, host_launch, s, runs, e, shape) in enumerate(self.rows):
            decode_rows, ctx, prefill_tokens, attn_q_ctx = shape
            idle = self.rows[i - 1][4].elapsed_time(s) if i else 0.0  # ms from the last step's end to here
            roof = ((nums["weight_bytes"] if decode_rows else 0) + ctx * nums["kv_bytes_per_token"]) / ceil["copy_bw"]
            roof += (2 * nums["matmul_params"] * prefill_tokens + 2 * nums["attn_dims"] * attn_q_ctx) / ceil[
                "matmul_rate"]
            host_gap = (self.rows[i + 1][0] - t0) * 1e3 if i + 1 < len(self.rows) else float("nan")
            steps.append(dict(step=i, decode_rows=decode_rows, prefill_tokens=prefill_tokens, ctx=ctx,
                              idle_before_ms=round(max(0.0, idle), 4), launch_gpu_ms=round(s.elapsed_time(e), 4),
                              run_gpu_ms=round(sum(a.elapsed_time(b) for a, b in runs), 4),
                              host_launch_ms=round(host_launch * 1e3, 4), host_cycle_ms=round(host_gap, 4),
                              roofline_ms=round(roof * 1e3, 4)))
        if out_file is not None:
            out_file.write_text(json.dumps(steps))
        buckets = {}

        def add(name, st):
            b = buckets.setdefault(name, dict(steps=0, idle_ms=0.0, launch_gpu_ms=0.0, run_gpu_ms=0.0,
                                              host_cycle_ms=0.0, roofline_ms=0.0, host_bound_steps=0))
            b["steps"] += 1
            b["idle_ms"] += st["idle_before_ms"]
            b["launch_gpu_ms"] += st["launch_gpu_ms"]
            b["run_gpu_ms"] += st["run_gpu_ms"]
            b["host_cycle_ms"] += 0.0 if st["host_cycle_ms"] != st["host_cycle_ms"] else st["host_cycle_ms"]
            b["roofline_ms"] += st["roofline_ms"]
            b["host_bound_steps"] += st["idle_before_ms"] > 0.05

        for st in steps:
            if st["prefill_tokens"]:
                add("prefill/mixed", st)
            else:
                add(next(n for n, lo, hi in self.BUCKETS if lo <= st["decode_rows"] <= hi), st)
            add("all", st)
        for b in buckets.values():
            for k in list(b):
                if k.endswith("_ms"):
                    b[k] = round(b[k], 1)
        span = self.rows[0][2].elapsed_time(self.rows[-1][4]) if self.rows else 0.0
        collector = {f"gen{g}": dict(count=len(v), total_ms=round(sum(v), 1), max_ms=round(max(v), 2))
                     for g, v in sorted(self.gc_ms.items())}
        # The steps whose launch the GPU waited for longest, with the host parts that grew before them (ms spent in
        # each part between the two launches before the wait, against that part's median over the run).
        waits = []
        if self.parts:
            deltas = [{k: 1e3 * (b.get(k, 0.0) - a.get(k, 0.0)) for k in b} for a, b in zip(self.parts, self.parts[1:])]
            median = {k: sorted(d.get(k, 0.0) for d in deltas)[len(deltas) // 2] for k in deltas[-1]}
            for st in sorted(steps, key=lambda x: -x["idle_before_ms"])[:12]:
                i = st["step"]
                if st["idle_before_ms"] < 0.5 or i < 1 or i - 1 >= len(deltas):
                    continue
                grew = sorted(((k, round(v - median.get(k, 0.0), 2)) for k, v in deltas[i - 1].items()
                               if k not in ("wait", "collect", "step")), key=lambda kv: -kv[1])[:3]
                waits.append(dict(step=i, idle_ms=st["idle_before_ms"], rows=st["decode_rows"],
                                  host_cycle_ms=self.rows[i - 1] and round(1e3 * (self.rows[i][0] -
                                                                                 self.rows[i - 1][0]), 2),
                                  grew=grew, gc=[g for g in self.gc_events if g[0] in (i - 1, i)]))
        return dict(gpu_span_ms=round(span, 1), buckets=buckets, gc=collector, longest_waits=waits,
                    gc_over_1ms=self.gc_events[:40])


def profile_summary(prof, num_steps: int, wall_s: float, trace_path: Path | None = None) -> dict:
    """GPU kernel time and launches per step from a torch profile, the top kernels, and the top host ops."""
    from torch.autograd import DeviceType

    ka = prof.key_averages()
    dev = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa
    kernels = [e for e in ka if e.device_type == DeviceType.CUDA]
    gpu_us = sum(dev(e) for e in kernels)
    launches = sum(e.count for e in kernels)
    top = sorted(kernels, key=dev, reverse=True)[:20]
    host = sorted((e for e in ka if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total,
                  reverse=True)[:12]
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    # CUDA runtime/driver calls on the host: launches (count, µs each) and the calls that can wait for the GPU
    runtime = {e.key: (e.count / num_steps, round(e.self_cpu_time_total / 1e3 / num_steps, 3),
                       round(e.self_cpu_time_total / max(1, e.count), 1))
               for e in ka if e.device_type == DeviceType.CPU and e.key.startswith(("cuda", "cu"))
               and not e.key.startswith("cudnn")}
    return dict(steps=num_steps, wall_ms_per_step=1e3 * wall_s / num_steps,
                gpu_kernel_ms_per_step=gpu_us / 1e3 / num_steps, kernels_per_step=launches / num_steps,
                top_kernels=[(e.key[:70], round(dev(e) / 1e3 / num_steps, 3), e.count // num_steps) for e in top],
                top_host_ops=[(e.key[:50], round(e.self_cpu_time_total / 1e3 / num_steps, 3)) for e in host],
                runtime_calls_per_step={k: v for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:10]})


def make_llm(folder: Path, device: str, fused: bool, **settings):
    import torch

    from pdpool import LLM

    os.environ["PDPOOL_FUSED_OPS"] = "1" if fused else "0"  # read while the decode graphs are captured
    llm = LLM(str(folder), dtype="bfloat16" if device == "cuda" else "float32", device=device,
              load_format="dummy", **settings)
    llm.engine.runner.model.fused_ops = fused and device == "cuda"  # and for every later eager step
    if device == "cuda":
        torch.cuda.synchronize()
    return llm


def release_gpu(device: str) -> None:
    """After the caller dropped its last reference to an LLM: collect it and return its memory."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_pdpool(llm, reqs, device: str, *, overlap: bool, profile: bool = False, temperature: float = 0.6,
               more_windows: tuple = (), step_trace: tuple | None = None) -> dict:
    """``step_trace``: (model numbers, ceilings, file for the per-step rows or None): a ``StepTrace`` of the run."""
    import torch

    from pdpool import SamplingParams

    llm.engine.overlap_steps = overlap and device == "cuda"
    # A second timed run in this process (another variant) gets prompts it has not seen: the first id of each is
    # one no earlier run used (random ids are 0..10000), so nothing hits the prefix cache and the shapes are equal.
    runs = llm.e2e_runs = getattr(llm, "e2e_runs", -1) + 1
    reqs = [([10000 + 2 * runs, *p[1:]], o) for p, o in reqs] if runs else reqs
    params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True) for _, o in reqs]
    # Warm-up on other prompts of the same length distribution (no prefix-cache hits for the timed run): the
    # prefill kernels tune and compile for the workload's chunk shapes here, not inside the timed run.
    warm = [p for p, _ in workload(len(reqs), seed=1, max_len=max(len(p) for p, _ in reqs))]
    llm.generate(warm, [SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True)] * len(warm),
                 use_tqdm=False)
    profile = profile and device == "cuda"
    inline = PROFILE_PASS == "inline"  # the earlier passes' method: the profiled steps inside the timed run
    timer = StepTimer(llm, (300, 320) if profile and inline else None, more_windows if profile and inline else ())
    trace = StepTrace(llm.engine.runner, *step_trace[:2], timer) if step_trace and device == "cuda" else None
    if device == "cuda":
        torch.cuda.synchronize()
    collector = os.environ.get("E2E_GC", "")  # a diagnostic: "off" = no Python collector in the timed run
    if collector == "off":
        gc.collect()
        gc.disable()
    t0 = time.perf_counter()
    try:
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    finally:
        if collector == "off":
            gc.enable()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.output_token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs), "ignore_eos requests must produce exactly max_tokens"
    runner = llm.engine.runner
    result = dict(seconds=seconds, output_tokens=tokens, tokens_per_s=tokens / seconds, steps=timer.steps,
                  ms_per_step=1e3 * seconds / max(1, timer.steps),
                  parts_s={k: round(v, 3) for k, v in timer.totals.items()}, host_ms_per_step=timer.per_step_ms(),
                  launch_calls=timer.call_stats(), stalls=timer.stalls, num_kv_blocks=runner.num_blocks,
                  cuda_graphs=runner.graphs is not None, graph_replays=getattr(runner.graphs, "num_replays", None),
                  attention=runner.backend.name, preemptions=llm.engine.scheduler.num_preemptions,
                  fused_ops=runner.model.fused_ops, overlap_steps=llm.engine.overlap_steps)
    if trace is not None:
        result["step_trace"] = trace.summary(step_trace[2])
        trace.remove()
    timer.remove()
    result["profile_pass"] = PROFILE_PASS if profile else "none"
    if profile and not inline:
        # The same workload again, untimed, profiled: each prompt's first id changed, so nothing hits the prefix
        # cache and the steps have the timed run's shapes.
        timer = StepTimer(llm, (300, 320), more_windows)
        llm.e2e_runs += 1
        again = [([10000 + 2 * llm.e2e_runs, *p[1:]], o) for p, o in reqs]
        t1 = time.perf_counter()
        llm.generate([p for p, _ in again], params, use_tqdm=False)
        result["profile_pass_seconds"] = round(time.perf_counter() - t1, 3)
        timer.remove()
    if timer.prof is not None:
        result["profile"] = profile_summary(timer.prof, 20, timer.prof_wall)
    for a, b, prof, wall in timer.window_profiles:  # e.g. the eager prefill chunks: GPU time against wall
        result[f"profile_steps_{a}_{b}"] = profile_summary(prof, b - a, wall)
    return result


# --- HF transformers ------------------------------------------------------------------------------------------

def run_hf(folder: Path, reqs, device: str, max_seconds: float) -> dict:
    """Padded static batches through ``model.generate`` (all of ``reqs`` in one left-padded batch, sampling at
    temperature 0.6, every row run to the batch's longest output), stopped after ``max_seconds`` (generate's
    ``max_time``). Throughput counts only the tokens each request asked for: sum(min(steps done, max_tokens)).
    HF's continuous batching (``init_continuous_batching``) is not used: in an earlier run on this machine it did
    not finish 16 requests in 150 s. Random init (throughput does not depend on the values)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    width = max(len(p) for p, _ in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    longest = max(o for _, o in reqs)
    with torch.inference_mode():
        model.generate(input_ids=ids[:, -64:], attention_mask=mask[:, -64:], do_sample=True, max_new_tokens=4,
                       min_new_tokens=4, pad_token_id=0, eos_token_id=None)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.6, top_k=0,
                             max_new_tokens=longest, min_new_tokens=longest, pad_token_id=0, eos_token_id=None,
                             max_time=max_seconds)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    steps = out.shape[1] - width
    useful = sum(min(steps, o) for _, o in reqs)
    import transformers
    del model, out
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(mode=f"padded static batch of {len(reqs)}, model.generate, sdpa attention", seconds=seconds,
                steps=steps, longest=longest, timed_out=steps < longest, output_tokens=useful,
                tokens_per_s=useful / seconds, generated_incl_padding=steps * len(reqs),
                transformers=transformers.__version__)


# --- single stream ---------------------------------------------------------------------------------------------

def run_single_stream(folder: Path, device: str, nums: dict, ceil: dict, fused: bool, overlap: bool,
                      n_out: int = 512, trace: Path | None = None) -> dict:
    from pdpool import SamplingParams

    llm = make_llm(folder, device, fused, max_num_seqs=8, max_model_len=4096, gpu_memory_utilization=0.5)
    llm.engine.overlap_steps = overlap and device == "cuda"
    prompt = random.Random(1).choices(range(100, 10000), k=128)
    llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    inline = PROFILE_PASS == "inline"
    timer = StepTimer(llm, (100, 120) if device == "cuda" and inline else None)
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True),
                       use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    if device == "cuda" and not inline:  # the profiled steps from a second, untimed run (prompt's first id changed)
        parts, steps = timer.totals, timer.steps
        timer.remove()
        timer = StepTimer(llm, (100, 120))
        llm.generate([[prompt[0] ^ 1, *prompt[1:]]], SamplingParams(temperature=0.0, max_tokens=n_out,
                                                                    ignore_eos=True), use_tqdm=False)
        timer.totals, timer.steps = parts, steps  # host parts of the timed run
    tps = len(out.output_token_ids) / seconds
    # Per token: every weight once + the KV of the context (128..640 tokens, small against the weights here).
    roof_s = (nums["weight_bytes"] + (128 + n_out / 2) * nums["kv_bytes_per_token"]) / ceil["copy_bw"]
    result = dict(fused_ops=fused, overlap_steps=llm.engine.overlap_steps, tokens_per_s=tps,
                  ms_per_token=1e3 / tps, roofline_tokens_per_s=1 / roof_s, roofline_ms=1e3 * roof_s,
                  fraction=tps * roof_s, weight_only_fraction=tps * nums["weight_bytes"] / ceil["copy_bw"],
                  parts_s={k: round(v, 3) for k, v in timer.totals.items()}, host_ms_per_step=timer.per_step_ms())
    if timer.prof is not None:
        result["profile"] = profile_summary(timer.prof, 20, timer.prof_wall, trace)
    timer.remove()
    del llm, out
    release_gpu(device)
    return result


def host_info() -> dict:
    """The host CPU this process may run on (model, cores it is pinned to), for the report."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(cpu_model=model, cpus_allowed=sorted(os.sched_getaffinity(0)), cpu_count=os.cpu_count())


def summary_line(label: str, name: str, v: str, res: dict) -> str:
    """One run: throughput, wall ms/step, GPU kernel ms/step (profiled window) and host ms/step by part."""
    prof = res.get("profile") or {}
    gpu = f"{prof['gpu_kernel_ms_per_step']:.2f}" if prof else "-"
    host = " ".join(f"{k}={v:.2f}" for k, v in res.get("host_ms_per_step", {}).items())
    return (f"{label} {name} [{v}]: {res['tokens_per_s']:.0f} tok/s, {res.get('fraction_of_roofline', 0):.1%} of "
            f"roofline, wall {res['ms_per_step']:.2f} ms/step, GPU kernels {gpu} ms/step (steps 300-320); "
            f"host ms/step: {host}")


def run_children(args, argv: list[str]) -> None:
    """One child process per (code, host) pair, one after the other on the same GPU: ``pinned`` runs under
    ``taskset -c <--pin-cpus>``; a code ``old=PATH`` puts PATH first on sys.path (an older checkout)."""
    import subprocess

    skip = {"--hosts", "--code", "--out"}
    child_argv, i = [], 0
    while i < len(argv):
        if argv[i] in skip:
            i += 2
            continue
        child_argv.append(argv[i])
        i += 1
    out = Path(args.out)
    labels = []
    for code in args.code.split(","):
        code, _, env_set = code.partition("@")  # NAME[=PATH][@VAR=VALUE]: an environment variable for the child
        name, _, root = code.partition("=")
        env = dict(os.environ)
        if env_set:
            var, _, value = env_set.partition("=")
            env[var] = value
        for host in args.hosts.split(","):
            label = f"{name}-{host}"
            cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv, "--child", label, "--out", str(out)]
            if root:
                cmd += ["--code-root", root]
            if host == "pinned":
                cmd = ["taskset", "-c", args.pin_cpus, *cmd]
            print(f"=== {label}{' ' + env_set if env_set else ''}: {' '.join(cmd)}", flush=True)
            rc = subprocess.call(cmd, env=env)
            print(f"=== {label}: exit {rc}", flush=True)
            labels.append(label)
    print("\n=== summary (each line one child process; same GPU, one after the other)")
    for label in labels:
        f = out / f"gpu_e2e_{label}.json"
        if not f.exists():
            print(f"{label}: no result")
            continue
        results = json.loads(f.read_text())
        h = results["host"]
        print(f"{label}: host {h['cpu_model']}, cpus {h['cpus_allowed']}")
        for name, r in results["models"].items():
            for v, res in r["pdpool"].items():
                print("  " + summary_line(label, name, v, res))
            for v, res in r.get("single_stream", {}).items():
                print(f"  {label} {name} single stream [{v}]: {res['tokens_per_s']:.1f} tok/s, "
                      f"{res['ms_per_token']:.2f} ms/token, {res['fraction']:.1%} of roofline; GPU kernels "
                      f"{(res.get('profile') or {}).get('gpu_kernel_ms_per_step', float('nan')):.2f} ms/step; "
                      f"host ms/step: {res['host_ms_per_step']}")
            if "hf_subset" in r:
                hf = r["hf_subset"]
                print(f"  {label} {name} HF {hf['tokens_per_s']:.0f} tok/s on the first requests; pdpool on the "
                      f"same {r.get('pdpool_subset', {}).get('tokens_per_s', float('nan')):.0f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="Qwen3-0.6B,Llama-3.1-8B")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="base,overlap,fused,both",
                    help=f"of {list(VARIANTS)}: (fused ops, overlapped steps); the last is the shipped default")
    ap.add_argument("--hf-requests", type=int, default=64, help="HF runs the first N requests in one batch")
    ap.add_argument("--hf-max-seconds", type=float, default=90.0)
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--single-stream", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-main", action="store_true", help="skip the 256-request runs (HF, single stream only)")
    ap.add_argument("--tiny", action="store_true", help="small configs and lengths: a CPU smoke test")
    ap.add_argument("--traces", action="store_true", help="write the single-stream chrome traces to --out")
    ap.add_argument("--hosts", default=None,
                    help="comma list of unpinned,pinned: one child process each (pinned: taskset -c --pin-cpus)")
    ap.add_argument("--pin-cpus", default="0,1")
    ap.add_argument("--profile-windows", default=[], type=lambda v: [tuple(int(x) for x in w.split("-"))
                                                                     for w in v.split(",") if w],
                    help="more profiled step windows A-B[,C-D] (steps A..B-1) beside 300-320, e.g. 2-6: the first "
                         "prefill chunks; each reports wall and GPU kernel ms per step")
    ap.add_argument("--step-trace", action="store_true",
                    help="CUDA events around every step: GPU idle before each step, its GPU time and its own "
                         "roofline, by bucket (prefill/mixed; decode by batch size); per-step rows to --out")
    ap.add_argument("--code", default="new",
                    help="with --hosts: comma list of NAME[=PATH][@VAR=VALUE] (PATH first on sys.path: another "
                         "checkout; VAR=VALUE set in the child's environment)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--code-root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.hosts and not args.child:
        run_children(args, sys.argv[1:])
        return
    if args.code_root:
        sys.path.insert(0, str(Path(args.code_root).resolve()))
    import torch

    import pdpool
    label = args.child or "run"
    variants = args.variants.split(",")
    ceil = measure_ceilings(args.device)
    host = host_info()
    print(f"[{label}] pdpool from {Path(pdpool.__file__).parent}; host {host['cpu_model']}, cpus "
          f"{host['cpus_allowed']}", flush=True)
    print(f"GPU {ceil['gpu']}: copy {ceil['copy_bw'] / 1e12:.2f} TB/s (read+write), "
          f"bf16 matmul {ceil['matmul_rate'] / 1e12:.0f} TFLOP/s", flush=True)
    results = dict(ceilings=ceil, torch=torch.__version__, host=host, pdpool=str(Path(pdpool.__file__).parent),
                   models={})
    tmp = Path(tempfile.mkdtemp(prefix="pdpool-e2e-"))
    tiny = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=10240) if args.tiny else None
    lines = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result_file = Path(args.out) / (f"gpu_e2e_{args.child}.json" if args.child else "gpu_e2e.json")
    for name in args.models.split(","):
        folder = model_folder(name, tmp, tiny)
        cfg = json.loads((folder / "config.json").read_text())
        nums = model_numbers(cfg)
        reqs = workload(args.num_requests, max_len=160 if args.tiny else 1024)
        roof = roofline(reqs, nums, ceil)
        r = results["models"][name] = dict(numbers=nums, roofline=roof, pdpool={})
        sub = reqs[:args.hf_requests]
        for fused in (False, True):
            todo = [v for v in variants if VARIANTS[v][0] == fused]
            if args.skip_main or not todo:
                continue
            llm = make_llm(folder, args.device, fused, max_num_seqs=len(reqs), max_num_batched_tokens=16384,
                           max_model_len=4096)
            for v in todo:
                trace = ((nums, ceil, Path(args.out) / f"steps_{label}_{name}_{v}.json") if args.step_trace
                         else None)
                res = r["pdpool"][v] = run_pdpool(llm, reqs, args.device, overlap=VARIANTS[v][1],
                                                  profile=v in ("base", variants[-1]),
                                                  more_windows=tuple(args.profile_windows), step_trace=trace)
                res["fraction_of_roofline"] = res["tokens_per_s"] / roof["tokens_per_s"]
                line = (summary_line(label, name, v, res) + f" (roofline {roof['tokens_per_s']:.0f} tok/s); "
                        f"launch/run per call {res['launch_calls']}; stalls (part, step, ms, alloc retries) "
                        f"{res['stalls']}")
                print(line, flush=True)
                lines.append(line)
                if "profile" in res:
                    print(json.dumps(res["profile"]), flush=True)
                if "step_trace" in res:
                    print(f"{label} {name} [{v}] step trace: {json.dumps(res['step_trace'])}", flush=True)
                for key in (k for k in res if k.startswith("profile_steps_")):
                    p = res[key]
                    print(f"{label} {name} [{v}] {key}: wall {p['wall_ms_per_step']:.1f} ms/step, GPU kernels "
                          f"{p['gpu_kernel_ms_per_step']:.1f} ms/step; top {p['top_kernels'][:6]}", flush=True)
            if fused == VARIANTS[variants[-1]][0] and not args.skip_hf:  # pdpool as shipped on HF's subset
                r["pdpool_subset"] = run_pdpool(llm, sub, args.device, overlap=VARIANTS[variants[-1]][1])
            llm = None
            release_gpu(args.device)
        if not args.skip_hf:
            r["hf_subset"] = hf = run_hf(folder, sub, args.device, args.hf_max_seconds)
            best = r["pdpool"].get(variants[-1], {}).get("tokens_per_s")
            line = (f"{label} {name} HF transformers {hf['transformers']} ({hf['mode']}, first {len(sub)} "
                    f"requests, {hf['steps']}/{hf['longest']} steps in {hf['seconds']:.1f} s): "
                    f"{hf['tokens_per_s']:.0f} tok/s")
            if "pdpool_subset" in r:
                line += (f"; pdpool on the same {len(sub)}: {r['pdpool_subset']['tokens_per_s']:.0f} tok/s "
                         f"({r['pdpool_subset']['tokens_per_s'] / hf['tokens_per_s']:.1f}x)")
            if best:
                line += f"; pdpool on all {len(reqs)}: {best / hf['tokens_per_s']:.1f}x"
            print(line, flush=True)
            lines.append(line)
        if args.single_stream and name.startswith("Llama"):
            r["single_stream"] = {}
            for v in variants:
                fused, overlap = VARIANTS[v]
                trace = (Path(args.out) / f"single_stream_{label}_{v}.json"
                         if args.traces and v in ("base", variants[-1]) else None)
                s = r["single_stream"][v] = run_single_stream(folder, args.device, nums, ceil, fused, overlap,
                                                              trace=trace)
                line = (f"{label} {name} single stream [{v}]: {s['tokens_per_s']:.1f} tok/s "
                        f"({s['ms_per_token']:.2f} ms/token; roofline {s['roofline_ms']:.2f} ms), "
                        f"{s['fraction']:.1%} of roofline; host ms/step {s['host_ms_per_step']}")
                print(line, flush=True)
                lines.append(line)
                if "profile" in s:
                    print(json.dumps(s["profile"]), flush=True)
        result_file.write_text(json.dumps(results, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
