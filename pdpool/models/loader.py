"""Build our model from a HF folder: safetensors weights (``load_format="auto"``) or seeded random ones ("dummy").

HF names map onto ours one to one, except the fused projections: ``q_proj``/``k_proj``/``v_proj`` land in slices
of ``qkv_proj`` and ``gate_proj``/``up_proj`` in slices of ``gate_up_proj`` (offsets from ``packed_shards``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from pdpool.models.llama import inv_frequencies
from pdpool.models.registry import resolve_architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_config(path: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path: str | Path, hf_config=None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", load_format: str = "auto", seed: int = 0) -> nn.Module:
    """Our model for the HF folder ``path``, weights in ``dtype`` on ``device``."""
    hf_config = hf_config or load_hf_config(path)
    arch, cls = resolve_architecture(hf_config)
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(hf_config, arch)  # shapes only; no memory until to_empty
    model.to_empty(device=device)
    head_dim = model.model.layers[0].self_attn.head_dim
    model.inv_freq.copy_(inv_frequencies(hf_config, head_dim))
    if load_format == "dummy":
        fill_dummy(model, seed)
    elif load_format == "auto":
        load_safetensors(model, Path(path))
    else:
        raise ValueError(f"load_format {load_format!r}: expected 'auto' or 'dummy'")
    if torch.device(device).type == "cpu":
        from pdpool.models.cpu_linear import bound_onednn_caches, pack_cpu_linears

        bound_onednn_caches()  # before the first oneDNN op, which builds its per-shape caches (cpu_linear.py)
        pack_cpu_linears(model)  # the native small-row kernel / oneDNN-packed weights at decode sizes, where built
    return model.eval()


def fill_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights with real shapes: N(0, 0.02) matrices, norms at 1, biases at 0 (drawn on the
    weights' device, so values depend on seed, device type and dtype)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)


def _packed_target(model_params: dict[str, nn.Parameter], modules: dict[str, nn.Module], name: str):
    """(param, shard slice or None) for a HF tensor name; None when it has no place in our model."""
    if name in model_params:
        return model_params[name], None
    module_path, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.k_proj / weight
    parent, _, shard = module_path.rpartition(".")
    for fused in ("qkv_proj", "gate_up_proj"):
        module = modules.get(f"{parent}.{fused}")
        if module is not None and shard in getattr(module, "packed_shards", {}):
            return getattr(module, leaf), module.packed_shards[shard]
    return None, None


def checkpoint_files(path: Path) -> list[Path]:
    """The HF-named shards: those of ``model.safetensors.index.json`` if present, else every ``*.safetensors``
    except Mistral's ``consolidated*`` copies (original, non-HF names)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [f for f in sorted(path.glob("*.safetensors")) if not f.name.startswith("consolidated")]


def load_safetensors(model: nn.Module, path: Path) -> None:
    """Copy every ``*.safetensors`` tensor of ``path`` into ``model`` (dtype converted); all params must be set."""
    from safetensors import safe_open

    files = checkpoint_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    names = {id(param): name for name, param in params.items()}
    loaded = dict.fromkeys(params, 0)  # rows written per param
    tied = getattr(model, "tie_word_embeddings", False)
    with torch.no_grad():
        for file in files:
            # opened here first, where the wait releases the GIL: safetensors' own open holds it, so a shard whose
            # open blocks (a hung network mount, a FIFO) froze the whole node, its health endpoints and SIGTERM too
            with open(file, "rb"):
                pass
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(SKIPPED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    param, shard = _packed_target(params, modules, name)
                    if param is None:
                        raise KeyError(f"{file.name}: tensor {name!r} has no place in {type(model).__name__}")
                    tensor = f.get_tensor(name)
                    target = param if shard is None else param.narrow(0, shard[0], shard[1])
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"expected {tuple(target.shape)}")
                    target.copy_(tensor.to(target.dtype))
                    loaded[names[id(param)]] += target.shape[0]
    missing = [name for name, rows in loaded.items() if rows != params[name].shape[0]]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
