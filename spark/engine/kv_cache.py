"""The KV cache tensors: one allocation, viewed per layer as K and V pages."""

from __future__ import annotations

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
        self.storage = torch.zeros(
            config.num_layers, 2, num_pages, page_size, config.num_kv_heads, config.head_dim,
            dtype=dtype, device=device,
        )
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
