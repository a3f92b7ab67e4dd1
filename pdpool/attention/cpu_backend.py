"""The "cpu" attention backend (the CPU default): the torch backend, with its decode rows (query_len 1) in the native
kernel (``pdpool.kernels.cpu_decode``), which reads K and V in place through the block table instead of gathering
a padded copy, and the step's new K and V rows stored by a row copy each (torch's ``index_put_`` on the strided cache
views was a sixth of the step on the offline benchmark). Prefill and extend rows keep the torch path."""

from __future__ import annotations

import logging

from pdpool.attention.torch_backend import TorchAttentionBackend
from pdpool.kernels import cpu_decode, cpu_features

log = logging.getLogger(__name__)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        cpu_decode.load()  # fail at construction, not at the first step
        dtype, reason = cpu_features.default_cpu_dtype()
        log.info("CPU attention: native kernels loaded; %s, so %s suits this CPU", reason, dtype)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        cpu_decode.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q, k_cache, v_cache, plan, scale, out) -> None:
        cpu_decode.paged_decode(q, k_cache, v_cache, out, plan["decode_tokens"], plan["decode_tables"],
                                plan["decode_lens"], scale)
