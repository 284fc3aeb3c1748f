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
from spark.engine.models import model_class, quantized
from spark.engine.models.ops import CpuOps, Ops, TorchOps, TritonOps
from spark.engine.parallel import SINGLE, TensorParallel


@attrs.frozen
class Runtime:
    """Where a model runs, in what dtype, with which kernels and weight format; fixed when it is built.

    Under tensor parallelism ``tp`` names the rank and its group: a model built from
    ``(config, runtime)`` then holds that rank's slice of each weight (``config.shard``) and
    joins the slices with ``tp``'s collectives (``spark.engine.parallel``).
    """

    device: torch.device
    dtype: torch.dtype  # the activations', the norms' and the KV cache's
    ops: Ops
    weight_format: str = "dense"  # a key of quantized.FORMATS: "dense" (in ``dtype``), "int4", "int8"
    tp: TensorParallel = SINGLE

    @classmethod
    def for_device(cls, device: str | torch.device, dtype: torch.dtype | None = None,
                   weight_format: str | None = None) -> "Runtime":
        """The Triton kernels in bf16 with dense weights on a GPU. On the CPU ``CpuOps``, and by default
        4-bit weights with bf16 activations; dense float32 when ``dtype`` is given, or when this torch
        lacks the 4-bit ops. Elsewhere the torch references, dense, in fp32 unless ``dtype``.

        Raises:
            ValueError: an unknown format, a packed one off the CPU or without its ops, or a ``dtype``
              other than the one the format computes in.
        """
        device = torch.device(device)
        if weight_format is not None and weight_format not in quantized.FORMATS:
            raise ValueError(f"unknown weight format {weight_format!r} (known: {', '.join(quantized.FORMATS)})")
        if device.type != "cpu":
            if weight_format not in (None, "dense"):
                raise ValueError(f"weight format {weight_format!r} runs on the CPU only, not on {device.type}")
            on_gpu = device.type == "cuda"
            return cls(device, dtype or (torch.bfloat16 if on_gpu else torch.float32),
                       TritonOps() if on_gpu else TorchOps())
        if weight_format is None:
            weight_format = "int4" if dtype is None and not quantized.missing_ops("int4") else "dense"
        computes_in = quantized.FORMATS[weight_format]
        if computes_in is not None:
            missing = quantized.missing_ops(weight_format)
            if missing:
                raise ValueError(f"weight format {weight_format!r} needs {', '.join(missing)}, "
                                 f"which torch {torch.__version__} lacks")
            if dtype not in (None, computes_in):
                raise ValueError(f"{weight_format} weights compute in {computes_in}, not {dtype}")
            dtype = computes_in
        return cls(device, dtype or torch.float32, CpuOps(), weight_format)

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype weights are read in: float32 for a packed format (quantized from it), else ``dtype``."""
        return self.dtype if self.weight_format == "dense" else torch.float32


class Model(Protocol):
    """What the engine and the CUDA graphs call on a model (an ``nn.Module``)."""

    config: ModelConfig  # the whole model's, whatever slice of it this rank holds
    tp: TensorParallel

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
    initialised only to be overwritten (and, on the CPU, never touched until loaded). A packed
    weight format is loaded dense in float32 (``weights`` in ``runtime.load_dtype``), each linear
    packed as soon as it is whole.
    """
    cls = model_class(config.arch)
    with torch.device("meta"):
        net = cls(config, runtime)
    # Module.to_empty, but with torch.empty: empty_like of a meta tensor runs a Python ref that
    # imports sympy (30 MB resident, for nothing the engine uses).
    # Floating tensors are made in the load dtype at once: made in float32 and then cast, a 30B model
    # would need 1.5x its bf16 bytes (OOM on one GPU).
    net = net._apply(lambda t: torch.empty(t.shape, dtype=runtime.load_dtype if t.is_floating_point() else t.dtype,
                                           device=runtime.device))
    net.init_buffers()  # after .to(dtype): non-persistent buffers (rope frequencies) stay fp32
    if runtime.weight_format != "dense":  # each linear packed once loaded: no whole float32 model
        weights = quantized.packed_as_loaded(net, weights, runtime.weight_format, runtime.dtype)
    net.load_weights(weights)
    if runtime.weight_format != "dense":
        net = quantized.pack_model(net, runtime.weight_format, runtime.dtype)
    return net.eval()
