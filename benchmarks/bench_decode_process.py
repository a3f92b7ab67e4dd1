"""CPU microbenchmark of the output processor's host time per decode step (issue 13): ``OutputProcessor.process``
for R requests over STEPS steps, one uniform random id per request per step (as the GPU benchmark's dummy-weight
models sample), with ``gpu_e2e``'s word-level tokenizer over Qwen3's 151,936 ids.

- streamed: every row gets a ``RequestOutput`` and an incremental decode per step (a server's streams; before
  the ninth pass, also the offline ``LLM``'s);
- final only: the engine's one output per request at its finish (all ids), text decoded once
  (``OutputProcessor.add(..., final_only=True)``, the offline ``LLM`` since the ninth pass).

Both runs must give the same texts (asserted).

    .venv/bin/python benchmarks/bench_decode_process.py [--requests 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from benchmarks.gpu_e2e import write_tokenizer
    from pdpool.engine.llm_engine import EngineOutput
    from pdpool.engine.output_processor import OutputProcessor
    from pdpool.engine.sampling_params import SamplingParams
    from pdpool.frontend import Tokenizer

    folder = Path(tempfile.mkdtemp())
    write_tokenizer(folder, args.vocab)
    tok = Tokenizer(folder)
    rng = random.Random(0)
    R, steps = args.requests, args.steps
    prompts = [[rng.randrange(args.vocab) for _ in range(50)] for _ in range(R)]
    ids = [[rng.randrange(args.vocab) for _ in range(steps)] for _ in range(R)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.6)

    def run(final_only: bool) -> tuple[float, dict]:
        processor = OutputProcessor(tok)
        for r in range(R):
            processor.add(f"r{r}", None, prompts[r], params, final_only=final_only)
        texts = {}
        t0 = time.perf_counter()
        for s in range(steps):
            last = s == steps - 1
            if final_only:  # what the engine sends such requests: nothing until the finish, then all ids
                outs = [EngineOutput(f"r{r}", ids[r], None, True, "length") for r in range(R)] if last else []
            else:
                outs = [EngineOutput(f"r{r}", [ids[r][s]], None, last, "length" if last else None) for r in range(R)]
            results, _ = processor.process(outs)
            for out in results:
                if out.finished:
                    texts[out.request_id] = out.text
        return 1e3 * (time.perf_counter() - t0) / steps, texts

    for _ in range(args.repeats):
        streamed_ms, streamed = run(False)
        final_ms, final = run(True)
        assert streamed == final and len(final) == R
        print(f"process ms/step, {R} rows x {steps} steps: streamed {streamed_ms:.3f}, final only {final_ms:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
