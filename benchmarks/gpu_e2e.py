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
weight_bytes / copy_bw per token.

    python3 benchmarks/gpu_e2e.py [--models Qwen3-0.6B,Llama-3.1-8B] [--hf-requests 32] [--single-stream]
    python3 benchmarks/gpu_e2e.py --device cpu --tiny   # CPU smoke test of the script itself
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

class StepTimer:
    """Wall time of the engine's parts during one generate (wraps bound methods of one engine instance)."""

    def __init__(self, llm, profile_steps: tuple[int, int] | None = None):
        self.totals: dict[str, float] = {}
        self.steps = 0
        self.profile_steps, self.prof = profile_steps, None
        eng = llm.engine
        self._wrap(eng.scheduler, "schedule")
        self._wrap(eng.scheduler, "update_from_output")
        self._wrap(eng.runner, "prepare_inputs")
        self._wrap(eng.runner, "run")
        self._wrap(eng.runner.sampler, "sample")
        self._wrap(eng, "_make_output")
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
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
        setattr(obj, name, timed)

    def _count(self):
        n = self.steps
        if self.profile_steps and n == self.profile_steps[0]:
            import torch
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
        if self.prof is not None and self.profile_steps and n == self.profile_steps[1]:
            self.prof.__exit__(None, None, None)
            self.profile_steps = None
        self.steps += 1


def run_pdpool(folder: Path, reqs, device: str, *, max_num_seqs: int, profile: bool = False,
               enforce_eager: bool = False, temperature: float = 0.6) -> dict:
    import torch

    from pdpool import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16" if device == "cuda" else "float32", device=device,
              load_format="dummy", max_num_seqs=max_num_seqs, max_num_batched_tokens=16384, max_model_len=4096,
              enforce_eager=enforce_eager)
    load_s = time.perf_counter() - t0
    params = lambda rs: [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True)  # noqa: E731
                         for _, o in rs]
    warm = [p for p, _ in reqs[:4]]
    llm.generate(warm, [SamplingParams(max_tokens=8, ignore_eos=True)] * len(warm), use_tqdm=False)
    timer = StepTimer(llm, (300, 310) if profile and device == "cuda" else None)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params(reqs), use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.output_token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs), "ignore_eos requests must produce exactly max_tokens"
    result = dict(seconds=seconds, output_tokens=tokens, tokens_per_s=tokens / seconds, load_s=load_s,
                  steps=timer.steps, parts_s={k: round(v, 3) for k, v in timer.totals.items()},
                  num_kv_blocks=llm.engine.runner.num_blocks,
                  cuda_graphs=llm.engine.runner.graphs is not None,
                  graph_replays=getattr(llm.engine.runner.graphs, "num_replays", None),
                  attention=llm.engine.runner.backend.name,
                  preemptions=llm.engine.scheduler.num_preemptions)
    if timer.prof is not None:
        result["profile_top"] = timer.prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                                                 max_name_column_width=60)
    del llm, outs, timer  # the timer's wrappers hold the engine: drop them too, or the KV cache stays
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


# --- HF transformers ------------------------------------------------------------------------------------------

