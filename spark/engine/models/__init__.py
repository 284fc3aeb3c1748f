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
    """

    name: str
    model: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...] = ()
    attention_bias: bool = False
    qk_norm: bool = False


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "llama:LlamaModel", ("llama",), ("llama",)),  # Mistral GGUFs say "llama" too: same block
    Architecture("mistral", "llama:LlamaModel", ("mistral",)),
    Architecture("qwen2", "llama:LlamaModel", ("qwen2",), ("qwen2",), attention_bias=True),
    Architecture("qwen3", "llama:LlamaModel", ("qwen3",), ("qwen3",), qk_norm=True),
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
