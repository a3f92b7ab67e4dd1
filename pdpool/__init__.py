"""pdpool: LLM serving with prefill/decode disaggregation.

``from pdpool import LLM, SamplingParams`` is lazy: importing ``pdpool`` (the config schema, the CLI) does not
import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt", "__version__"]

# vLLM's top-level names of the offline API; RequestOutput is the offline result (``GenerationResult``)
_LAZY = {"LLM": ("pdpool.engine.llm", "LLM"), "SamplingParams": ("pdpool.engine.sampling_params", "SamplingParams"),
         "RequestOutput": ("pdpool.engine.llm", "GenerationResult"),
         "CompletionOutput": ("pdpool.engine.llm", "CompletionOutput"),
         "TextPrompt": ("pdpool.engine.llm", "TextPrompt"), "TokensPrompt": ("pdpool.engine.llm", "TokensPrompt")}

if TYPE_CHECKING:
    from pdpool.engine.llm import CompletionOutput, LLM, TextPrompt, TokensPrompt
    from pdpool.engine.llm import GenerationResult as RequestOutput
    from pdpool.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pdpool' has no attribute {name!r}")
