import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels.rope import (
    apply_rope_reference,
    rope_and_write_kv_reference,
    rope_and_write_kv_triton,
)
from spark.engine.attention import apply_rope
from spark.engine.models.ops import TorchOps
from tests.engine.kernels.conftest import assert_bf16_nearly_exact


def _inv_freq(head_dim, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def _qkv(positions, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """q and k as strided views of one fused [T, H + 2*Hkv, Dh] projection output, and that buffer."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(len(positions), num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
    return q, k, fused


# Prefill from 0, a continued chunk, decode positions, and long-context angles (~1e5 rad).
POSITIONS = torch.tensor([0, 1, 2, 3, 17, 18, 19, 511, 4096, 32767, 131071])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_llama_apply_rope(dtype):
    q, k, _ = _qkv(POSITIONS, 9, 3, 64, dtype)
    inv_freq = _inv_freq(64)
    # The model's way: cos/sin once per step, then one rotation per tensor.
    cos, sin = TorchOps.rope(POSITIONS, inv_freq)
    q_out, k_out = apply_rope_reference(q, k, POSITIONS, inv_freq)
    assert torch.equal(q_out, apply_rope(q, cos, sin)) and torch.equal(k_out, apply_rope(k, cos, sin))


def test_reference_rotates_by_position():
    # Position 0 is the identity; a rotation keeps each (x1, x2) pair's norm.
    q, k, _ = _qkv(POSITIONS, 2, 1, 32)
    q_out, _ = apply_rope_reference(q, k, POSITIONS, _inv_freq(32))
    torch.testing.assert_close(q_out[0], q[0], rtol=0, atol=0)
    def pair_norm(x):
        return x[..., :16] ** 2 + x[..., 16:] ** 2

    torch.testing.assert_close(pair_norm(q_out), pair_norm(q))
    assert not torch.allclose(q_out[1:], q[1:])


# (H, Hkv, Dh): GQA groups 3 and 4, MHA, head_dim 64 and 128.
HEADS = [(9, 3, 64), (8, 2, 128), (4, 4, 64)]


def _fused_inputs(num_heads, num_kv_heads, head_dim, page_size, dtype=torch.float32, cache_dtype=None, seed=0):
    """Strided q/k/v views of one fused [T, (H + 2*Hkv) * Dh] projection, NaN caches, shuffled slots with -1s."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(POSITIONS)
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = fused.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    num_pages = 2 * num_tokens // page_size + 1
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=cache_dtype or dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[[1, 5, 8]] = -1
    return (q, k, v), fused, (k_cache, v_cache), slots


def _run_both(q, k, v, caches, slots, inv_freq):
    """(triton's q, k_cache, v_cache), (the reference's), each on its own copy of the caches."""
    k_ref, v_ref = caches[0].clone(), caches[1].clone()
    q_ref = rope_and_write_kv_reference(q, k, v, POSITIONS, inv_freq, k_ref, v_ref, slots)
    k_tri, v_tri = caches[0].clone(), caches[1].clone()
    q_tri = rope_and_write_kv_triton(q, k, v, POSITIONS, inv_freq, k_tri, v_tri, slots)
    return (q_tri, k_tri, v_tri), (q_ref, k_ref, v_ref)


def test_fused_reference_is_rope_then_write():
    (q, k, v), _, (k_cache, v_cache), slots = _fused_inputs(4, 2, 64, 16)
    q_out = rope_and_write_kv_reference(q, k, v, POSITIONS, _inv_freq(64), k_cache, v_cache, slots)
    q_rot, k_rot = apply_rope_reference(q, k, POSITIONS, _inv_freq(64))
    assert torch.equal(q_out, q_rot)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 16, slot % 16], k_rot[t])
            assert torch.equal(v_cache[slot // 16, slot % 16], v[t])
    assert k_cache.isnan().sum() == v_cache.isnan().sum() == k_cache.numel() - 8 * 2 * 64  # 8 real tokens


# (H, Hkv, Dh, page_size): GQA groups 1 to 8, head_dim 64 and 128, page sizes 1 and 16,
# head counts that are not powers of two (masked lanes).
FUSED_SHAPES = [(4, 4, 64, 16), (6, 3, 64, 1), (8, 2, 128, 16), (9, 3, 128, 1), (16, 2, 64, 16), (8, 1, 128, 16)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page_size", FUSED_SHAPES)
def test_fused_triton_matches_reference(num_heads, num_kv_heads, head_dim, page_size):
    (q, k, v), fused, caches, slots = _fused_inputs(num_heads, num_kv_heads, head_dim, page_size)
    fused_before = fused.clone()
    (q_tri, k_tri, v_tri), (q_ref, k_ref, v_ref) = _run_both(q, k, v, caches, slots, _inv_freq(head_dim, 500000.0))
    assert q_tri.shape == q.shape and q_tri.is_contiguous() and q_tri.dtype == q.dtype
    # Padding tokens' q is rotated too; cos/sin differ from torch's by ~1-2 fp32 ulps.
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_tri, k_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    # v is copied bit for bit; slots no real token maps to (padding's included) stay NaN.
    torch.testing.assert_close(v_tri, v_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(k_tri.isnan(), k_ref.isnan()) and (slots == -1).sum() == 3
    assert torch.equal(fused, fused_before)  # the qkv projection output is left as it was


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_fused_triton_bf16(dtype, cache_dtype, bf16_rounds_to_nearest):
    (q, k, v), _, caches, slots = _fused_inputs(8, 2, 64, 16, dtype, cache_dtype)
    (q_tri, k_tri, v_tri), (q_ref, k_ref, v_ref) = _run_both(q, k, v, caches, slots, _inv_freq(64))
    written = ~k_ref.isnan()
    assert torch.equal(k_tri.isnan(), ~written) and torch.equal(v_tri.isnan(), ~written)
    torch.testing.assert_close(v_tri, v_ref, rtol=0, atol=0, equal_nan=True)
    if dtype == torch.bfloat16:
        assert_bf16_nearly_exact(q_tri, q_ref)
    else:
        torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    # k rounds to k's dtype before the cache's, as the reference's k_rot does: a bf16 k
    # in an fp32 cache holds bf16 values exactly. Either way, every written k is a bf16.
    k_tri, k_ref = k_tri[written], k_ref[written]
    assert torch.equal(k_tri.bfloat16().to(cache_dtype), k_tri)
    assert_bf16_nearly_exact(k_tri.bfloat16(), k_ref.bfloat16())


def test_fused_triton_writes_through_interleaved_cache_views():
    # Pages of k and v interleaved in one pool: the page stride is not page_size * the
    # offset stride, so the slot must be split into (page, offset), not used flat.
    (q, k, v), _, _, slots = _fused_inputs(6, 2, 64, 4)
    pool = torch.full((len(POSITIONS), 2, 4, 2, 64), float("nan"))
    pool_ref = pool.clone()
    rope_and_write_kv_triton(q, k, v, POSITIONS, _inv_freq(64), pool[:, 0], pool[:, 1], slots)
    rope_and_write_kv_reference(q, k, v, POSITIONS, _inv_freq(64), pool_ref[:, 0], pool_ref[:, 1], slots)
    assert pool[:, 0].stride(0) != 4 * pool[:, 0].stride(1)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(pool.isnan(), pool_ref.isnan()) and not pool.isnan().all()


def test_fused_triton_all_padding_writes_nothing():
    (q, k, v), _, (k_cache, v_cache), slots = _fused_inputs(4, 2, 64, 16)
    q_out = rope_and_write_kv_triton(q, k, v, POSITIONS, _inv_freq(64), k_cache, v_cache, torch.full_like(slots, -1))
    assert k_cache.isnan().all() and v_cache.isnan().all()
    torch.testing.assert_close(q_out, apply_rope_reference(q, k, POSITIONS, _inv_freq(64))[0], rtol=1e-5, atol=1e-5)


def test_fused_triton_no_tokens():
    (q, k, v), _, (k_cache, v_cache), _ = _fused_inputs(4, 2, 64, 16)
    empty = torch.zeros(0, dtype=torch.int64)
    q_out = rope_and_write_kv_triton(q[:0], k[:0], v[:0], empty, _inv_freq(64), k_cache, v_cache, empty)
    assert q_out.shape == (0, 4, 64) and k_cache.isnan().all()