def run_hf(folder: Path, reqs, device: str) -> dict:
    """Continuous batching (``init_continuous_batching``) where the installed transformers has it, else padded
    static batches of 16 grouped by output length. Random init (throughput does not depend on the values)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    out_tokens = sum(o for _, o in reqs)
    gen_cfg = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, max_new_tokens=max(o for _, o in reqs),
                          eos_token_id=None, pad_token_id=0)
    mode, err = "continuous batching (init_continuous_batching)", None
    try:
        if device != "cuda" or not hasattr(model, "init_continuous_batching"):
            raise RuntimeError("no continuous batching")
        manager = model.init_continuous_batching(generation_config=gen_cfg)
        manager.start()
        try:
            t0 = time.perf_counter()
            for i, (p, o) in enumerate(reqs):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=o)
            done, got = 0, 0
            while done < len(reqs):
                res = manager.get_result(timeout=30)
                if res is None:
                    raise RuntimeError("continuous batching produced nothing for 30 s")
                if res.is_finished():
                    done += 1
                    got += len(res.generated_tokens)
            seconds = time.perf_counter() - t0
        finally:
            manager.stop(block=True)
        if got != out_tokens:
            raise RuntimeError(f"continuous batching returned {got} tokens, expected {out_tokens}")
    except Exception as e:  # fall back to static batches; say why
        err = f"{type(e).__name__}: {e}"
        mode = "padded static batches of 16, grouped by output length"
        seconds = _hf_static(model, reqs, device)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(mode=mode, fallback_reason=err, seconds=seconds, output_tokens=out_tokens,
                tokens_per_s=out_tokens / seconds, load_s=load_s)


def _hf_static(model, reqs, device) -> float:
    import torch

    reqs = sorted(reqs, key=lambda r: r[1])
    t0 = time.perf_counter()
    for start in range(0, len(reqs), 16):
        batch = reqs[start:start + 16]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                           temperature=0.6, top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# --- single stream ---------------------------------------------------------------------------------------------

def run_single_stream(folder: Path, device: str, nums: dict, ceil: dict, n_out: int = 512) -> dict:
    import torch

    from pdpool import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16" if device == "cuda" else "float32", device=device, load_format="dummy",
              max_num_seqs=8, max_model_len=4096, gpu_memory_utilization=0.5)
    prompt = random.Random(1).choices(range(100, 10000), k=128)
    llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True),
                       use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    tps = len(out.output_token_ids) / seconds
    # Per token: every weight once + the KV of the context (128..640 tokens, small against the weights here).
    roof_s = (nums["weight_bytes"] + (128 + n_out / 2) * nums["kv_bytes_per_token"]) / ceil["copy_bw"]
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(tokens_per_s=tps, ms_per_token=1e3 / tps, roofline_tokens_per_s=1 / roof_s,
                fraction=tps * roof_s, weight_only_fraction=tps * nums["weight_bytes"] / ceil["copy_bw"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="Qwen3-0.6B,Llama-3.1-8B")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hf-requests", type=int, default=32, help="HF runs the first N requests (time budget)")
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--single-stream", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-main", action="store_true", help="skip the 256-request run (HF ratio, single stream only)")
    ap.add_argument("--tiny", action="store_true", help="small configs and lengths: a CPU smoke test")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch

    ceil = measure_ceilings(args.device)
    print(f"GPU {ceil['gpu']}: copy {ceil['copy_bw'] / 1e12:.2f} TB/s (read+write), "
          f"bf16 matmul {ceil['matmul_rate'] / 1e12:.0f} TFLOP/s", flush=True)
    results = dict(ceilings=ceil, torch=torch.__version__, models={})
    tmp = Path(tempfile.mkdtemp(prefix="pdpool-e2e-"))
    tiny = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=10240) if args.tiny else None
    for name in args.models.split(","):
        folder = model_folder(name, tmp, tiny)
        cfg = json.loads((folder / "config.json").read_text())
        nums = model_numbers(cfg)
        reqs = workload(args.num_requests, max_len=160 if args.tiny else 1024)
        r = results["models"][name] = dict(numbers=nums, roofline=roofline(reqs, nums, ceil))
        if not args.skip_main:
            r["pdpool"] = run_pdpool(folder, reqs, args.device, max_num_seqs=len(reqs), profile=True)
            r["fraction_of_roofline"] = r["pdpool"]["tokens_per_s"] / r["roofline"]["tokens_per_s"]
        if not args.skip_main:
            print(f"{name}: pdpool {r['pdpool']['tokens_per_s']:.0f} tok/s ({r['pdpool']['seconds']:.2f} s), "
              f"roofline {r['roofline']['tokens_per_s']:.0f} tok/s -> {r['fraction_of_roofline']:.1%}; "
              f"parts {r['pdpool']['parts_s']}", flush=True)
        if "profile_top" in r.get("pdpool", {}):
            print(r["pdpool"]["profile_top"], flush=True)
        if not args.skip_hf:
            sub = reqs[:args.hf_requests]
            r["pdpool_subset"] = run_pdpool(folder, sub, args.device, max_num_seqs=len(reqs))
            r["hf_subset"] = run_hf(folder, sub, args.device)
            r["speedup_vs_hf"] = r["pdpool_subset"]["tokens_per_s"] / r["hf_subset"]["tokens_per_s"]
            print(f"{name}: first {len(sub)} requests: pdpool {r['pdpool_subset']['tokens_per_s']:.0f} tok/s, "
                  f"HF {r['hf_subset']['tokens_per_s']:.0f} tok/s ({r['hf_subset']['mode']}; "
                  f"{r['hf_subset']['fallback_reason']}) -> {r['speedup_vs_hf']:.1f}x", flush=True)
        if args.single_stream and name.startswith("Llama"):
            r["single_stream"] = run_single_stream(folder, args.device, nums, ceil)
            s = r["single_stream"]
            print(f"{name} single stream: {s['tokens_per_s']:.1f} tok/s ({s['ms_per_token']:.2f} ms/token), "
                  f"{s['fraction']:.1%} of roofline ({s['weight_only_fraction']:.1%} of weights-only)", flush=True)
        (Path(args.out) / "gpu_e2e.json").write_text(json.dumps(results, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("numbers",)} for k, v in
                      results["models"].items()}, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
