"""The KV cache tensors: one allocation, viewed per layer as K and V pages."""

from __future__ import annotations

import math
import mmap

import torch

from spark.engine.config import ModelConfig


def num_pages_for_budget(config: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
    """How many pages of ``page_size`` tokens fit in ``budget_bytes``."""
    page_bytes = page_size * config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    return max(0, budget_bytes // page_bytes)


class KVCache:
    """Pages for every layer: ``layers[i] = (k, v)``, each ``[num_pages, page_size, Hkv, Dh]``."""

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

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
