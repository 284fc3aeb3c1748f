"""How a model runs (``Runtime``), what the engine may call on one (``Model``), and building one.

A model class is built from ``(config, runtime)``: the config says what the
network is, the runtime where and how it runs. The math never asks a tensor where
it lives; it calls ``runtime.ops``, chosen here once.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import attrs
import torch

from spark.engine.attention import AttentionMetadata
from spark.engine.config import ModelConfig
from spark.engine.models import model_class
from spark.engine.models.ops import Ops, TorchOps, TritonOps


@attrs.frozen
class Runtime:
    """Where a model runs, in what dtype, with which kernels; fixed when it is built.

    Tensor parallelism will add the rank and its group here: a model built from
    ``(config, runtime)`` then holds that rank's shard of each weight and the ops
    gain the collectives. Nothing else in a model's constructor need change.
    """

    device: torch.device
    dtype: torch.dtype
    ops: Ops

    @classmethod
    def for_device(cls, device: str | torch.device, dtype: torch.dtype | None = None) -> "Runtime":
        """The Triton kernels in bf16 on a GPU; the torch references in fp32 elsewhere (unless ``dtype``)."""
        device = torch.device(device)
        on_gpu = device.type == "cuda"
        return cls(device, dtype or (torch.bfloat16 if on_gpu else torch.float32), TritonOps() if on_gpu else TorchOps())


class Model(Protocol):
    """What the engine and the CUDA graphs call on a model (an ``nn.Module``)."""

    config: ModelConfig

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: k, v [pages, page_size, Hkv, Dh]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, D] of every token of the step."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] fp32."""

    def parameters(self) -> Iterable[torch.nn.Parameter]: ...


def build_model(
    config: ModelConfig, runtime: Runtime, weights: Iterable[tuple[str, torch.Tensor]]
) -> Model:
    """The registered model of ``config.arch`` on ``runtime``, filled from HF-named ``weights``, in eval mode.

    Built on the meta device and then allocated in place, so that no weight is ever
    initialised only to be overwritten.
    """
    cls = model_class(config.arch)
    with torch.device("meta"):
        net = cls(config, runtime)
    net = net.to_empty(device=runtime.device).to(runtime.dtype)
    net.init_buffers()  # after .to(dtype): non-persistent buffers (rope frequencies) stay fp32
    net.load_weights(weights)
    return net.eval()
