"""A Llama-family decoder over a flat varlen batch and a paged KV cache.

One block covers Llama 2/3.x, SmolLM2 and Mistral; Qwen2 adds q/k/v biases
(``config.attention_bias``) and Qwen3 a per-head RMSNorm on q and k
(``config.qk_norm``). The forward takes every token of the step in one flat
batch ``[T]``: prefill chunks and single decode tokens side by side, no padding.
Weights arrive with Hugging Face names and layout; q/k/v and gate/up are fused
at load time so that each block runs two big matmuls instead of five.

This file is the math; which kernels run it is ``ops`` (``models/ops.py``), handed
to every module once at construction by the ``Runtime``. Under tensor parallelism
(``runtime.tp``, ``spark/engine/parallel.py``) the blocks are built from this rank's
slice of the config (``config.shard``): its heads and MLP width; ``wo`` and ``w2`` then
give partial sums that ``tp.reduce`` adds up over the ranks, and the embedding and the
head hold this rank's rows of the vocabulary.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from spark.engine.attention import AttentionMetadata
from spark.engine.config import ModelConfig
from spark.engine.models.ops import Ops
from spark.engine.models.runtime import Runtime
from spark.engine.parallel import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x may be the split-K partials of the projection before."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] on the host, with Llama-3 scaling when configured.

    On the host even while a model is built on the meta device: meta kernels of this
    arithmetic are Python refs that import torch._dynamo (130 MB resident)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE):
        """``config``: this rank's slice (its heads), under tensor parallelism ``tp``."""
        super().__init__()
        self.ops, self.tp = ops, tp
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.wqkv = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, D]; rope: from ops.rope, once a step
        return self.output(self.attend(self.wqkv(x), rope, k_cache, v_cache, meta))

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """``wo`` of ``attend``'s output [T, q]: [T, D], or split-K partials for ``add_rms_norm``."""
        return self.tp.reduce(self.ops.project(attn, self.wo))

    def attend(self, qkv, rope, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of projected ``qkv`` [T, q + 2 kv] over the cache (this step's K/V written). Returns [T, q]."""
        out = self.attend_heads(*self.heads(qkv), rope, k_cache, v_cache, meta)  # [T, H, Dh]
        return out.reshape(qkv.shape[0], self.num_heads * self.head_dim)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views q [T, H, Dh], k, v [T, Hkv, Dh] of ``qkv`` [T, q + 2 kv]: the same for every layer of a
        step whose layers project into one buffer (the piecewise runner's), so made once there."""
        T = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        return (q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                v.view(T, self.num_kv_heads, self.head_dim))

    def attend_heads(self, q, k, v, rope, k_cache, v_cache, meta: AttentionMetadata,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """``attend`` of ``heads``' views. Returns [T, H, Dh]: ``out`` when given (any strides), written in place."""
        if self.q_norm is not None and self.ops.fuses_qk_norm:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return self.ops.attend(q, k, v, rope, k_cache, v_cache, meta, self.scale, out, qk_norm=qk_norm)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.ops.attend(q, k, v, rope, k_cache, v_cache, meta, self.scale, out)


class FeedForward(nn.Module):
    routed = False  # what ``ops.block_one_row`` asks a feed-forward (models/moe.py's SparseMoe: True)

    def __init__(self, config: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE):
        super().__init__()
        self.ops, self.tp = ops, tp
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)  # gate, up
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.reduce(self.ops.swiglu(x, self.w13, self.w2))  # w2(silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.attention = Attention(config, ops, tp)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.feed_forward = FeedForward(config, ops, tp)

    def forward(self, x, residual, rope, k_cache, v_cache, meta):
        """x: the previous block's output, residual: the stream before it (None at the first block).

        Returns (this block's MLP output, the residual stream before it); the
        caller adds them, fused into the next norm.
        """
        qkv, residual = self.before_attention(x, residual)
        return self.after_attention(self.attention.attend(qkv, rope, k_cache, v_cache, meta), residual)

    # The two row-wise halves around attention, apart: piecewise CUDA graphs (``engine/piecewise.py``)
    # capture them, and run attention, which reads the step's metadata, eagerly between them.
    def before_attention(self, x, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv [T, q + 2 kv] of the normed stream, the residual stream) from ``forward``'s x, residual."""
        if residual is None:
            h, residual = self.attention_norm(x), x
        else:
            h, residual = self.attention_norm.add_forward(x, residual)
        return self.attention.wqkv(h), residual

    def after_attention(self, attn, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s result from attention's output [T, q] and the residual stream."""
        h, residual = self.ffn_norm.add_forward(self.attention.output(attn), residual)
        return self.feed_forward(h), residual


class LlamaModel(nn.Module):
    """The decoder. ``forward`` returns hidden states; ``compute_logits`` the vocab scores."""

    def __init__(self, config: ModelConfig, runtime: Runtime):
        super().__init__()
        self.config = config
        self.tp = tp = runtime.tp
        self.shard = config.shard(tp.world_size)  # this rank's heads and MLP width
        ops = self.ops = runtime.ops
        rows = tp.vocab_rows(config.vocab_size)  # this rank's rows of the vocabulary
        # _weight: no random init, whose meta-device kernel would import torch._dynamo (130 MB resident).
        self.tok_embeddings = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.layers = nn.ModuleList(self.make_block(self.shard, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.output = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # Batch-1 decode reads every weight for one row: the fused small-row block, where the
        # kernels have it (its prologue-fused projections take no bias).
        self.one_row = ops.fuses_one_row and not config.attention_bias

    def make_block(self, config: ModelConfig, ops: Ops, layer: int) -> nn.Module:
        """Layer ``layer``'s block, of this rank's slice ``config`` (a family with other blocks overrides this)."""
        return Block(config, ops, self.tp)

    @staticmethod
    def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The checkpoint this model loads, which ``weights.iter_weights`` validates a source against."""
        return hf_weight_shapes(config)

    @staticmethod
    def weight_slice(config: ModelConfig, tp: TensorParallel, name: str) -> tuple[int, int, int] | None:
        """The slice of the HF tensor ``name`` that rank ``tp.rank`` holds: (dim, start, length); None: all."""
        return hf_weight_slice(config, tp, name)

    def weight_target(self, name: str) -> tuple[str, int | tuple[int, int] | None]:
        """Where the HF tensor ``name`` (this rank's slice of it) goes: (parameter, None | row offset |
        (expert, row offset))."""
        return _hf_to_spark(name, self.shard)

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers, which ``to_empty()`` left uninitialised."""
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: k, v [pages, page_size, Hkv, Dh]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        rope = self.ops.rope(positions, self.inv_freq)
        x, residual = self.embed(input_ids), None  # [T, D]
        if self.one_row and input_ids.shape[0] == 1:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x = self.ops.block_one_row(layer, x, rope, k_cache, v_cache, meta)
            return self.norm(x)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, k_cache, v_cache, meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first block's input [T, D]."""
        if self.tp.world_size == 1 and type(self.tok_embeddings) is nn.Embedding:  # not a packed one (quantized.py)
            return self.ops.embed(input_ids, self.tok_embeddings.weight)
        return self.tp.embed(self.tok_embeddings, input_ids, self.config.vocab_size)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The hidden states [T, D] from the last block's output and residual stream."""
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> logits [N, V] in fp32 (every rank's rows, gathered, under tensor parallelism)."""
        if self.output is None:  # tied (packed weights give the head a module of its own, sharing the rows)
            logits = self.ops.head(hidden, self.tok_embeddings.weight)
        elif type(self.output) is nn.Linear:
            logits = self.ops.head(hidden, self.output.weight)
        else:  # a packed head (quantized.py) multiplies itself
            logits = self.output(hidden)
        return self.tp.gather_vocab(logits, self.config.vocab_size).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            target, offset = self.weight_target(name)
            param = params[target]
            if isinstance(offset, tuple):  # (expert, rows) of a stacked expert weight
                param = param[offset[0]]
            if offset is None and tensor.shape[0] < param.shape[0]:  # the last rank's vocabulary, padded
                param[tensor.shape[0]:].zero_()
                param[: tensor.shape[0]].copy_(tensor)
            elif offset is None:
                param.copy_(tensor)
            else:
                param.narrow(0, offset[1] if isinstance(offset, tuple) else offset, tensor.shape[0]).copy_(tensor)
            filled.add(f"{target}@{offset}")
        expected = {f"{t}@{o}" for t, o in map(self.weight_target, self.weight_shapes(self.config))}
        missing = expected - filled
        if missing:
            raise ValueError(f"weights missing for {len(missing)} tensors, e.g. {sorted(missing)[0]}")


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint of ``config`` holds (Linear weights are [out, in])."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


# Tensor parallelism: the HF tensors split along their output rows (each rank its heads, its MLP
# columns) and those split along their input (the rows' partial products, summed over ranks).
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def hf_weight_slice(config: ModelConfig, tp: TensorParallel, name: str) -> tuple[int, int, int] | None:
    """(dim, start, length) of the HF tensor ``name`` that rank ``tp.rank`` of ``tp.world_size`` holds;
    None when every rank holds all of it (norms)."""
    if tp.world_size == 1:
        return None
    if name in _VOCAB:
        rows = tp.vocab_rows(config.vocab_size)
        start = tp.rank * rows
        return 0, start, max(0, min(rows, config.vocab_size - start))
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    if proj not in _COLUMN_PARALLEL and proj not in _ROW_PARALLEL:
        return None
    whole = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size, "o_proj": config.q_size,
             "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size,
             "down_proj": config.intermediate_size}[proj]
    share = whole // tp.world_size
    return (0 if proj in _COLUMN_PARALLEL else 1), tp.rank * share, share


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
