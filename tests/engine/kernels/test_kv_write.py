import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels.kv_write import write_kv_reference, write_kv_triton


def _inputs(num_tokens, num_pages, page_size, num_kv_heads, head_dim, seed=0):
    """Random K/V (strided views of a fused qkv-like buffer), NaN caches, shuffled slots with some -1."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen)
    k, v = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    return k, v, k_cache, v_cache, slots


def test_reference_writes_each_slot_and_skips_padding():
    k, v, k_cache, v_cache, slots = _inputs(num_tokens=12, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8)
    write_kv_reference(k, v, k_cache, v_cache, slots)
    written = torch.zeros(5, 4, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, offset = divmod(slot, 4)
        written[page, offset] = True
        assert torch.equal(k_cache[page, offset], k[t]) and torch.equal(v_cache[page, offset], v[t])
    assert (slots == -1).any()
    # Nothing else was touched: every slot no token maps to is still NaN.
    assert k_cache[~written].isnan().all() and v_cache[~written].isnan().all()


def test_reference_writes_through_a_view_of_a_larger_allocation():
    # The engine's caches are views into one [layers, 2, pages, ...] allocation.
    pool = torch.zeros(2, 2, 3, 4, 1, 8)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    k, v = torch.ones(2, 1, 8), 2 * torch.ones(2, 1, 8)
    write_kv_reference(k, v, k_cache, v_cache, torch.tensor([0, 11]))
    assert pool[1, 0, 0, 0].eq(1).all() and pool[1, 1, 2, 3].eq(2).all()
    assert pool.sum() == 2 * 8 * (1 + 2)


@pytest.mark.parametrize(
    "page_size, num_kv_heads, head_dim",
    [(1, 1, 32), (8, 2, 64), (16, 3, 128), (32, 2, 64)],
)
def test_triton_matches_reference(page_size, num_kv_heads, head_dim):
    k, v, k_cache, v_cache, slots = _inputs(40, 96 // page_size + 2, page_size, num_kv_heads, head_dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, k_ref, v_ref, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    # Bit-exact copies, and the untouched slots stay NaN in both.
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def test_triton_bf16():
    k, v, k_cache, v_cache, slots = _inputs(10, 4, 8, 2, 64)
    k, v, k_cache, v_cache = k.bfloat16(), v.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, k_ref, v_ref, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def test_triton_all_padding_writes_nothing():
    k, v, k_cache, v_cache, slots = _inputs(6, 4, 8, 2, 32)
    write_kv_triton(k, v, k_cache, v_cache, torch.full_like(slots, -1))
    assert k_cache.isnan().all() and v_cache.isnan().all()
