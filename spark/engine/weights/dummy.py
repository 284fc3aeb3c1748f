"""Random weights of real shapes, for benchmarks and tests without a checkpoint."""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch

from spark.engine.config import ModelConfig, RopeScaling
from spark.engine.errors import ModelLoadError

_LLAMA3_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))

PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-70b": ModelConfig(  # 140 GB in bf16: more than one GPU holds (tensor parallelism)
        arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
    "mistral-7b": ModelConfig(  # v0.3
        arch="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen3-30b-a3b": ModelConfig(  # 128 experts of 768, 8 a token: 30.5B parameters, 3.3B active
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645, 151643),
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "mixtral-8x7b": ModelConfig(  # v0.1: 46.7B parameters, 12.9B active
        arch="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
    ),
    # Tiny configs, one per family, each exercising that family's flags. tiny-llama carries
    # Llama-3 scaling whose thresholds put its 8 frequencies in all three bands (3 kept, 2 smoothed, 3 slowed).
    "tiny-llama": ModelConfig(
        arch="llama", **_TINY, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0, original_max_position_embeddings=1024),
    ),
    "tiny-mistral": ModelConfig(arch="mistral", **_TINY, rope_theta=1000000.0),
    "tiny-qwen2": ModelConfig(arch="qwen2", **_TINY, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True),
    # head_dim 32 != hidden / heads, as in real Qwen3 models.
    "tiny-qwen3": ModelConfig(arch="qwen3", **{**_TINY, "head_dim": 32}, rms_norm_eps=1e-6, qk_norm=True),
    # Qwen3-MoE with its second layer dense (mlp_only_layers), top-4 of 8 renormalised.
    "tiny-qwen3-moe": ModelConfig(arch="qwen3_moe", **{**_TINY, "head_dim": 32}, rms_norm_eps=1e-6, qk_norm=True,
                                  num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                                  norm_topk_prob=True, dense_layers=(1,)),
    "tiny-mixtral": ModelConfig(arch="mixtral", **_TINY, rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=128, norm_topk_prob=True),
}


def dummy_config(name: str) -> ModelConfig:
    """The preset config called ``name`` (see ``PRESETS``).

    Raises:
      ModelLoadError: no such preset.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(f"dummy:{name}", f"unknown dummy preset; known: {', '.join(PRESETS)}") from None


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def iter_dummy_tensors(
    shapes: dict[str, tuple[int, ...]], *, seed: int, dtype: torch.dtype, device: str | torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield seeded random weights, made on ``device`` in ``dtype``.

    Each tensor has its own generator seeded from (seed, name), so a tensor's
    values do not depend on which tensors came before it. Norm weights are
    1 + noise (a zero norm would silence the model); the rest are N(0, 0.02).
    """
    device = torch.device(device)
    for name, shape in shapes.items():
        gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
        t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        t.mul_(0.02)
        if "norm" in name:
            t.add_(1.0)
        yield name, t
