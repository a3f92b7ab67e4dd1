"""One Llama-family decoder: Llama 2/3 (llama3 rope scaling), SmolLM, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

GQA, tied or untied embeddings. ``forward(input_ids [T], positions [T]) -> hidden [T, H]`` over the step's packed
tokens; attention layers read the step's metadata from ``get_context()`` and the KV cache views bound by
``bind_kv_cache``. Fused projections: ``qkv_proj`` = q|k|v and ``gate_up_proj`` = gate|up along dim 0, with the
shard offsets the loader needs in ``packed_shards``.

On CUDA the elementwise ops run as the Triton kernels of ``pdpool.kernels`` (``fused_ops``): RMSNorm with the
residual add, rotary on q and k in place, SiLU-and-mul; about 10 launches a layer instead of about 40, which at
decode batch sizes (and inside CUDA graphs) is most of the non-GEMM, non-attention time. On the CPU the same ops
run in the native extension (``pdpool.kernels.cpu_ops``; where it is not built, the torch ops), one pass over the
rows each instead of a temporary between torch kernels. ``PDPOOL_FUSED_OPS=0`` keeps the torch ops (A/B
measurements). The hidden state and the residual travel apart, as in vLLM::

    residual = x; h = norm(x)                       (first layer)
    h, residual = norm(h + residual), h + residual  (every later norm: one fused kernel)

On CUDA with the triton attention backend, Qwen3's q/k norm, rotary and the KV store are one kernel
(``pdpool.kernels.fused_qkv``), and a one-token forward (batch-1 decode) runs ``qkv_proj``, ``o_proj`` and
``gate_up_proj``, ``down_proj`` (with SiLU-and-mul folded into its input) and the logits of a one-row batch as
one-row GEMV kernels (``pdpool.kernels.gemv``): no split-K reduce kernels, no activation kernel, and each at or
above cuBLAS's share of copy bandwidth on the H100. ``PDPOOL_GEMV=0`` keeps cuBLAS there (read at model
construction).
``TRITON_OPS_ON_CPU`` (tests only) runs these CUDA kernels on the CPU under Triton's interpreter.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from pdpool.attention import AttentionBackend, get_context


TRITON_OPS_ON_CPU = False  # tests: the CUDA path's Triton kernels on CPU tensors (TRITON_INTERPRET=1)


def _triton_ops(device: torch.device) -> bool:
    return device.type == "cuda" or TRITON_OPS_ON_CPU


def gemv_default() -> bool:
    return os.environ.get("PDPOOL_GEMV", "1") != "0"


def _use_gemv(enabled: bool, fused: bool, rows: int, device: torch.device) -> bool:
    """One-row GEMV kernels for this forward: enabled, fused ops on, Triton ops (CUDA), and one row."""
    return enabled and fused and rows == 1 and _triton_ops(device)


def fused_ops_default(device: torch.device) -> bool:
    if os.environ.get("PDPOOL_FUSED_OPS", "1") == "0":
        return False
    if device.type == "cpu":
        from pdpool.kernels import cpu_decode

        return cpu_decode.available()
    return device.type == "cuda"


def _fused_rms_norm(x, weight, eps, residual=None):
    if not _triton_ops(x.device):
        from pdpool.kernels.cpu_ops import rms_norm
    else:
        from pdpool.kernels.rmsnorm import rms_norm
    return rms_norm(x, weight, eps, residual)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fused: bool = False):
        """x: [..., H] -> norm(x); with ``residual``: (norm(x + residual), x + residual)."""
        if fused:
            return _fused_rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)  # HF's order: normalize in fp32, cast, then scale


def rope_parameters(config) -> tuple[float, dict]:
    """(theta, scaling dict) from transformers 5 ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or params)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(theta), scaling


def inv_frequencies(config, head_dim: int) -> torch.Tensor:
    """[D/2] float32 rotary inverse frequencies, with 'default', 'linear' or 'llama3' scaling."""
    theta, scaling = rope_parameters(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D], cos/sin: [T, 1, D]; neox layout (rotate halves)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config, arch: str, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size,
                                  bias=bias or arch == "Qwen2ForCausalLM")
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias and arch != "Qwen2ForCausalLM")
        self.qkv_proj.packed_shards = {"q_proj": (0, q_size), "k_proj": (q_size, kv_size),
                                       "v_proj": (q_size + kv_size, kv_size)}
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D] strided view
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: "Rope") -> torch.Tensor:
        # x: [T, H]
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = _project(self.qkv_proj, x, rope.gemv).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # q: [T, Hq, D], rows strided (views of the projection)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # k, v: [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        meta = get_context()
        if rope.fused and rope.cos_sin is None and self.backend.name == "triton":
            from pdpool.kernels.fused_qkv import rotary_store_kv

            # one kernel: q/k norm (Qwen3), rotary in place, and the KV store
            norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            rotary_store_kv(q, k, v, rope.positions, rope.inv_freq, self.k_cache, self.v_cache, meta.slot_mapping,
                            *norms, eps=self.q_norm.eps if self.qk_norm else 1e-6)
            o = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)  # [T, Hq, D]
            return _project(self.o_proj, o.reshape(T, q_size), rope.gemv)
        if rope.fused:
            if self.qk_norm:
                q, k = self.q_norm(q, fused=True), self.k_norm(k, fused=True)  # contiguous copies
            if rope.cos_sin is not None:  # CPU: the native op, angles computed once per forward
                from pdpool.kernels.cpu_ops import apply_rotary

                q, k = apply_rotary(q, k, *rope.cos_sin)  # in place
            else:
                from pdpool.kernels.rotary import apply_rotary

                q, k = apply_rotary(q, k, rope.positions, rope.inv_freq, q_out=q, k_out=k)  # in place
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        o = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, q_size))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.gate_up_proj.packed_shards = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")

    def forward(self, x: torch.Tensor, fused: bool = False, gemv: bool = False) -> torch.Tensor:
        gate_up = _project(self.gate_up_proj, x, gemv)  # [T, 2I]
        if gemv and self.down_proj.bias is None:  # one row: SiLU-and-mul inside the down projection's GEMV
            from pdpool.kernels.gemv import gemv as gemv_kernel

            return gemv_kernel(gate_up, self.down_proj.weight, silu_x=True)
        if fused:
            if not _triton_ops(gate_up.device):
                from pdpool.kernels.cpu_ops import silu_and_mul
            else:
                from pdpool.kernels.activation import silu_and_mul
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, arch: str, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, arch, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: "Rope") -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] this layer's input less the residual (the embedding, for the first layer) -> (mlp out, residual)
        if residual is None:
            residual, h = x, self.input_layernorm(x, fused=rope.fused)
        else:
            h, residual = self.input_layernorm(x, residual, fused=rope.fused)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope), residual, fused=rope.fused)
        return self.mlp(h, fused=rope.fused, gemv=rope.gemv), residual


