"""pdpool on the GPU against HF transformers, from one random checkpoint that both load.

Per case (the Qwen3-0.6B config, and a small Llama-3 config with llama3 rope and untied embeddings): HF builds the
model from the config with random weights (norms perturbed around 1, so they matter), saves it as safetensors
into a temp folder with a word-level tokenizer, and both engines load that folder.

1. Logits: last-position logits of 4 prompts in one batched prefill step (``ModelRunner.compute_logits_for``,
   bf16), against HF bf16 and HF fp32; relative error ||a - b|| / ||b||. Pass: pdpool's error against HF fp32 is
   within 1.5x HF bf16's own error against HF fp32 (plus 1e-3).
2. Greedy tokens: 4 prompts, 32 tokens, through ``LLM.generate`` (scheduler, CUDA graphs for decode) against HF
   ``generate`` one prompt at a time; first divergence reported. bf16 argmax near-ties may flip on random weights:
   on a bf16 divergence the check is repeated in fp32 and both results are reported.
3. CUDA graphs against eager (``enforce_eager``): the same greedy tokens (bf16; fp32 on divergence).
4. The overlapped step loop (the CUDA default) against the plain loop: the same greedy tokens.
5. Prompt logprobs (fp32, completions' echo with logprobs): every prompt position's logprob, with prompts chunked
   (a 64-token budget) and half the batch not asking, against HF fp32's log_softmax; the batch's greedy tokens
   against the same prompts run without prompt logprobs.

pdpool runs with its fused elementwise kernels (the CUDA default); the logits check also reports the torch-ops
path (``PDPOOL_FUSED_OPS=0``).

    python3 benchmarks/gpu_correctness.py [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_e2e import CONFIGS, write_tokenizer  # noqa: E402

STEPS = 32
PROMPT_LENS = (37, 64, 101, 150)
SMALL_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024,
                   intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                   vocab_size=32000, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 1024})


def save_checkpoint(cfg: dict, folder: Path, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    hf_cfg = AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif not (name == "lm_head.weight" and hf_cfg.tie_word_embeddings):
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(folder))
    write_tokenizer(folder, hf_cfg.vocab_size)
    return model


def prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, min(vocab, 10000), (n,), generator=g).tolist() for n in PROMPT_LENS]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]


def runner_logits(folder: Path, ps, device: str, dtype: str, fused: bool = True):
    from pdpool import config
    from pdpool.engine.model_runner import ModelRunner
    from pdpool.engine.request import Request
    from pdpool.engine.sampling_params import SamplingParams
    from pdpool.engine.scheduler import ScheduledRequest, SchedulerOutput

    runner = ModelRunner(config.build(model=str(folder), dtype=dtype, device=device, num_kv_blocks=256,
                                      enforce_eager=True))
    runner.model.fused_ops = fused and device == "cuda"
    scheduled, next_block = [], 0
    for i, p in enumerate(ps):
        n_blocks = -(-len(p) // 16)
        blocks = list(range(next_block, next_block + n_blocks))[::-1]  # non-contiguous order
        next_block += n_blocks
        scheduled.append(ScheduledRequest(Request(f"r{i}", p, SamplingParams(max_tokens=1)), len(p), blocks))
    logits = runner.compute_logits_for(SchedulerOutput(scheduled)).cpu()
    del runner
    return logits


def hf_logits(model, ps, device: str):
    import torch

    with torch.inference_mode():
        return torch.stack([model(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in ps])


def hf_greedy(model, ps, device: str) -> list[list[int]]:
    import torch

    out = []
    with torch.inference_mode():
        for p in ps:
            ids = model.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=STEPS,
                                 min_new_tokens=STEPS, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def pdpool_greedy(folder: Path, ps, device: str, dtype: str, eager: bool,
                  overlap: bool = True) -> tuple[list[list[int]], dict]:
    import torch

    from pdpool import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, device=device, num_kv_blocks=256, max_num_seqs=8, enforce_eager=eager)
    llm.engine.overlap_steps = overlap and device == "cuda"
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    graphs = llm.engine.runner.graphs
    info = dict(cuda_graphs=graphs is not None, graph_replays=graphs.num_replays if graphs else 0,
                attention=llm.engine.runner.backend.name)
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return [list(o.output_token_ids) for o in outs], info


def prompt_logprobs_check(folder: Path, hf32, ps, device: str) -> dict:
    import torch

    from pdpool import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", device=device, num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=64)
    asked = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2 if i % 2 == 0 else None)
             for i in range(len(ps))]
    outs = llm.generate(ps, asked, use_tqdm=False)
    plain = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    err, top_match, positions = 0.0, 0, 0
    with torch.inference_mode():
        for p, o in zip(ps, outs):
            if o.prompt_logprobs is None:
                continue
            ref = torch.log_softmax(hf32(torch.tensor([p], device=device)).logits[0].float(), -1).cpu()
            for i, e in enumerate(o.prompt_logprobs[1:], start=1):
                err = max(err, abs(e.logprob - ref[i - 1, p[i]].item()))
                top_match += [t for t, _ in e.top] == torch.topk(ref[i - 1], 2).indices.tolist()
                positions += 1
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(max_abs_err=err, positions=positions, top2_ids_match=top_match,
                unasked_rows_none=all(o.prompt_logprobs is None for o in outs[1::2]),
                tokens_match_without=[list(a.output_token_ids) for a in outs] == [list(b.output_token_ids)
                                                                                 for b in plain],
                ok=err < 2e-3 and positions == sum(len(p) - 1 for p in ps[::2]))


def check_case(name: str, cfg: dict, root: Path, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    folder = root / name
    hf32 = save_checkpoint(cfg, folder, device)
    ps = prompts(cfg["vocab_size"])
    res: dict = dict(case=name)
    # 1. logits
    ref32 = hf_logits(hf32, ps, device)
    hf16 = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to(device).eval()
    ref16 = hf_logits(hf16, ps, device)
    ours16 = runner_logits(folder, ps, device, "bfloat16")
    ours32 = runner_logits(folder, ps, device, "float32")
    unfused16 = runner_logits(folder, ps, device, "bfloat16", fused=False)
    res["logits_rel_err"] = dict(pdpool_bf16_vs_hf_fp32=rel(ours16, ref32), hf_bf16_vs_hf_fp32=rel(ref16, ref32),
                                 pdpool_bf16_torch_ops_vs_hf_fp32=rel(unfused16, ref32),
                                 pdpool_bf16_vs_hf_bf16=rel(ours16, ref16), pdpool_fp32_vs_hf_fp32=rel(ours32, ref32))
    e = res["logits_rel_err"]
    res["logits_ok"] = (e["pdpool_bf16_vs_hf_fp32"] <= 1.5 * e["hf_bf16_vs_hf_fp32"] + 1e-3
                        and e["pdpool_fp32_vs_hf_fp32"] < 1e-3)
    # 2. greedy tokens vs HF, 3. graphs vs eager
    for dtype, hf in (("bfloat16", hf16), ("float32", hf32)):
        ref = hf_greedy(hf, ps, device)
        graph, info = pdpool_greedy(folder, ps, device, dtype, eager=False)
        eager, _ = pdpool_greedy(folder, ps, device, dtype, eager=True)
        plain, _ = pdpool_greedy(folder, ps, device, dtype, eager=False, overlap=False)
        res[dtype] = dict(hf_first_divergence=first_divergence(graph, ref),
                          graph_vs_eager_first_divergence=first_divergence(graph, eager),
                          tokens_match_hf=graph == ref, graphs_match_eager=graph == eager,
                          overlapped_matches_plain_loop=graph == plain, **info)
        if graph == ref and graph == eager and graph == plain:
            break  # fp32 only when bf16 diverges
    # 5. prompt logprobs
    res["prompt_logprobs"] = prompt_logprobs_check(folder, hf32, ps, device)
    del hf16, hf32
    gc.collect()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="Qwen3-0.6B,llama3-small")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    known = {"Qwen3-0.6B": json.loads((CONFIGS / "Qwen3-0.6B" / "config.json").read_text()),
             "llama3-small": SMALL_LLAMA}
    cases = [(name, known[name]) for name in args.cases.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="pdpool-correct-") as tmp:
        for name, cfg in cases:
            r = check_case(name, cfg, Path(tmp), args.device)
            results.append(r)
            print(json.dumps(r), flush=True)
            (Path(args.out) / "gpu_correctness.json").write_text(json.dumps(results, indent=1))
    (Path(args.out) / "gpu_correctness.json").write_text(json.dumps(results, indent=1))
    for r in results:
        e = r["logits_rel_err"]
        final = r.get("float32", r["bfloat16"])
        print(f"{r['case']}: logits rel err pdpool-bf16 {e['pdpool_bf16_vs_hf_fp32']:.2e} vs HF-bf16 "
              f"{e['hf_bf16_vs_hf_fp32']:.2e} (fp32 {e['pdpool_fp32_vs_hf_fp32']:.1e}) ok={r['logits_ok']}; "
              f"greedy bf16 match HF={r['bfloat16']['tokens_match_hf']} "
              f"(first divergence {r['bfloat16']['hf_first_divergence']}), graphs==eager "
              f"{r['bfloat16']['graphs_match_eager']}, overlapped==plain "
              f"{r['bfloat16']['overlapped_matches_plain_loop']}; torch-ops bf16 logits "
              f"{e['pdpool_bf16_torch_ops_vs_hf_fp32']:.2e}; fp32: {'not needed' if 'float32' not in r else final}; "
              f"prompt logprobs {r['prompt_logprobs']}")


if __name__ == "__main__":
    main()
