"""``config.json`` ``architectures`` -> our model class."""

from __future__ import annotations

from torch import nn

from pdpool.models.llama import LlamaForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}  # for configs saved without `architectures`


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no implementation here."""


def resolve_architecture(hf_config) -> tuple[str, type[nn.Module]]:
    """(architecture name, model class) for a transformers config; raises UnsupportedModelError."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs and getattr(hf_config, "model_type", None) in MODEL_TYPES:
        archs = [MODEL_TYPES[hf_config.model_type]]
    for arch in archs:
        if arch in MODELS:
            return arch, MODELS[arch]
    raise UnsupportedModelError(f"unsupported model architecture {archs or getattr(hf_config, 'model_type', None)}; "
                                f"supported: {', '.join(sorted(MODELS))}")
