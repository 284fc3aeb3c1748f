"""The model registry and the runtime: one table of architectures, kernels chosen once."""

import subprocess
import sys

import pytest
import torch

from spark.engine import models
from spark.engine.models import ARCHITECTURES, GGUF_ARCHS, HF_MODEL_TYPES, SUPPORTED_ARCHS, model_class
from spark.engine.models.llama import LlamaModel
from spark.engine.models.moe import MoeModel
from spark.engine.models.ops import CpuOps, TorchOps, TritonOps
from spark.engine.models.runtime import Runtime
from spark.engine.weights.dummy import PRESETS


def test_one_table_names_every_architecture():
    assert SUPPORTED_ARCHS == ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
    assert all(name == a.name for name, a in ARCHITECTURES.items())
    assert {a.name for a in HF_MODEL_TYPES.values()} == set(SUPPORTED_ARCHS)
    assert {g: a.name for g, a in GGUF_ARCHS.items()} == {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                                                          "qwen3moe": "qwen3_moe"}
    assert {p.arch for p in PRESETS.values()} <= set(SUPPORTED_ARCHS)


def test_model_class_of_each_architecture():
    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        assert model_class(arch) is LlamaModel
    for arch in ("qwen3_moe", "mixtral"):
        assert model_class(arch) is MoeModel
    with pytest.raises(KeyError, match=r"unsupported architecture 'gpt2' \(supported: llama, mistral, qwen2, qwen3, "):
        model_class("gpt2")


def test_the_table_imports_without_torch():
    # The HTTP process resolves a model before the engine process loads it: the table must stay light.
    code = (f"import sys; sys.modules['torch'] = None; import {models.__name__} as m; "
            "assert m.SUPPORTED_ARCHS and 'spark.engine.models.llama' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runtime_chooses_kernels_by_device_once():
    cpu, gpu = Runtime.for_device("cpu", torch.float32), Runtime.for_device("cuda")
    assert isinstance(cpu.ops, CpuOps) and cpu.dtype == torch.float32  # (the weight formats: test_quantized)
    assert isinstance(gpu.ops, TritonOps) and gpu.dtype == torch.bfloat16
    assert isinstance(Runtime.for_device("mps").ops, TorchOps)
    assert Runtime.for_device("cpu", torch.bfloat16).dtype == torch.bfloat16
    with torch.device("meta"):
        net = LlamaModel(PRESETS["tiny-qwen3"], cpu)
    # Every module holds the runtime's one ops object: nothing decides per call.
    holders = [m for m in net.modules() if hasattr(m, "ops")]
    assert len(holders) > 10 and all(m.ops is cpu.ops for m in holders)
