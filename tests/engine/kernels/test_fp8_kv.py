"""The FP8 KV cache's kernels against their torch references (Triton's interpreter on the CPU).

Every kernel that writes K/V stores ``clamp(x / scale, ±448)`` rounded to e4m3, bit for bit as
the reference; every kernel that reads dequantizes (its scales folded into the score multiplier
and the output) and agrees with the reference's attention over the dequantized cache.
"""

import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels import fp8
from spark.engine.kernels.kv_write import write_kv_reference, write_kv_triton
from spark.engine.kernels.paged_attention import (
    paged_attention_reference,
    paged_decode_attention_reference,
    paged_decode_attention_rope_reference,
    paged_decode_attention_rope_triton,
    paged_decode_attention_triton,
)
from spark.engine.kernels.prefill_attention import paged_prefill_attention_reference, paged_prefill_attention_triton
from spark.engine.kernels.rope import rope_and_write_kv_reference, rope_and_write_kv_triton
from tests.engine.kernels.test_paged_attention import _decode_step, _inv_freq, _paged_batch
from tests.engine.kernels.test_prefill_attention import ROWS, _mixed_batch


def _fp8(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An fp32 cache quantized by per-head ``scale``; NaN (no key) stays NaN."""
    return fp8.quantize_reference(cache.flatten(0, 1), scale).view(cache.shape)


def _nan_cache(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=fp8.FP8)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


SCALES = (torch.tensor([0.5, 0.03125]), torch.tensor([0.01, 2.0]))  # K, V per kv head: powers of 2 and not


def test_quantize_rounds_clamps_and_keeps_ties_even():
    """Ties, the carries into the exponent the interpreter's cast gets wrong, subnormals, both
    ends of the range and beyond: the kernel's rounding is torch's, bit for bit."""
    every = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    every = every[every.isfinite()]
    mags = every.abs().unique()  # sorted
    ties = (mags[:-1] + mags[1:]) / 2  # halfway between neighbours: round to the even one
    special = torch.tensor([7.9, 7.99, 8.5, 0.015625, 0.0156, 0.001, 0.00097656, 447.9, 448.0, 460.0, 1e4, -1e4, 0.0])
    values = torch.cat([every, ties, -ties, special, torch.randn(600) * 4, torch.randn(600) * 0.01])
    n = values.numel() // 2 * 2
    k = values[:n].view(-1, 2, 1)  # [T, Hkv=2, D=1]
    scale = torch.tensor([1.0, 0.25])
    slots = torch.arange(k.shape[0])
    caches = [_nan_cache((k.shape[0], 1, 2, 1)) for _ in range(4)]
    write_kv_reference(k, k, caches[0], caches[1], slots, scale, scale)
    write_kv_triton(k, k, caches[2], caches[3], slots, scale, scale)
    assert torch.equal(_bits(caches[2]), _bits(caches[0])) and torch.equal(_bits(caches[3]), _bits(caches[1]))
    assert caches[0].float().abs().max() == 448.0 and not caches[0].float().isnan().any()


@pytest.mark.parametrize("page_size, head_dim", [(1, 32), (16, 64)])
def test_write_kv_triton_fp8_matches_reference(page_size, head_dim):
    gen = torch.Generator().manual_seed(page_size)
    fused = torch.randn(24, 6, head_dim, generator=gen).bfloat16() * 3
    k, v = fused[:, 2:4], fused[:, 4:]  # strided views, 2 kv heads
    num_pages = 64 // page_size + 2
    slots = torch.randperm(num_pages * page_size, generator=gen)[:24]
    slots[[2, 7]] = -1
    ref = [_nan_cache((num_pages, page_size, 2, head_dim)) for _ in range(2)]
    tri = [c.clone() for c in ref]
    write_kv_reference(k, v, *ref, slots, *SCALES)
    write_kv_triton(k, v, *tri, slots, *SCALES)
    assert torch.equal(_bits(tri[0]), _bits(ref[0])) and torch.equal(_bits(tri[1]), _bits(ref[1]))
    assert ref[0].float().isnan().sum() == ref[0].numel() - 22 * 2 * head_dim  # padding rows wrote nothing


def test_rope_and_write_kv_triton_fp8():
    gen = torch.Generator().manual_seed(0)
    num_tokens, head_dim = 12, 64
    fused = torch.randn(num_tokens, (4 + 2 * 2) * head_dim, generator=gen).bfloat16()
    q, k, v = fused.split((4 * head_dim, 2 * head_dim, 2 * head_dim), dim=-1)
    q, k, v = q.view(num_tokens, 4, head_dim), k.view(num_tokens, 2, head_dim), v.view(num_tokens, 2, head_dim)
    positions = torch.arange(num_tokens) * 37
    slots = torch.randperm(4 * 16, generator=gen)[:num_tokens]
    slots[3] = -1
    inv_freq = _inv_freq(head_dim)
    ref = [_nan_cache((4, 16, 2, head_dim)) for _ in range(2)]
    tri = [c.clone() for c in ref]
    q_ref = rope_and_write_kv_reference(q, k, v, positions, inv_freq, *ref, slots, *SCALES)
    q_tri = rope_and_write_kv_triton(q, k, v, positions, inv_freq, *tri, slots, *SCALES)
    torch.testing.assert_close(q_tri.float(), q_ref.float(), rtol=0, atol=2e-2)
    assert torch.equal(_bits(tri[1]), _bits(ref[1]))  # v: quantized copies
    # k: rotated by cos/sin a few fp32 ulps from torch's, then rounded to bf16 and to e4m3: an
    # element may land one e4m3 step away where its bf16 value did, never more.
    written = ~ref[0].float().isnan()
    assert torch.equal(written, ~tri[0].float().isnan()) and written.sum() == 11 * 2 * head_dim
    a, b = tri[0].float()[written], ref[0].float()[written]
    assert ((a - b).abs() <= b.abs() * 2**-3 + 2**-9).all() and (a == b).float().mean() > 0.97


def _scaled_caches(k_cache, v_cache):
    """The fp32 caches of a test batch as fp8 caches (NaN stays NaN), and their dequantized fp32 values."""
    k8, v8 = _fp8(k_cache * 4, SCALES[0]), _fp8(v_cache, SCALES[1])
    deq = (fp8.dequantize_reference(k8.flatten(0, 1), SCALES[0], torch.float32).view(k8.shape),
           fp8.dequantize_reference(v8.flatten(0, 1), SCALES[1], torch.float32).view(v8.shape))
    return (k8, v8), deq


def test_reference_reads_an_fp8_cache_as_its_dequantized_values():
    rows = [(9, 9), (1, 30), (4, 20)]
    _, _, k_cache, v_cache, tables = _paged_batch([c for _, c in rows], 8, 2, 32)
    (k8, v8), (k_deq, v_deq) = _scaled_caches(k_cache, v_cache)
    qsl = torch.tensor([0, 9, 10, 14], dtype=torch.int32)
    seq_lens = torch.tensor([c for _, c in rows], dtype=torch.int32)
    q = torch.randn(14, 4, 32)
    out = paged_attention_reference(q, k8, v8, qsl, seq_lens, tables, 0.2, *SCALES)
    assert torch.equal(out, paged_attention_reference(q, k_deq, v_deq, qsl, seq_lens, tables, 0.2))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton_fp8_matches_reference(num_splits):
    contexts = [1, 17, 65, 200, 0]
    _, _, k_cache, v_cache, tables = _paged_batch(contexts, 16, 2, 64)
    (k8, v8), _ = _scaled_caches(k_cache, v_cache)
    q = torch.randn(len(contexts), 6, 64)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    out = paged_decode_attention_triton(q, k8, v8, tables, seq_lens, 0.125, num_splits, k_scale=SCALES[0],
                                        v_scale=SCALES[1])
    expected = paged_decode_attention_reference(q, k8, v8, tables, seq_lens, 0.125, *SCALES)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[-1].eq(0).all()
    # Into a caller's strided view: the same bits.
    given = torch.full((len(contexts), 12, 64), 7.0)[:, ::2]
    paged_decode_attention_triton(q, k8, v8, tables, seq_lens, 0.125, num_splits, k_scale=SCALES[0],
                                  v_scale=SCALES[1], out=given)
    assert torch.equal(given, out)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_rope_triton_fp8_matches_reference(num_splits):
    """The fused decode kernel stores the new token quantized (as the unfused rope kernel does)
    and scores it from registers as stored."""
    step = _decode_step([1, 0, 17, 65, 130], 16, 2, 3, 64)
    qkv, positions, slots, caches, tables, seq_lens = step
    caches = tuple(_fp8(c, s) for c, s in zip(caches, SCALES))
    inv_freq = _inv_freq(64, 500000.0)

    def run(fn, **kwargs):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        out = fn(*qkv, positions, inv_freq, k_cache, v_cache, slots, tables, seq_lens, 0.125, **kwargs)
        return out, k_cache, v_cache

    out, k_tri, v_tri = run(paged_decode_attention_rope_triton, num_splits=num_splits, k_scale=SCALES[0],
                            v_scale=SCALES[1])
    expected, k_ref, v_ref = run(paged_decode_attention_rope_reference, k_scale=SCALES[0], v_scale=SCALES[1])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert out[1].eq(0).all()
    given = torch.full((out.shape[0], 2 * out.shape[1], out.shape[2]), 7.0)[:, ::2]
    again, _, _ = run(paged_decode_attention_rope_triton, num_splits=num_splits, k_scale=SCALES[0],
                      v_scale=SCALES[1], out=given)
    assert again is given and torch.equal(given, out)
    k_unfused, v_unfused = caches[0].clone(), caches[1].clone()
    rope_and_write_kv_triton(*qkv, positions, inv_freq, k_unfused, v_unfused, slots, *SCALES)
    assert torch.equal(_bits(k_tri), _bits(k_unfused)) and torch.equal(_bits(v_tri), _bits(v_unfused))
    assert torch.equal(_bits(v_tri), _bits(v_ref))


def test_prefill_triton_fp8_matches_reference():
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = _mixed_batch(ROWS, 16, 2, 3, 64)
    (k8, v8), _ = _scaled_caches(k_cache, v_cache)
    out = paged_prefill_attention_triton(q, k8, v8, qsl, seq_lens, tables, 0.125, 37, *SCALES, block_m=16, block_n=16)
    expected = paged_prefill_attention_reference(q, k8, v8, qsl, seq_lens, tables, 0.125, 37, *SCALES)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
