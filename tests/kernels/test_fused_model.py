"""The model's fused-kernel path (``fused_ops``: RMSNorm+residual, per-head q/k norm, rotary in place, SiLU-and-mul)
against its torch path, over one mixed step (prefills and decodes) through the paged cache; Llama (llama3 rope,
untied) and Qwen3 (q/k norm, tied). Under the interpreter on the CPU in fp32, compiled on a GPU in bf16."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import DEVICE, ON_GPU, rel_err  # noqa: I001  (first: sets TRITON_INTERPRET on the CPU)
from pdpool.attention import AttentionMetadata, get_backend, reset_context, set_context
from pdpool.models.llama import LlamaForCausalLM, inv_frequencies

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = 2e-2 if ON_GPU else 1e-5
BLOCK = 16


def tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, rms_norm_eps=1e-6, max_position_embeddings=512)
    if arch == "Qwen3ForCausalLM":
        return Qwen3Config(**common, tie_word_embeddings=True)
    return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def build(arch: str) -> LlamaForCausalLM:
    config = tiny_config(arch)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, arch).to(DEVICE, DTYPE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.inv_freq = inv_frequencies(config, 16).to(DEVICE)
    return model.eval()


def forward(model, fused: bool, ids, positions, meta, kv):
    model.fused_ops = fused
    model.bind_kv_cache(kv, get_backend("triton"))
    set_context(AttentionMetadata(**{k: v for k, v in vars(meta).items() if k != "plan"}))
    try:
        with torch.inference_mode():
            return model(ids, positions)
    finally:
        reset_context()


def mixed_step():
    """One step of three requests: request 0 decodes at position 40 over a cached prefix, request 1 prefills 9
    tokens, request 2 decodes at 3; shuffled blocks, and a random cache (the cached prefixes). Returns the step's
    ids, positions, metadata and cache, and the blocks of each request."""
    query_lens, seq_lens = [1, 9, 1], [41, 9, 4]
    need = [-(-n // BLOCK) for n in seq_lens]
    perm = torch.randperm(sum(need) + 2).tolist()
    blocks = [perm[:need[0]], perm[need[0]:need[0] + need[1]], perm[need[0] + need[1]:sum(need)]]
    meta = AttentionMetadata.build(query_lens, seq_lens, blocks, BLOCK, device=DEVICE)
    positions = torch.tensor([40, *range(9), 3], device=DEVICE)
    ids = torch.randint(0, 300, (positions.numel(),), device=DEVICE)
    kv = torch.randn(len(perm), 2, 2, BLOCK, 2, 16, device=DEVICE).to(DTYPE)
    return ids, positions, meta, kv, blocks


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fused_path_matches_torch_path(arch):
    model = build(arch)
    ids, positions, meta, kv, _ = mixed_step()
    ref = forward(model, False, ids, positions, meta, kv.clone())
    out = forward(model, True, ids, positions, meta, kv.clone())
    assert rel_err(out, ref.float()) < TOL


@pytest.fixture
def triton_ops(monkeypatch):
    """The CUDA path's kernels (fused q/k norm + rotary + KV store, one-row GEMVs) on the CPU, interpreted."""
    import pdpool.models.llama as llama

    if not ON_GPU:
        monkeypatch.setattr(llama, "TRITON_OPS_ON_CPU", True)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_triton_path_matches_torch_path_and_cache(arch, triton_ops):
    """The mixed step through the Triton kernels: same hidden states as the torch path, and the same K/V in the
    cache (the fused rotary + store kernel writes what the torch path's write_kv writes)."""
    model = build(arch)
    ids, positions, meta, kv, blocks = mixed_step()
    kv_ref, kv_out = kv.clone(), kv.clone()
    ref = forward(model, False, ids, positions, meta, kv_ref)
    out = forward(model, True, ids, positions, meta, kv_out)
    assert rel_err(out, ref.float()) < TOL
    assert rel_err(kv_out, kv_ref.float()) < TOL
    untouched = torch.ones(kv.shape[0], dtype=torch.bool)
    untouched[[b for row in blocks for b in row]] = False
    assert torch.equal(kv_out[untouched], kv[untouched]), "a block outside the step's tables was written"


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("gemv", [True, False])
def test_one_token_step_matches_torch_path(arch, gemv, triton_ops):
    """Batch-1 decode (T = 1): qkv, o and down (SiLU folded in) as GEMV kernels, or cuBLAS, against the torch path;
    a padding slot (-1) writes nothing."""
    model = build(arch)
    model.gemv_ops = gemv
    seq_len = 37
    need = -(-seq_len // BLOCK)
    perm = torch.randperm(need + 2).tolist()
    meta = AttentionMetadata.build([1], [seq_len], [perm[:need]], BLOCK, device=DEVICE)
    positions = torch.tensor([seq_len - 1], device=DEVICE)
    ids = torch.randint(0, 300, (1,), device=DEVICE)
    kv = torch.randn(len(perm), 2, 2, BLOCK, 2, 16, device=DEVICE).to(DTYPE)
    ref = forward(model, False, ids, positions, meta, kv.clone())
    out = forward(model, True, ids, positions, meta, kv.clone())
    assert rel_err(out, ref.float()) < TOL
    with torch.inference_mode():
        ref_logits = torch.nn.functional.linear(ref, model.model.embed_tokens.weight if model.tie_word_embeddings
                                                else model.lm_head.weight).float()
        assert rel_err(model.compute_logits(out), ref_logits) < TOL  # one row: the GEMV kernel where on
    meta.slot_mapping.fill_(-1)
    kv_pad = kv.clone()
    forward(model, True, ids, positions, meta, kv_pad)
    assert torch.equal(kv_pad, kv), "slot -1 must write nothing"
