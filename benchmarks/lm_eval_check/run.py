"""lm-evaluation-harness against pdpool: three tiny local tasks (20 multiple-choice items scored by
loglikelihood, 10 greedy generations with stop strings, 5 paragraphs and one 4484-token text scored by
loglikelihood_rolling) run with lm_eval's ``local-completions`` against a pdpool router, and
with lm_eval's ``hf`` model on the same demo folder as the reference; then per-item loglikelihoods side by side.

lm_eval is a client only, never a pdpool dependency: install it in its own venv, e.g.

    python3 -m venv /tmp/lmeval-venv
    /tmp/lmeval-venv/bin/pip install "lm_eval[api,hf]==0.4.13"

Run from anywhere with pdpool's venv (it starts ``pdpool up`` itself unless --url is given):

    .venv/bin/python benchmarks/lm_eval_check/run.py [--url http://127.0.0.1:8000/v1] [--port 8011]
        [--lm-eval /tmp/lmeval-venv/bin/lm_eval] [--out /tmp/lmeval-out] [--skip-hf]

The pool it starts is float32 (``-- --dtype float32``), like the hf reference (``--dtype bfloat16``: both
bf16). Nothing downloads from the hub:
HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set, the data are local JSONL files.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TASKS = "pdpool_mc,pdpool_gen,pdpool_ppl,pdpool_ppl_long"


def demo_folder() -> str:
    from pdpool.models.demo import resolve_model
    return str(resolve_model("demo"))


def wait_ready(url: str, timeout: float = 600) -> None:
    body = json.dumps({"model": "demo", "prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            req = urllib.request.Request(url + "/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(2)
    raise SystemExit(f"pool at {url} not ready after {timeout:.0f}s")


def run_lm_eval(lm_eval: str, model: str, model_args: str, out: Path, extra: list[str] | None = None) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [lm_eval, "run", "--model", model, "--model_args", model_args, "--tasks", TASKS,
           "--include_path", str(HERE), "--log_samples", "--output_path", str(out), *(extra or [])]
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return time.time() - t0


def load_samples(out: Path, task: str) -> dict[int, dict]:
    files = sorted(f for f in glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
                   if re.fullmatch(rf"samples_{task}_\d{{4}}-.*\.jsonl", os.path.basename(f)))   # not pdpool_ppl_long
    if not files:
        raise SystemExit(f"no samples for {task} under {out}")
    with open(files[-1]) as f:
        return {s["doc_id"]: s for s in map(json.loads, f)}


def load_results(out: Path) -> dict:
    files = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    with open(files[-1]) as f:
        return json.load(f)["results"]


def compare(runs: dict[str, Path], ref: str | None) -> None:
    print("\n== metrics")
    names = list(runs)
    res = {n: load_results(p) for n, p in runs.items()}
    print(f"{'metric':32s}" + "".join(f"{n:>22s}" for n in names))
    for task, metric in (("pdpool_mc", "acc,none"), ("pdpool_mc", "acc_norm,none"), ("pdpool_gen", "exact_match,strip"),
                         ("pdpool_ppl", "word_perplexity,none"), ("pdpool_ppl", "bits_per_byte,none"),
                         ("pdpool_ppl_long", "word_perplexity,none"), ("pdpool_ppl_long", "bits_per_byte,none")):
        print(f"{task + ' ' + metric:32s}" + "".join(f"{res[n][task].get(metric, float('nan')):>22.5f}" for n in names))
    if ref is None:
        return
    print(f"\n== per-item loglikelihoods against {ref} (pdpool_mc: 20 items x 4 choices)")
    ref_mc = load_samples(runs[ref], "pdpool_mc")
    ref_gen = load_samples(runs[ref], "pdpool_gen")
    for n in names:
        if n == ref:
            continue
        mc = load_samples(runs[n], "pdpool_mc")
        diffs, argmax_same, greedy_same = [], 0, 0
        for doc_id, s in ref_mc.items():
            a = s["filtered_resps"]              # per choice: [loglikelihood, is_greedy], as strings
            b = mc[doc_id]["filtered_resps"]
            diffs += [abs(float(x[0]) - float(y[0])) for x, y in zip(a, b)]
            argmax_same += max(range(len(a)), key=lambda i: float(a[i][0])) == max(range(len(b)), key=lambda i: float(b[i][0]))
            greedy_same += sum(x[1] == y[1] for x, y in zip(a, b))
        rolling = {}
        for task in ("pdpool_ppl", "pdpool_ppl_long"):
            ppl, ref_ppl = load_samples(runs[n], task), load_samples(runs[ref], task)
            rolling[task] = [abs(float(ppl[d]["resps"][0][0]) - float(s["resps"][0][0])) for d, s in ref_ppl.items()]
        gen = load_samples(runs[n], "pdpool_gen")
        same_text = sum(gen[d]["filtered_resps"] == s["filtered_resps"] for d, s in ref_gen.items())
        print(f"{n:22s} max |dlogL| {max(diffs):.2e}  mean {sum(diffs) / len(diffs):.2e}  "
              f"argmax equal {argmax_same}/{len(ref_mc)}  is_greedy equal {greedy_same}/{len(diffs)}  "
              f"generations equal {same_text}/{len(ref_gen)}  rolling |dlogL| of a text: 5 short max "
              f"{max(rolling['pdpool_ppl']):.2e}, the long one {rolling['pdpool_ppl_long'][0]:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running pool's /v1 URL (default: start `pdpool up` on --port)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--lm-eval", default="/tmp/lmeval-venv/bin/lm_eval")
    ap.add_argument("--out", default="/tmp/lmeval-out")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the started pool's and the hf reference's dtype")
    ap.add_argument("--skip-hf", action="store_true", help="skip the hf reference run")
    ap.add_argument("--configs", default="tok,text,tok-batch4",
                    help="local-completions variants: tok (token-id prompts), text (string prompts), "
                         "tok-batch4 (4 token-id prompts a request); empty: only the hf run")
    ap.add_argument("--compare-only", action="store_true", help="only compare the runs already under --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.compare_only:
        runs = {p.name: p for p in sorted(out.iterdir()) if p.is_dir()}
        ref = next((n for n in runs if n.startswith("hf")), None)
        return compare(runs, ref)
    demo = demo_folder()
    REF = "hf-fp32" if args.dtype == "float32" else "hf-bf16"
    up = None
    url = args.url
    if url is None and args.configs:
        url = f"http://127.0.0.1:{args.port}/v1"
        up = subprocess.Popen([str(ROOT / ".venv/bin/pdpool"), "up", "--port", str(args.port), "--", "--dtype", args.dtype],
                              cwd=ROOT, stdout=open(out.parent / f"pdpool-up-{args.port}.log", "w"),
                              stderr=subprocess.STDOUT)
        print(f"pdpool up pid {up.pid} (log {out.parent}/pdpool-up-{args.port}.log)", flush=True)
    runs: dict[str, Path] = {}
    times: dict[str, float] = {}
    try:
        if args.configs:
            wait_ready(url)
        base = f"model=demo,base_url={url}/completions,tokenizer={demo},tokenizer_backend=huggingface," \
               f"num_concurrent=2,max_retries=1,max_length=3002"
        variants = {   # name: (model_args, extra CLI flags)
            "tok": (base + ",tokenized_requests=True", []),
            "text": (base + ",tokenized_requests=False", []),
            "tok-batch4": (base + ",tokenized_requests=True", ["--batch_size", "4"]),
        }
        for name in filter(None, args.configs.split(",")):
            model_args, extra = variants[name]
            runs[f"pdpool-{name}"] = out / f"pdpool-{name}"
            times[f"pdpool-{name}"] = run_lm_eval(args.lm_eval, "local-completions", model_args,
                                                  runs[f"pdpool-{name}"], extra)
    finally:
        if up is not None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=120)
            except subprocess.TimeoutExpired:
                up.send_signal(signal.SIGTERM)   # a second signal kills everything at once
                up.wait(timeout=30)
    if not args.skip_hf:
        runs[REF] = out / REF
        times[REF] = run_lm_eval(args.lm_eval, "hf", f"pretrained={demo},dtype={args.dtype},max_length=3000",
                                 runs[REF], ["--batch_size", "1", "--device", "cpu"])
    print("\n== wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    compare(runs, REF if REF in runs else None)


if __name__ == "__main__":
    sys.exit(main())
