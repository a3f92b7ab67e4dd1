"""The demo model: GGUF -> bf16 safetensors conversion, and our float32 model against HF on the converted folder."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pdpool.attention import AttentionMetadata, get_backend, reset_context, set_context
from pdpool.models import demo
from pdpool.models.loader import load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n"]


def test_converted_folder_is_a_plain_bf16_llama_checkpoint(demo_model_dir):
    from transformers import AutoTokenizer

    cfg = json.loads((demo_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    with safe_open(str(demo_model_dir / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert tok.convert_ids_to_tokens(cfg["eos_token_id"]) == "<|im_end|>"
    assert demo.resolve_model("demo") == demo_model_dir  # converted once, found afterwards


def test_our_float32_logits_match_hf_on_the_demo_model(demo_model_dir, hf_reference):
    torch.set_num_threads(1)
    model = load_model(demo_model_dir, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    kv = torch.zeros(16, len(model.model.layers), 2, 16, attn.num_kv_heads, attn.head_dim)
    model.bind_kv_cache(kv, get_backend("torch"))
    for prompt in PROMPTS:
        ids = hf_reference.encode(prompt)
        set_context(AttentionMetadata.build([len(ids)], [len(ids)], [[9, 3, 12]], 16))
        try:
            with torch.no_grad():
                ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))  # [T, V]
        finally:
            reset_context()
        with torch.no_grad():
            ref = hf_reference.model(torch.tensor([ids])).logits[0].float()
        # 2e-4: on the CPU our fp32 GEMMs at decode sizes run on oneDNN-packed weights (pdpool.models.cpu_linear),
        # which sum in another order than HF's F.linear; measured: 18 of 245760 logits off by up to 1.3e-4
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_concurrent_conversions_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PDPOOL_CACHE", str(tmp_path))
    calls: list[Path] = []
    real_convert = demo.convert_gguf

    def counted(gguf, out):
        calls.append(out)
        real_convert(gguf, out)

    monkeypatch.setattr(demo, "convert_gguf", counted)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo.resolve_model("demo"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    models = tmp_path / "models"
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == [demo.DEMO_DIR]  # temp folder renamed away
    assert (results[0] / "model.safetensors").is_file() and (results[0] / "tokenizer.json").is_file()


def test_other_model_names_are_local_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        demo.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "config.json").write_text("{}")
    assert demo.resolve_model(str(tmp_path)) == tmp_path


def hub_snapshot(cache: Path, repo: str, revision: str, files: Path) -> Path:
    """A model as huggingface_hub stores it: blobs, a snapshot of links to them, and refs/main."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for f in files.iterdir():
        if f.is_file():
            blob = root / "blobs" / f.name
            shutil.copy(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hub_id_in_the_hugging_face_cache_is_served_from_it(tmp_path, monkeypatch, demo_model_dir):
    """``vllm serve Qwen/Qwen3-0.6B`` finds the model that huggingface_hub downloaded earlier; so does pdpool,
    never downloading: the snapshot ``refs/main`` names (else the only one), under HF_HUB_CACHE or HF_HOME/hub."""
    from pdpool.frontend import Frontend

    cache = tmp_path / "home" / "hub"
    old = hub_snapshot(cache, "acme/tiny", "0123abc", demo_model_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert demo.resolve_model("acme/tiny") == old            # the only snapshot
    new = old.parent / "4567def"
    shutil.copytree(old, new, symlinks=True)
    with pytest.raises(FileNotFoundError, match="not a model in the Hugging Face cache"):
        demo.resolve_model("acme/tiny")                      # two snapshots and no ref: which one is unknown
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("4567def")
    assert demo.resolve_model("acme/tiny") == new
    demo.check_model("acme/tiny")
    assert Frontend.from_model("acme/tiny").tokenizer.encode("hello") == \
        Frontend.from_model(str(demo_model_dir)).tokenizer.encode("hello")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))   # it wins over HF_HOME
    for name in ("acme/tiny", "acme/other", "../tiny", "acme/tiny/extra"):
        with pytest.raises(FileNotFoundError, match="never downloaded"):
            demo.check_model(name)
