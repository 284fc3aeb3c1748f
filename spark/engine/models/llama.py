"""A Llama-family decoder over a flat varlen batch and a paged KV cache.

One block covers Llama 2/3.x, SmolLM2 and Mistral; Qwen2 adds q/k/v biases
(``config.attention_bias``) and Qwen3 a per-head RMSNorm on q and k
(``config.qk_norm``). The forward takes every token of the step in one flat
batch ``[T]``: prefill chunks and single decode tokens side by side, no padding.
Weights arrive with Hugging Face names and layout; q/k/v and gate/up are fused
at load time so that each block runs two big matmuls instead of five.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from spark.engine.attention import AttentionMetadata, paged_attention, paged_decode_attention_rope
from spark.engine.config import ModelConfig
from spark.engine.kernels import activation, norm as norm_kernels, rope as rope_kernels, small_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return norm_kernels.rms_norm_triton(x, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as HF does, so that
        # bf16 runs round at the same place as the reference.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one fused kernel on a GPU, where x may also be
        the split-K partials of the projection before (``project``), summed there."""
        if x.is_cuda:
            return norm_kernels.add_rms_norm_triton(x, residual, self.weight, self.eps)
        h = x + residual
        return self(h), h


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama-3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation (NeoX) RoPE. x: [T, H, Dh]; cos, sin: [T, Dh // 2] fp32, shared by every layer."""
    return rope_kernels.rotate(x, cos[:, None, :], sin[:, None, :])


def project(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)``: on a GPU, for a decode batch of 33-64 rows of a wide model, through the
    small-row kernel, which streams such a weight faster than cuBLAS (kernels/small_linear.py).

    Where that kernel splits K (``small_linear.split_config``), the result is its fp32
    partial products ``[S, T, N]``: the caller hands them to ``RMSNorm.add_forward``
    (every projection here feeds the residual add before a norm), which sums them.
    """
    m, k = x.shape[0], linear.in_features
    if x.is_cuda and linear.bias is None and small_linear.beats_cublas(m, k, x.dtype):
        split = small_linear.split_config(m, linear.out_features, k)
        if split is not None:
            return small_linear.small_linear_split_k_triton(x, linear.weight, split)
        return small_linear.small_linear_triton(x, linear.weight)
    return linear(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.wqkv = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, D]; rope: (cos, sin) [T, Dh/2] on the CPU, (positions, inv_freq) on a GPU
        return project(self.attend(self.wqkv(x), rope, k_cache, v_cache, meta), self.wo)

    def attend(self, qkv, rope, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of projected ``qkv`` [T, q + 2 kv] over the cache (this step's K/V written). Returns [T, q]."""
        T = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if qkv.is_cuda and meta.decode_only:
            # One launch rotates q and k, writes k, v into the cache and attends.
            out = paged_decode_attention_rope(q, k, v, rope, k_cache, v_cache, meta, self.scale)  # [T, H, Dh]
        elif qkv.is_cuda:
            # One launch rotates q and k and writes k, v into the cache; attention then
            # only reads the cache. Decode at small batch is bound by kernel launches.
            positions, inv_freq = rope
            q = rope_kernels.rope_and_write_kv_triton(q, k, v, positions, inv_freq, k_cache, v_cache, meta.slot_mapping)
            out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, kv_written=True)  # [T, H, Dh]
        else:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, Dh]
        return out.reshape(T, q_size)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)  # gate, up
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and small_linear.beats_cublas(x.shape[0], x.shape[1], x.dtype):
            # The gate in the w13 product's epilogue: one launch less, the [T, 2I] product never stored.
            return project(small_linear.small_linear_triton(x, self.w13.weight, gated_output=True), self.w2)
        gate_up = self.w13(x)  # [T, 2I]
        if x.is_cuda:
            return self.w2(activation.silu_and_mul_triton(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.w2(nn.functional.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, residual, rope, k_cache, v_cache, meta):
        """x: the previous block's output, residual: the stream before it (None at the first block).

        Returns (this block's MLP output, the residual stream before it); the
        caller adds them, fused into the next norm.
        """
        if residual is None:
            h, residual = self.attention_norm(x), x
        else:
            h, residual = self.attention_norm.add_forward(x, residual)
        attn = self.attention(h, rope, k_cache, v_cache, meta)
        h, residual = self.ffn_norm.add_forward(attn, residual)
        return self.feed_forward(h), residual

    def forward_one_row(self, h, rope, k_cache, v_cache, meta) -> torch.Tensor:
        """The block for one token on a GPU: h is the residual stream [1, D]; returns the next.

        Four launches of the small-batch linear kernel replace the two norms, the gate
        and the four matmuls: each norm, the gate and each residual add ride along with
        the projection next to them (see ``kernels/small_linear.py``): the gate in w13's
        epilogue for a wide model, in w2's prologue for a small one (``gate_in_epilogue``).
        """
        attention, ffn = self.attention, self.feed_forward
        qkv = small_linear.small_linear_triton(
            h, attention.wqkv.weight, norm_weight=self.attention_norm.weight, eps=self.attention_norm.eps)
        h = small_linear.small_linear_triton(
            attention.attend(qkv, rope, k_cache, v_cache, meta), attention.wo.weight, residual=h)
        norm = dict(norm_weight=self.ffn_norm.weight, eps=self.ffn_norm.eps)
        if small_linear.gate_in_epilogue(h.shape[0], h.shape[1]):
            gated = small_linear.small_linear_triton(h, ffn.w13.weight, gated_output=True, **norm)
            return small_linear.small_linear_triton(gated, ffn.w2.weight, residual=h)
        gate_up = small_linear.small_linear_triton(h, ffn.w13.weight, **norm)
        return small_linear.small_linear_triton(gate_up, ffn.w2.weight, gated=True, residual=h)


class LlamaModel(nn.Module):
    """The decoder. ``forward`` returns hidden states; ``compute_logits`` the vocab scores."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: k, v [pages, page_size, Hkv, Dh]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if input_ids.is_cuda:
            rope = (positions, self.inv_freq)  # the fused kernel computes cos/sin itself
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, Dh // 2]
            rope = (freqs.cos(), freqs.sin())
        x, residual = self.tok_embeddings(input_ids), None  # [T, D]
        if input_ids.is_cuda and input_ids.shape[0] == 1 and not self.config.attention_bias:
            # Batch-1 decode reads every weight for one row: the fused small-row path.
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x = layer.forward_one_row(x, rope, k_cache, v_cache, meta)
            return self.norm(x)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, k_cache, v_cache, meta)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> logits [N, V] in fp32."""
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return torch.nn.functional.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        c = self.config
        for name, tensor in weights:
            target, offset = _hf_to_spark(name, c)
            param = params[target]
            if offset is None:
                param.copy_(tensor)
            else:
                param.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            filled.add(f"{target}@{offset}")
        expected = {f"{t}@{o}" for t, o in (_hf_to_spark(n, c) for n in hf_weight_names(c))}
        missing = expected - filled
        if missing:
            raise ValueError(f"weights missing for {len(missing)} tensors, e.g. {sorted(missing)[0]}")


def hf_weight_names(c: ModelConfig) -> list[str]:
    """The HF tensor names a checkpoint of this config holds."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not c.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if c.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if c.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


_LAYER_MAP = {
    "input_layernorm.weight": ("attention_norm.weight", None),
    "post_attention_layernorm.weight": ("ffn_norm.weight", None),
    "self_attn.o_proj.weight": ("attention.wo.weight", None),
    "self_attn.q_norm.weight": ("attention.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attention.k_norm.weight", None),
    "mlp.down_proj.weight": ("feed_forward.w2.weight", None),
}


def _hf_to_spark(name: str, c: ModelConfig) -> tuple[str, int | None]:
    """Map an HF tensor name to (our parameter name, row offset inside a fused parameter or None)."""
    top = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name], None
    _, _, index, rest = name.split(".", 3)
    prefix = f"layers.{index}."
    if rest in _LAYER_MAP:
        target, offset = _LAYER_MAP[rest]
        return prefix + target, offset
    kind, proj, suffix = rest.split(".")  # e.g. self_attn, q_proj, weight
    fused_offsets = {
        "q_proj": ("attention.wqkv", 0),
        "k_proj": ("attention.wqkv", c.q_size),
        "v_proj": ("attention.wqkv", c.q_size + c.kv_size),
        "gate_proj": ("feed_forward.w13", 0),
        "up_proj": ("feed_forward.w13", c.intermediate_size),
    }
    if proj not in fused_offsets:
        raise KeyError(f"unexpected weight {name}")
    target, offset = fused_offsets[proj]
    return f"{prefix}{target}.{suffix}", offset