def _project(linear: nn.Linear, x: torch.Tensor, gemv: bool) -> torch.Tensor:
    """linear(x); a one-row GEMV kernel instead of cuBLAS where ``gemv`` (see the module docstring)."""
    if gemv and linear.bias is None:
        from pdpool.kernels.gemv import gemv as gemv_kernel

        return gemv_kernel(x, linear.weight)
    return linear(x)


class Rope:
    """Per-forward rotary inputs: positions and inverse frequencies for the fused kernel (on the CPU, its cos/sin
    [T, D/2] fp32, once for every layer), or cos/sin [T, 1, D] (in the model dtype, as HF computes them) for the
    torch ops. ``fused`` is the forward's choice for every op."""

    def __init__(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, fused: bool,
                 gemv: bool = False):
        self.fused, self.positions, self.inv_freq = fused, positions, inv_freq
        self.gemv = _use_gemv(gemv, fused, positions.shape[0], positions.device)
        self.cos_sin = None
        if fused and not _triton_ops(positions.device):
            from pdpool.kernels.cpu_ops import rotary_cos_sin

            self.cos_sin = rotary_cos_sin(positions, inv_freq)
        if not fused:
            freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2] fp32, as HF computes
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
            self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)


def _on_meta() -> bool:
    """Whether modules are being built on the meta device (the loader builds there, then fills every tensor):
    no initial values are computed then, since torch imports torch._dynamo for the first computation on meta
    (about 0.5-0.8 s of CPU in every node's start) whose result would be discarded."""
    return torch.get_default_device().type == "meta"


class Backbone(nn.Module):
    def __init__(self, config, arch: str):
        super().__init__()
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape)) if _on_meta() else nn.Embedding(*shape)
        self.layers = nn.ModuleList(DecoderLayer(config, arch, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Our model for every architecture in ``pdpool.models.registry``; ``arch`` switches the few differences."""

    def __init__(self, config, arch: str = "LlamaForCausalLM"):
        super().__init__()
        self.config, self.arch = config, arch
        self.model = Backbone(config, arch)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head_dim = self.model.layers[0].self_attn.head_dim
        inv_freq = torch.empty(head_dim // 2, dtype=torch.float32) if _on_meta() else inv_frequencies(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.fused_ops: bool | None = None  # None: on CUDA unless PDPOOL_FUSED_OPS=0 (see the module docstring)
        self.gemv_ops = gemv_default()  # one-row GEMV kernels for one-token forwards (with fused ops)
        self.logits_linear = None  # CPU: the logits weight through pdpool.models.cpu_linear (native kernel / oneDNN)

    def bind_kv_cache(self, kv_cache: torch.Tensor, backend: AttentionBackend) -> None:
        """kv_cache: [num_blocks, num_layers, 2, block_size, Hkv, D]; each layer keeps its strided K and V views."""
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            attn.k_cache, attn.v_cache, attn.backend = kv_cache[:, i, 0], kv_cache[:, i, 1], backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, H]
        x = self.model.embed_tokens(input_ids)
        fused = self.fused_ops if self.fused_ops is not None else fused_ops_default(x.device)
        rope = Rope(positions, self.inv_freq, x.dtype, fused, self.gemv_ops)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope)
        return self.model.norm(x, residual, fused=fused)[0]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # hidden: [R, H] -> logits [R, V] float32 (``float32=False``: in the model dtype, as the GEMM writes them;
        # the sampler reads those without a float32 copy of [R, V])
        if self.logits_linear is not None:
            return self.logits_linear(hidden).float()
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        fused = self.fused_ops if self.fused_ops is not None else fused_ops_default(hidden.device)
        if _use_gemv(self.gemv_ops, fused, hidden.shape[0], hidden.device):
            from pdpool.kernels.gemv import gemv

            logits = gemv(hidden, weight)  # one row (batch 1): the GEMV kernel, as in the forward
        else:
            logits = F.linear(hidden, weight)
        return logits.float() if float32 else logits
