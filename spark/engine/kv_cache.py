"""The KV cache tensors: one allocation, viewed per layer as K and V pages.

``kv_dtype`` "auto" keeps K/V in the model's dtype; "fp8" in float8 e4m3 with one fp32
scale per layer and KV head for K and for V (``kernels/fp8.py``): half the bytes of bf16,
so twice the tokens in a budget, and half the bytes each decode step reads. The scales
start at 1.0; ``kv_calibration.py`` sets them at load time (powers of two that keep each
head's values inside e4m3's range, ±448, with room to spare: its relative precision is the
same at any magnitude above 2**-6, so a scale buys range, not precision).
"""

from __future__ import annotations

import math
import mmap

import attrs
import torch

from spark.engine.config import ModelConfig
from spark.engine.kernels import fp8

KV_DTYPES = ("auto", "fp8")  # the names the CLI, the serve config and recipes take


def kv_storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache stores K/V in: the model's ("auto") or float8 e4m3 ("fp8")."""
    if kv_dtype == "auto":
        return model_dtype
    if kv_dtype == "fp8":
        return fp8.FP8
    raise ValueError(f"KV cache dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")


@attrs.frozen(eq=False)
class ScaledPages:
    """One layer's K or V pages of an fp8 cache and their scales: a stored value times its head's
    scale is the K or V it holds. What an fp8 cache's ``layers`` hold in place of plain tensors."""

    pages: torch.Tensor  # [num_pages, page_size, Hkv, Dh] float8_e4m3fn
    scale: torch.Tensor  # [Hkv] float32


def pages_and_scale(cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(pages, scale)`` of a layer's ``ScaledPages``, or ``(cache, None)`` for a plain tensor."""
    if isinstance(cache, ScaledPages):
        return cache.pages, cache.scale
    return cache, None


def num_pages_for_budget(config: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
    """How many pages of ``page_size`` tokens fit in ``budget_bytes``."""
    page_bytes = page_size * config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    return max(0, budget_bytes // page_bytes)


class KVCache:
    """Pages for every layer: ``layers[i] = (k, v)``, each ``[num_pages, page_size, Hkv, Dh]``; in an fp8
    cache (``dtype`` float8_e4m3fn) each a ``ScaledPages`` of those pages and ``scales[i, 0 or 1]``."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device):
        self.num_pages = num_pages
        self.page_size = page_size
        # [layers, 2, pages, page_size, Hkv, Dh]; zeros so that never-written
        # slots hold finite values (masked-out NaNs still poison a matmul).
        shape = (config.num_layers, 2, num_pages, page_size, config.num_kv_heads, config.head_dim)
        self._mapping = None
        if torch.device(device).type == "cpu":
            # Anonymous memory: the kernel's zero pages, committed when first written, so the cache
            # is resident as far as sequences have filled it (torch.zeros would write all of it now).
            self._mapping = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE)
            self.storage = torch.frombuffer(self._mapping, dtype=dtype).view(shape)
        else:
            self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(config.num_layers)]
        self.scales = None  # [layers, 2 (K, V), Hkv] fp32 of an fp8 cache
        if dtype == fp8.FP8:
            self.scales = torch.ones(config.num_layers, 2, config.num_kv_heads, dtype=torch.float32, device=device)
            self.layers = [(ScaledPages(k, self.scales[i, 0]), ScaledPages(v, self.scales[i, 1]))
                           for i, (k, v) in enumerate(self.layers)]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
