"""Structured output on the GPU: correctness and the cost per decode step, in one run.

A random small Llama checkpoint (4 layers, hidden 1024) with the demo model's byte-level BPE tokenizer (49152 ids),
so llguidance's JSON, regex and grammar constraints have real tokens to work with. Checks, fp32, CUDA graphs on:

1. Every constrained output of a mixed batch (JSON schema, JSON object, regex, choice, Lark grammar; greedy and
   seeded random rows) is accepted by a fresh llguidance matcher of its constraint (complete when it stopped).
2. The overlapped step loop (CUDA's default) gives the plain loop's tokens, constrained rows included.
3. Plain rows in that batch give the tokens they give alone.
4. CUDA against the CPU: the same greedy constrained outputs (reported; random-weight near-ties may flip).

Then the cost: 64 rows decoding 128 tokens, all plain against all under a JSON schema (the same prompts, greedy):
wall ms per decode step for each, under two open-ended schemas (a list of strings; a list of small records);
llguidance's mask work runs on the host, per row and step, while the GPU runs the step's forward.

    python3 benchmarks/gpu_structured_check.py [--tokenizer DIR] [--skip-cpu]

``--tokenizer``: a folder with ``tokenizer.json`` and ``tokenizer_config.json`` (default: the demo model's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_correctness import SMALL_LLAMA, save_checkpoint  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
# The cost runs' schemas, open-ended so rows keep going: free text inside JSON strings (llguidance's costliest
# masks: nearly every token is allowed and checked), and records of an integer and a boolean (mostly forced tokens).
LIST = {"type": "array", "items": {"type": "string"}}
RECORDS = {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
                                      "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}}}}
CONSTRAINTS = [{"json": PERSON}, {"json_object": True, "disable_any_whitespace": True},
               {"regex": "[0-9]{3}-[a-z]{2,4}"}, {"choice": ["alpha", "beta", "gamma"]},
               {"grammar": 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'}, {"regex": "(ab|cd)+!"}]
PROMPTS = ["Describe a person:", "Some JSON:", "A product code:", "Pick one:", "Is the sky blue?", "Letters:",
           "The ocean is", "Once upon a time"]


def build(folder: Path, tokenizer: Path, device: str) -> Path:
    save_checkpoint({**SMALL_LLAMA, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}, folder, device)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    for stale in ("special_tokens_map.json",):
        (folder / stale).unlink(missing_ok=True)
    return folder


def params_for(i: int, structured: dict | None, max_tokens: int = 40):
    from pdpool import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                          structured_outputs=structured)


def accepted(llm, structured: dict, token_ids: list[int], finished: str) -> bool:
    """A fresh matcher of the constraint takes every id (EOS aside) and, when the row stopped, is complete."""
    import llguidance

    from pdpool.engine.structured import StructuredOutputs

    compiled = llm.frontend.grammars.compile(StructuredOutputs.parse(structured))
    m = llguidance.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
    ids = [t for t in token_ids if t not in llm.frontend.eos_token_ids]
    if not m.consume_tokens(ids):
        return False
    return m.is_accepting() if finished == "stop" else True


def run(llm, prompts, params, overlap: bool | None = None):
    if overlap is not None:
        llm.engine.overlap_steps = overlap
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def decode_ms(llm, structured: dict | None, rows: int = 64, tokens: int = 128) -> tuple[float, int]:
    """Wall ms per step of ``rows`` requests decoding up to ``tokens`` tokens (timed from the first output on, so
    the prefill step is left out), and the tokens generated meanwhile."""
    from pdpool import SamplingParams

    prompts = [f"Record {i}: a person described as JSON:" for i in range(rows)]
    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=structured is None,
                             structured_outputs=structured) for _ in prompts]
    engine, processor = llm.engine, llm.output_processor
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ids = llm.frontend.encode_prompt(p)
        llm.frontend.apply_prompt_options(ids, sp, engine.max_model_len)
        engine.add_request(f"t{structured is not None}-{i}", ids, sp)
        processor.add(f"t{structured is not None}-{i}", p, ids, sp)
    steps, start, generated = 0, None, 0
    while engine.has_unfinished_requests():
        outputs, stopped = processor.process(engine.step())
        engine.abort_request(stopped)
        new = sum(len(o.new_token_ids) for o in outputs)
        if start is None and new:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start, steps = time.perf_counter(), 0
            continue
        steps += 1
        generated += new
    return (time.perf_counter() - start) * 1e3 / max(steps, 1), generated


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="only the cost run, under cProfile (top functions)")
    args = ap.parse_args()
    if args.tokenizer is None:
        from pdpool.models.demo import resolve_model

        args.tokenizer = str(resolve_model("demo"))
    import torch

    from pdpool import LLM

    dev = args.device
    report: dict = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "small", Path(args.tokenizer), dev)
        llm = LLM(str(folder), device=dev, dtype="float32", max_num_seqs=64, max_model_len=512,
                  num_kv_blocks=4096)
        if args.profile:
            import cProfile
            import pstats

            decode_ms(llm, {"json": LIST}, args.rows, 16)   # warm-up
            prof = cProfile.Profile()
            prof.enable()
            print("json ms/step", decode_ms(llm, {"json": LIST}, args.rows, args.tokens))
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return 0
        params = [params_for(i, c) for i, c in enumerate(CONSTRAINTS)] + [params_for(6, None), params_for(7, None)]
        overlapped = run(llm, PROMPTS, params, overlap=True)
        plain = run(llm, PROMPTS, params, overlap=False)
        alone = run(llm, PROMPTS[6:], params[6:], overlap=True)
        report["outputs"] = [{"constraint": c, "text": t, "finish": f} for c, (_, t, f)
                             in zip(CONSTRAINTS + [None, None], overlapped)]
        ok = [accepted(llm, c, ids, f) for c, (ids, _, f) in zip(CONSTRAINTS, overlapped)]
        report["check1_accepted"] = ok
        if not all(ok):
            failures.append("1: an output its constraint does not accept")
        report["check2_overlapped_equals_plain"] = overlapped == plain
        if overlapped != plain:
            failures.append("2: overlapped != plain")
        report["check3_plain_rows_as_alone"] = overlapped[6:] == alone
        if overlapped[6:] != alone:
            failures.append("3: a plain row changed beside constrained rows")
        if not args.skip_cpu:
            cpu = LLM(str(folder), device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=512)
            greedy = [i for i in range(len(CONSTRAINTS)) if i % 2 == 0]
            on_cpu = run(cpu, [PROMPTS[i] for i in greedy], [params_for(i, CONSTRAINTS[i]) for i in greedy])
            report["check4_cpu_equals_cuda_greedy"] = [on_cpu[j][0] == overlapped[i][0] for j, i in enumerate(greedy)]
            del cpu
        cost = {}
        for name, so in (("plain", None), ("json_strings", {"json": LIST}), ("json_records", {"json": RECORDS}),
                         ("plain_again", None)):
            ms, tokens = decode_ms(llm, so, args.rows, args.tokens)
            cost[name] = {"ms_per_step": round(ms, 3), "tokens": tokens}
        report[f"decode_{args.rows}_rows"] = cost
    report["failures"] = failures
    print(json.dumps(report, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
