import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels.paged_attention import (
    choose_num_splits,
    paged_attention_reference,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)


def _paged_batch(context_lens, page_size, num_kv_heads, head_dim, seed=0):
    """Dense per-sequence K/V plus the same keys scattered into a paged cache.

    Pages are handed out in shuffled order from 1..P-1; page 0 and every unused slot
    hold NaN, so reading a padded block-table entry or a key past seq_len shows up.

    Returns:
      (dense_k, dense_v) lists of `[ctx, Hkv, D]`, k_cache, v_cache, block_tables `[B, max_pages]` int32.
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in context_lens]
    num_pages = sum(pages_per_seq) + 3
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(context_lens), max(pages_per_seq) + 1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, n in enumerate(context_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        pages = torch.tensor([free.pop() for _ in range(pages_per_seq[b])], dtype=torch.int32)
        block_tables[b, : len(pages)] = pages
        pos = torch.arange(n)
        k_cache[pages[pos // page_size].long(), pos % page_size] = k
        v_cache[pages[pos // page_size].long(), pos % page_size] = v
        dense_k.append(k)
        dense_v.append(v)
    return dense_k, dense_v, k_cache, v_cache, block_tables


def _dense_attention(q, k, v, scale):
    """Plain causal softmax attention in float64 for one sequence's last q_len positions.

    q: `[q_len, H, D]`, k, v: `[ctx, Hkv, D]` -> `[q_len, H, D]`.
    """
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("page_size, num_kv_heads, group", [(1, 2, 1), (16, 1, 3), (8, 2, 4)])
def test_reference_matches_dense_on_a_mixed_batch(page_size, num_kv_heads, group):
    head_dim, scale = 32, 32**-0.5
    # (q_len, ctx): prefill from 0, continued chunk, lone first token, decode, idle slot, decode.
    rows = [(37, 37), (20, 50), (1, 1), (1, page_size + 1), (0, 5), (1, 70)]
    dense_k, dense_v, k_cache, v_cache, block_tables = _paged_batch([c for _, c in rows], page_size, num_kv_heads, head_dim)
    q_lens = torch.tensor([q for q, _ in rows])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([c for _, c in rows], dtype=torch.int32)
    q = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim)

    out = paged_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)

    assert out.shape == q.shape and out.dtype == torch.float32
    for b in range(len(rows)):
        lo, hi = query_start_loc[b].item(), query_start_loc[b + 1].item()
        if hi > lo:
            expected = _dense_attention(q[lo:hi], dense_k[b], dense_v[b], scale)
            torch.testing.assert_close(out[lo:hi].double(), expected, rtol=1e-5, atol=1e-5)


def test_decode_reference_matches_dense():
    context_lens, head_dim = [1, 15, 16, 17, 90], 64
    dense_k, dense_v, k_cache, v_cache, block_tables = _paged_batch(context_lens, 16, 3, head_dim)
    q = torch.randn(len(context_lens), 9, head_dim)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)

    out = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, 0.125)

    for b in range(len(context_lens)):
        expected = _dense_attention(q[b : b + 1], dense_k[b], dense_v[b], 0.125)[0]
        torch.testing.assert_close(out[b].double(), expected, rtol=1e-5, atol=1e-5)


# (page_size, num_kv_heads, group, head_dim, num_splits): every page size, GQA group
# 1/3/4/8, head_dim 32/64/128, split-KV off (1), forced (3: not a power of two; 8:
# more partitions than a short context has keys) and chosen by the heuristic (None).
DECODE_CASES = [
    (1, 2, 1, 32, 1),
    (8, 1, 3, 64, 3),
    (16, 2, 4, 128, 1),
    (32, 1, 8, 64, 8),
    (16, 3, 3, 64, None),
    (8, 1, 4, 32, 8),
]


@pytest.mark.parametrize("page_size, num_kv_heads, group, head_dim, num_splits", DECODE_CASES)
def test_decode_triton_matches_reference(page_size, num_kv_heads, group, head_dim, num_splits):
    # Ragged contexts: 1 key, page boundary -1/0/+1, a few hundred.
    context_lens = sorted({1, max(page_size - 1, 1), page_size, page_size + 1, 300})
    _, _, k_cache, v_cache, block_tables = _paged_batch(context_lens, page_size, num_kv_heads, head_dim, seed=page_size)
    num_heads = num_kv_heads * group
    # q as a strided slice of a fused qkv output, like the model will pass it.
    fused = torch.randn(len(context_lens), num_heads + 2 * num_kv_heads, head_dim)
    q = fused[:, :num_heads]
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    expected = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=num_splits)

    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_decode_triton_half_precision_cache(dtype, atol):
    # The GPU dtypes: loaded as fp32, accumulated in fp32, so only the output rounding remains.
    context_lens = [3, 40, 129]
    _, _, k_cache, v_cache, block_tables = _paged_batch(context_lens, 16, 2, 64)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(3, 6, 64).to(dtype)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    expected = paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, 0.125)

    for num_splits in (1, 2):
        out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, 0.125, num_splits=num_splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_triton_empty_context_gives_zeros(num_splits):
    # CUDA-graph padding rows may carry seq_len 0: they must come out finite, not NaN.
    _, _, k_cache, v_cache, block_tables = _paged_batch([20, 1], 8, 1, 32)
    seq_lens = torch.tensor([20, 0], dtype=torch.int32)
    q = torch.randn(2, 2, 32)

    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, 0.2, num_splits=num_splits)

    assert out[1].eq(0).all()
    expected = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, 0.2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_choose_num_splits():
    # A batch that alone fills the GPU, or short contexts: no split.
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context=32768) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=256) == 1
    # One long sequence: split, capped.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=4096) == 16
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context=1 << 20) == 32
    # Never more partitions than a minimum-size partition allows.
    assert choose_num_splits(batch=2, num_kv_heads=2, max_context=1024) == 4
