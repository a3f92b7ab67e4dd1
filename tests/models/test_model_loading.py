"""Loader and runner set-up: dummy weights, unsupported architectures, incomplete checkpoints, KV cache sizing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_builders import hf_config, make_request, node_config, save_tiny_model
from pdpool.engine.model_runner import ModelRunner
from pdpool.engine.scheduler import ScheduledRequest, SchedulerOutput
from pdpool.models.loader import load_model
from pdpool.models.registry import MODELS, UnsupportedModelError


def test_dummy_weights_are_seeded_with_real_shapes(tmp_path):
    hf_config("qwen3-qknorm").save_pretrained(tmp_path)  # config only: no weights on disk
    a, b = (load_model(tmp_path, load_format="dummy", seed=1) for _ in range(2))
    c = load_model(tmp_path, load_format="dummy", seed=2)
    assert a.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 32, 64)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name


def test_runner_with_dummy_weights_in_bfloat16(tmp_path):
    hf_config("llama3-untied").save_pretrained(tmp_path)
    cfg = node_config(tmp_path, load_format="dummy", num_kv_blocks=8)
    cfg.model.dtype = "bfloat16"
    runner = ModelRunner(cfg)
    assert runner.kv_cache.dtype == torch.bfloat16
    req = make_request("x", list(range(5, 25)))
    logits = runner.compute_logits_for(SchedulerOutput([ScheduledRequest(req, 20, [6, 2, 3])]))
    assert logits.shape == (1, 256) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path)
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in MODELS:
        assert arch in str(err.value)


def test_incomplete_checkpoint_is_refused(tmp_path):
    save_tiny_model("qwen2-bias-tied", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj.bias"):
        load_model(tmp_path)


def test_kv_cache_layout_and_sizing(tmp_path):
    save_tiny_model("mistral-headdim", tmp_path)
    cfg = node_config(tmp_path, num_kv_blocks=None, block_size=16, kv_cache_memory_gb=0.001)
    runner = ModelRunner(cfg)
    info = runner.model_config
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.vocab_size) == (2, 2, 32, 256)
    assert runner.block_bytes == 2 * 2 * 16 * 2 * 32 * 4
    assert runner.num_blocks == int(0.001 * 2**30) // runner.block_bytes
    assert runner.kv_cache.shape == (runner.num_blocks, 2, 2, 16, 2, 32)
    assert runner.kv_cache[3].is_contiguous()  # a block is one region: what KV transfer moves
    assert runner.kv_cache[3].numel() * runner.kv_cache.element_size() == runner.block_bytes
    attn = runner.model.model.layers[1].self_attn
    assert attn.k_cache.data_ptr() == runner.kv_cache[:, 1, 0].data_ptr()  # views, not copies
    assert runner.max_model_len == info.max_position_embeddings == 512


def test_sliding_window_models_are_served_up_to_their_window(tmp_path):
    cfg = hf_config("mistral-headdim")
    cfg.sliding_window = 64  # beyond it full attention would differ from the model's
    cfg.architectures = ["MistralForCausalLM"]
    cfg.save_pretrained(tmp_path)
    runner = ModelRunner(node_config(tmp_path, load_format="dummy", num_kv_blocks=4))
    assert runner.model_config.max_position_embeddings == 64
