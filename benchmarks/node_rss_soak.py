"""A node's memory under load: N completions of random prompt lengths and max_tokens against one `pdpool serve`
node process, its RSS sampled every K requests; a table of RSS vs requests served and vs the distinct step shapes
the node has run so far.

    .venv/bin/python benchmarks/node_rss_soak.py [--requests 500] [--every 100] [--concurrency 4]
        [--prompt-lens random|fixed] [--max-prompt 600] [--max-tokens 64] [--num-threads 1] [--trim]
        [--env ONEDNN_PRIMITIVE_CACHE_CAPACITY=16] [--serve-args '--max-num-seqs 8'] [--seed 0] [--idle-wait 3]

The node runs as `python -c <shim> serve --model demo ...` (the shim is below): the usual CLI, plus a daemon
thread that writes, twice a second, the counts of distinct step token counts T (`ModelRunner.run`'s input rows) and
of distinct row counts per GEMM path (cpu_linear's native <= 32 rows, oneDNN-packed <= 128, F.linear above), and
that calls glibc's `malloc_trim(0)` when asked (`--trim`: the table then also shows RSS after a trim at each
sample, so freed-but-kept heap and memory that is really held can be told apart). `--idle-wait S` reads RSS once
more after S seconds with no request: the node trims its heap by itself once idle (`HEAP_TRIM_IDLE_SECONDS`). RSS is
read from the outside: /proc/<pid>/status VmRSS and /proc/<pid>/smaps_rollup Anonymous.

Prompts are random token ids (no prefix-cache hits, no tokenizer caches): `random` draws each prompt length from
1..--max-prompt and max_tokens from 1..--max-tokens; `fixed` draws the prompt length from {64, 128, 256} and uses
max_tokens = 16, so the step shapes repeat. Every ~25th request is one the node must refuse (max_tokens beyond the
model length) and every ~20th is a streamed one the client drops after its first chunk, as in the soak that first
saw the growth. Environment knobs for the node (`--env K=V`, repeatable) test one hypothesis at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdpool.node_process import NodeProcess  # noqa: E402

SHIM = r"""
import ctypes, json, os, sys, threading, time
stats_path, trim_path = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
from pdpool.engine import model_runner as _mr
from pdpool.models import cpu_linear as _cl
steps, paths = set(), {"native": set(), "packed": set(), "f_linear": set()}
_run = _mr.ModelRunner.run
def run(self, inputs):
    steps.add(int(inputs.input_ids.shape[0]))
    return _run(self, inputs)
_mr.ModelRunner.run = run
_call = _cl.PackedWeight.__call__
def call(self, x):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows and x.device.type == "cpu" and x.dtype == self.weight.dtype:
        if self.native and rows <= _cl.NATIVE_MAX_ROWS:
            paths["native"].add(rows)
        elif self.packs and rows <= _cl.PACKED_MAX_ROWS:
            paths["packed"].add(rows)
        else:
            paths["f_linear"].add(rows)
    return _call(self, x)
