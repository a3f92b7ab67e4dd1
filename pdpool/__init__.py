"""pdpool: LLM serving with prefill/decode disaggregation.

``from pdpool import LLM, SamplingParams`` is lazy: importing ``pdpool`` (the config schema, the CLI) does not
import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

_LAZY = {"LLM": "pdpool.engine.llm", "SamplingParams": "pdpool.engine.sampling_params"}

if TYPE_CHECKING:
    from pdpool.engine.llm import LLM
    from pdpool.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pdpool' has no attribute {name!r}")
