"""The attention backend interface, the registry of backends, and what "auto" picks."""

from __future__ import annotations

import importlib
import logging

import torch

from pdpool.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)


class AttentionBackend:
    """The interface every attention implementation provides."""

    name = "base"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] (strided views); slot_mapping: [T]."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D]; causal per request over its cached context; Hq % Hkv == 0 (GQA)."""
        raise NotImplementedError


BACKENDS = {
    "torch": "pdpool.attention.torch_backend:TorchAttentionBackend",
    "cpu": "pdpool.attention.cpu_backend:CpuAttentionBackend",
    "triton": "pdpool.attention.triton_backend:TritonAttentionBackend",
}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def pick_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' is triton on CUDA (torch if the kernels cannot be imported), cpu on the CPU (torch if its native
    decode kernel cannot be built or loaded)."""
    if name != "auto":
        check_device(name, device)
        return get_backend(name)
    if device.type == "cuda":
        try:
            return get_backend("triton")
        except ImportError as e:
            log.warning("triton attention backend unavailable (%s); using torch", e)
    elif device.type == "cpu":
        from pdpool.kernels import cpu_decode

        if cpu_decode.available():
            return get_backend("cpu")
        log.warning("the CPU decode kernel is unavailable; using the torch attention backend")
    return get_backend("torch")


def check_device(name: str, device: torch.device) -> None:
    """Refuse at load a backend that cannot run on ``device``: triton launches on CUDA only (or under Triton's
    interpreter, TRITON_INTERPRET=1, as the kernel tests run it), and cpu's native kernels read host memory; either
    would otherwise fail every request's first step."""
    if name == "triton" and device.type != "cuda":
        from pdpool.kernels._launch import interpreting  # imports triton, which the triton backend needs anyway

        if interpreting():
            return
        raise ValueError(f"--attention-backend triton needs --device cuda (this node runs on {device.type}); "
                         "use --attention-backend auto, cpu or torch")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"--attention-backend cpu needs --device cpu (this node runs on {device.type}); "
                         "use --attention-backend auto, triton or torch")