_cl.PackedWeight.__call__ = call
libc = ctypes.CDLL("libc.so.6")
def dump():
    while True:
        trimmed = False
        if os.path.exists(trim_path):
            libc.malloc_trim(0)
            os.unlink(trim_path)
            trimmed = True
        doc = {"steps": len(steps), "max_step": max(steps, default=0),
               **{k: len(v) for k, v in paths.items()}, "trimmed": trimmed, "t": time.time()}
        with open(stats_path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(stats_path + ".tmp", stats_path)
        time.sleep(0.5)
threading.Thread(target=dump, daemon=True, name="rss-soak-stats").start()
from pdpool.cli import main
sys.exit(main(sys.argv[1:]))
"""


def read_kb(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def memory(pid: int) -> tuple[float, float]:
    """(VmRSS, Anonymous) in MiB."""
    return read_kb(f"/proc/{pid}/status", "VmRSS") / 1024, read_kb(f"/proc/{pid}/smaps_rollup", "Anonymous") / 1024


def threads(pid: int) -> int:
    return read_kb(f"/proc/{pid}/status", "Threads")


class Client:
    def __init__(self, url: str, args, vocab: int = 49152):
        self.url, self.args, self.vocab = url, args, vocab
        self.lock = threading.Lock()
        self.ok = self.refused = self.dropped = self.errors = 0

    def request(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + i)
        if self.args.prompt_lens == "fixed":
            n, max_tokens = rng.choice((64, 128, 256)), 16
        else:
            n, max_tokens = rng.randint(1, self.args.max_prompt), rng.randint(1, self.args.max_tokens)
        prompt = [rng.randrange(100, self.vocab) for _ in range(n)]
        kind = "bad" if i % 25 == 24 else "drop" if i % 20 == 19 else "ok"
        body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice((0.0, 0.8)),
                "ignore_eos": True}
        if kind == "bad":
            body["max_tokens"] = 10**6
        if kind == "drop":
            body["stream"] = True
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                if kind == "drop":
                    resp.readline()  # the first chunk, then the client leaves
                    result = "dropped"
                else:
                    resp.read()
                    result = "ok"
        except urllib.error.HTTPError as exc:
            exc.read()
            result = "refused" if kind == "bad" and 400 <= exc.code < 500 else "errors"
        except OSError:
            result = "errors"
        with self.lock:
            setattr(self, result, getattr(self, result) + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--every", type=int, default=100, help="sample the node's memory every this many requests")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-lens", choices=("random", "fixed"), default="random")
    ap.add_argument("--max-prompt", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=1, help="the node's torch threads (pdpool up: 1 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trim", action="store_true", help="also show RSS after malloc_trim(0) at each sample")
    ap.add_argument("--idle-wait", type=float, default=0.0,
                    help="also read RSS after this many idle seconds at each sample (the node's own idle trim)")
    ap.add_argument("--env", action="append", default=[], help="K=V for the node's environment (repeatable)")
    ap.add_argument("--serve-args", default="", help="more flags for pdpool serve")
    ap.add_argument("--out", default=None, help="folder for the node's log (default: a temp one)")
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="node-rss-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    stats_path, trim_path = out / "stats.json", out / "trim"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    node = NodeProcess("node")
    argv = ["serve", "--model", "demo", "--host", "127.0.0.1", "--port", str(node.port), "--num-threads",
            str(args.num_threads), *shlex.split(args.serve_args)]
    log = open(out / "node.log", "ab")
    node.proc = subprocess.Popen([sys.executable, "-c", SHIM, str(stats_path), str(trim_path), *argv], cwd=ROOT,
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    node.log_path = out / "node.log"
    pid = node.proc.pid

    def stats() -> dict:
        time.sleep(0.6)  # one more write of the shim's thread
        return json.loads(stats_path.read_text())

    def trimmed_rss() -> float:
        trim_path.touch()
        deadline = time.monotonic() + 10
        while trim_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return memory(pid)[0]

    rows = []
    try:
        t0 = time.monotonic()
        node.wait_ready(600)
        print(f"node pid {pid} ready in {time.monotonic() - t0:.0f} s; env {' '.join(args.env) or '(default)'}; "
              f"{args.requests} requests, {args.prompt_lens} lengths, concurrency {args.concurrency}; log {out}",
              flush=True)
        client = Client(node.url, args)

        def sample(done: int, elapsed: float) -> None:
            rss, anon = memory(pid)
            s = stats()
            row = {"requests": done, "s": elapsed, "rss": rss, "anon": anon, "threads": threads(pid), **s}
            if args.idle_wait:
                time.sleep(args.idle_wait)
                row["rss_idle"] = memory(pid)[0]
            if args.trim:
                row["rss_trim"] = trimmed_rss()
            rows.append(row)
            print(f"  {done:>6} req {elapsed:>6.0f} s  RSS {rss:7.1f}  anon {anon:7.1f} MiB"
                  + (f"  idle {row['rss_idle']:7.1f}" if args.idle_wait else "")
                  + (f"  trimmed {row['rss_trim']:7.1f}" if args.trim else "")
                  + f"  step shapes {s['steps']:>4}  rows native/packed/F.linear "
                  f"{s['native']}/{s['packed']}/{s['f_linear']}  threads {row['threads']}", flush=True)

        # one request first: the node's memory once it has served (lazy start-up work done)
        client.request(0)
        sample(1, 0.0)
        t1 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            done = 1
            while done < args.requests:
                n = min(args.every - done % args.every, args.requests - done)
                list(pool.map(client.request, range(done, done + n)))
                done += n
                sample(done, time.monotonic() - t1)
        wall = time.monotonic() - t1
        print(f"\nnode_rss_soak: {args.requests} requests in {wall:.0f} s ({args.requests / wall:.2f} req/s), "
              f"ok {client.ok}, dropped streams {client.dropped}, refused {client.refused}, errors {client.errors}; "
              f"env {' '.join(args.env) or '(default)'}; serve args '{args.serve_args}'; "
              f"{args.num_threads} torch threads")
        head = (f"{'requests':>9}{'RSS MiB':>9}{'anon MiB':>9}" + (f"{'idle':>9}" if args.idle_wait else "")
                + (f"{'trimmed':>9}" if args.trim else "")
                + f"{'dRSS':>7}{'steps T':>8}{'native':>7}{'packed':>7}{'F.lin':>7}")
        print(head)
        base = rows[0]["rss"]
        for r in rows:
            print(f"{r['requests']:>9}{r['rss']:>9.1f}{r['anon']:>9.1f}"
                  + (f"{r['rss_idle']:>9.1f}" if args.idle_wait else "")
                  + (f"{r['rss_trim']:>9.1f}" if args.trim else "")
                  + f"{r['rss'] - base:>+7.0f}{r['steps']:>8}{r['native']:>7}{r['packed']:>7}{r['f_linear']:>7}")
        if len(rows) > 2:
            half = rows[len(rows) // 2]
            last = rows[-1]
            per = (last["rss"] - half["rss"]) * 1024 / max(1, last["requests"] - half["requests"])
            print(f"second half: {per:+.1f} KiB per request ({half['requests']} -> {last['requests']})")
        (out / "rows.json").write_text(json.dumps(rows, indent=1))
    finally:
        node.stop(grace=30)
        log.close()


if __name__ == "__main__":
    main()
