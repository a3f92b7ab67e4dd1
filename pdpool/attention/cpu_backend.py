"""The "cpu" attention backend (the CPU default): the torch backend, with its decode rows (query_len 1) in the native
kernel (``pdpool.kernels.cpu_decode``), which reads K and V in place through the block table instead of gathering
a padded copy. Prefill and extend rows keep the torch path."""

from __future__ import annotations

from pdpool.attention.torch_backend import TorchAttentionBackend
from pdpool.kernels import cpu_decode


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        cpu_decode.load()  # fail at construction, not at the first step

    def _decode(self, q, k_cache, v_cache, plan, scale, out) -> None:
        cpu_decode.paged_decode(q, k_cache, v_cache, out, plan["decode_tokens"], plan["decode_tables"],
                                plan["decode_lens"], scale)
