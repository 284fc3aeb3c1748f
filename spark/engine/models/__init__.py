"""The model registry: every architecture Spark runs, in one table.

Config validation, the HF and GGUF readers and ``Engine.load`` all read
``ARCHITECTURES``; adding a family is one model file plus one line here. The
table is torch-free (classes are named, imported on first use) because the HTTP
process resolves and checks a model before the engine process loads it.
"""

from __future__ import annotations

import importlib

import attrs


@attrs.frozen
class Architecture:
    """One model family as Spark names it, and what checkpoints call it.

    Attributes:
      name: ``ModelConfig.arch``.
      model: ``"module:Class"`` under ``spark.engine.models``; the class is built
        from ``(config, runtime)`` (see ``runtime.Model``).
      hf_model_types: HF ``config.json`` ``model_type`` values of this family.
      gguf_archs: GGUF ``general.architecture`` values read as this family.
      attention_bias: q/k/v always carry a bias (HF configs may also say so per model).
      qk_norm: a per-head RMSNorm on q and k.
      norm_topk_prob: the router renormalises its top-k weights whatever the config says (Mixtral).
      moe_names: in an MoE family's checkpoints, (the feed-forward module, an expert's gate, up and
        down projections): ``model.layers.{i}.{module}.gate.weight`` is the router,
        ``model.layers.{i}.{module}.experts.{e}.{gate}.weight`` expert ``e``'s gate; () for a dense family.
    """

    name: str
    model: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...] = ()
    attention_bias: bool = False
    qk_norm: bool = False
    norm_topk_prob: bool = False
    moe_names: tuple[str, ...] = ()


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "llama:LlamaModel", ("llama",), ("llama",)),  # Mistral GGUFs say "llama" too: same block
    Architecture("mistral", "llama:LlamaModel", ("mistral",)),
    Architecture("qwen2", "llama:LlamaModel", ("qwen2",), ("qwen2",), attention_bias=True),
    Architecture("qwen3", "llama:LlamaModel", ("qwen3",), ("qwen3",), qk_norm=True),
    Architecture("qwen3_moe", "moe:MoeModel", ("qwen3_moe",), ("qwen3moe",), qk_norm=True,
                 moe_names=("mlp", "gate_proj", "up_proj", "down_proj")),
    # Mixtral GGUFs say "llama" with an expert count (gguf.config_from_gguf tells them apart).
    Architecture("mixtral", "moe:MoeModel", ("mixtral",), norm_topk_prob=True,
                 moe_names=("block_sparse_moe", "w1", "w3", "w2")),
)}

SUPPORTED_ARCHS = tuple(ARCHITECTURES)
HF_MODEL_TYPES = {t: a for a in ARCHITECTURES.values() for t in a.hf_model_types}
GGUF_ARCHS = {g: a for a in ARCHITECTURES.values() for g in a.gguf_archs}


def model_class(arch: str) -> type:
    """The model class of ``arch`` (a key of ``ARCHITECTURES``), imported now.

    Raises:
      KeyError: ``arch`` is not in the table; the message lists the supported ones.
    """
    try:
        module, name = ARCHITECTURES[arch].model.split(":")
    except KeyError:
        raise KeyError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
