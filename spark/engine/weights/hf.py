"""Hugging Face checkpoints: ``config.json`` plus one or more ``*.safetensors`` shards."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterator

import safetensors
import torch

from spark.engine.config import ModelConfig, RopeScaling
from spark.engine.errors import ModelLoadError
from spark.engine.models import HF_MODEL_TYPES

INDEX = "model.safetensors.index.json"


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise ModelLoadError(path, "file missing") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope_scaling(path: pathlib.Path, cfg: dict[str, Any]) -> RopeScaling | None:
    # transformers >= 5 folds rope_theta and the scaling into "rope_parameters".
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(path, f"unsupported rope_scaling {kind!r} (only 'llama3' is supported)")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(path, f"rope_scaling lacks {e.args[0]}") from e


def config_from_hf(directory: str | os.PathLike) -> ModelConfig:
    """Read a ``ModelConfig`` from an HF model directory's ``config.json`` (and ``generation_config.json``).

    Raises:
      ModelLoadError: missing or unreadable config, unsupported model type or rope scaling.
    """
    directory = pathlib.Path(directory)
    path = directory / "config.json"
    cfg = _read_json(path)
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(path, f"unsupported model_type {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})")
    arch = HF_MODEL_TYPES[model_type]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(path, f"unsupported hidden_act {cfg['hidden_act']!r}")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(path, "mlp_bias is not supported")
    gen_path = directory / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    eos: list[int] = []
    for tok in _ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id")):
        if tok not in eos:
            eos.append(tok)
    bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelConfig(
            arch=arch.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling(path, cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; the others say so in the config.
            attention_bias=arch.attention_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=arch.qk_norm,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
            **_moe_fields(path, arch, cfg),
        )
    except KeyError as e:
        raise ModelLoadError(path, f"config lacks {e.args[0]}") from e


def _moe_fields(path: pathlib.Path, arch, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a mixture of experts (none for a dense family)."""
    if not arch.moe_names:
        return {}
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError(path, "shared experts are not supported")
    layers = int(cfg["num_hidden_layers"])
    # Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th.
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    # transformers 5 writes num_local_experts for Qwen3-MoE too; the published configs say num_experts.
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ModelLoadError(path, "config lacks num_experts")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=arch.norm_topk_prob or bool(cfg.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step != 0),
    )


def shard_files(directory: str | os.PathLike) -> list[pathlib.Path]:
    """The safetensors files that make up the checkpoint, from the index when there is one."""
    directory = pathlib.Path(directory)
    index = directory / INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index, "has no weight_map")
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f, f"shard named in {INDEX} is missing")
        return files
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"]
    # Mistral repos also ship consolidated.safetensors in Mistral's own naming; never mix it in.
    files = sorted(f for f in directory.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise ModelLoadError(directory, "no *.safetensors weights in this directory")
    return files


def _skip(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that a model of this config does not need."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def _open(path: pathlib.Path):
    try:
        return safetensors.safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, OSError: a header it cannot parse
        raise ModelLoadError(path, f"cannot read safetensors ({e})") from e


def hf_tensor_shapes(directory: str | os.PathLike, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the checkpoint (headers only; no data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in shard_files(directory):
        with _open(file) as f:
            for name in f.keys():
                if _skip(name, config):
                    continue
                if name in shapes:
                    raise ModelLoadError(file, f"tensor {name} appears in more than one shard")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def iter_hf_tensors(directory: str | os.PathLike, config: ModelConfig, select=None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor in its stored dtype), one at a time, shard by shard.

    ``select(name)``: (dim, start, length), the only part of that tensor to read (a tensor-parallel
    rank's slice), or None for all of it."""
    for file in shard_files(directory):
        with _open(file) as f:
            for name in f.keys():
                if _skip(name, config):
                    continue
                try:
                    part = select(name) if select is not None else None
                    if part is None:
                        tensor = f.get_tensor(name)
                    else:
                        dim, start, length = part
                        tensor = f.get_slice(name)[(slice(None),) * dim + (slice(start, start + length),)]
                except Exception as e:
                    raise ModelLoadError(file, f"cannot read tensor {name} ({e})") from e
                yield name, tensor
