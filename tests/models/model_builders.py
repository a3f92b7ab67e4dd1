"""Builders for the model tests: tiny random HF checkpoints per architecture, requests and runner configs."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from pdpool import config  # noqa: E402
from pdpool.engine.request import Request  # noqa: E402
from pdpool.engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_config(kind: str):
    """Tiny config of each supported family; names say what the case covers."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama3-untied":
        return LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    if kind == "smollm-tied":
        return LlamaConfig(**SMALL, tie_word_embeddings=True)
    if kind == "mistral-headdim":  # head_dim * heads != hidden_size
        return MistralConfig(**SMALL, head_dim=32, tie_word_embeddings=False)
    if kind == "qwen2-bias-tied":
        return Qwen2Config(**SMALL, tie_word_embeddings=True)
    if kind == "qwen3-qknorm":
        return Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False)
    raise ValueError(kind)


KINDS = ["llama3-untied", "smollm-tied", "mistral-headdim", "qwen2-bias-tied", "qwen3-qknorm"]


def save_tiny_model(kind: str, path: Path, seed: int = 0):
    """Random-weight HF model of ``kind`` saved as safetensors into ``path``; returns it in float32, eval mode.
    Every parameter (biases and norms too) gets noise, so each one matters to the comparison."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + torch.randn_like(p) * (0.1 if "norm" in name or name.endswith("bias") else 0.05))
    model.save_pretrained(path)
    return model


def make_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> Request:
    return Request(request_id, prompt_token_ids, params or SamplingParams(temperature=0.0))


def node_config(model_dir: Path, num_kv_blocks: int = 64, block_size: int = 8, **kw):
    return config.build(model=str(model_dir), dtype="float32", num_kv_blocks=num_kv_blocks, block_size=block_size,
                        num_threads=1, **kw)


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """HF float32 logits at every position of ``token_ids``: [len, V]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
