"""KV cache sizing and layout."""

from __future__ import annotations

import pytest
import torch

from spark.engine.kv_cache import KVCache, num_pages_for_budget
from spark.engine.weights.dummy import PRESETS

SMOLLM2 = PRESETS["smollm2-135m"]  # 30 layers, 3 kv heads of 64
TINY_QWEN3 = PRESETS["tiny-qwen3"]  # 2 layers, 2 kv heads of 32 (head_dim != hidden / heads)


def test_bytes_per_token():
    # K and V, every layer, every kv head: 2 * 30 * 3 * 64 = 11520 values.
    assert SMOLLM2.kv_bytes_per_token(4) == 11520 * 4
    assert SMOLLM2.kv_bytes_per_token(2) == 11520 * 2


@pytest.mark.parametrize(
    "budget, page_size, dtype, pages",
    [
        (1 << 30, 16, torch.float32, (1 << 30) // (16 * 11520 * 4)),  # 1456
        (1 << 30, 16, torch.bfloat16, (1 << 30) // (16 * 11520 * 2)),  # twice as many
        (16 * 11520 * 4 * 7, 16, torch.float32, 7),  # exactly 7 pages
        (16 * 11520 * 4 * 7 - 1, 16, torch.float32, 6),  # a byte short of 7: rounds down
        (16 * 11520 * 4 - 1, 16, torch.float32, 0),  # less than one page
        (0, 16, torch.float32, 0),
        (11520 * 4 * 100, 1, torch.float32, 100),
    ],
)
def test_num_pages_for_budget(budget, page_size, dtype, pages):
    assert num_pages_for_budget(SMOLLM2, budget, page_size, dtype) == pages


def test_a_gigabyte_budget():
    assert num_pages_for_budget(SMOLLM2, 1 << 30, 16, torch.float32) == 1456


def test_layout_and_views():
    c = TINY_QWEN3
    cache = KVCache(c, num_pages=5, page_size=4, dtype=torch.bfloat16, device="cpu")
    assert cache.storage.shape == (c.num_layers, 2, 5, 4, c.num_kv_heads, c.head_dim) == (2, 2, 5, 4, 2, 32)
    assert cache.storage.dtype == torch.bfloat16 and not cache.storage.any()  # zeroed
    assert cache.nbytes == 2 * 2 * 5 * 4 * 2 * 32 * 2 == 5 * 4 * c.kv_bytes_per_token(2)
    assert len(cache.layers) == c.num_layers
    for i, (k, v) in enumerate(cache.layers):
        assert k.shape == v.shape == (5, 4, 2, 32)  # [pages, page_size, Hkv, Dh]
        assert k.is_contiguous() and v.is_contiguous()
        k[3, 1, 0] = 1.0 + i  # the views write into the one allocation
        v[2, 0, 1] = -1.0 - i
        assert cache.storage[i, 0, 3, 1, 0].eq(1.0 + i).all() and cache.storage[i, 1, 2, 0, 1].eq(-1.0 - i).all()
    assert cache.storage.count_nonzero() == c.num_layers * 2 * c.head_dim
    assert cache.layers[0][0].data_ptr() != cache.layers[1][0].data_ptr()


def test_an_fp8_cache_holds_twice_the_pages_and_its_scales():
    from spark.engine.kernels.fp8 import FP8
    from spark.engine.kv_cache import ScaledPages, kv_storage_dtype, pages_and_scale

    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16 and kv_storage_dtype("fp8", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="expected one of auto, fp8"):
        kv_storage_dtype("int8", torch.bfloat16)
    assert num_pages_for_budget(SMOLLM2, 1 << 30, 16, FP8) == (1 << 30) // (16 * 11520)  # 5825: twice bf16's, and one
    assert num_pages_for_budget(SMOLLM2, 1 << 30, 16, torch.bfloat16) == 2912
    c = TINY_QWEN3
    cache = KVCache(c, num_pages=5, page_size=4, dtype=FP8, device="cpu")
    assert cache.nbytes == 5 * 4 * c.kv_bytes_per_token(1)
    assert cache.scales.shape == (c.num_layers, 2, c.num_kv_heads) and cache.scales.eq(1).all()
    for i, (k, v) in enumerate(cache.layers):
        assert isinstance(k, ScaledPages) and isinstance(v, ScaledPages)
        assert k.pages.dtype == FP8 and k.pages.shape == (5, 4, 2, 32)
        assert k.scale.data_ptr() == cache.scales[i, 0].data_ptr() and v.scale.data_ptr() == cache.scales[i, 1].data_ptr()
        assert pages_and_scale(k) == (k.pages, k.scale)
    plain = KVCache(c, num_pages=5, page_size=4, dtype=torch.bfloat16, device="cpu")
    assert plain.scales is None and pages_and_scale(plain.layers[0][0])[1] is None
