import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels.prefill_attention import paged_prefill_attention_reference, paged_prefill_attention_triton
from tests.engine.kernels.test_paged_attention import _dense_attention, _paged_batch


def _mixed_batch(rows, page_size, num_kv_heads, group, head_dim, seed=0):
    """A flat batch from `(q_len, context_len)` rows: paged cache (NaN outside the context), q as a strided view.

    Returns:
      q `[T, H, D]`, k_cache, v_cache, query_start_loc, seq_lens, block_tables, dense (k, v) lists.
    """
    dense_k, dense_v, k_cache, v_cache, block_tables = _paged_batch(
        [c for _, c in rows], page_size, num_kv_heads, head_dim, seed=seed
    )
    q_lens = torch.tensor([q for q, _ in rows])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([c for _, c in rows], dtype=torch.int32)
    num_heads = num_kv_heads * group
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(int(q_lens.sum()), num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return fused[:, :num_heads], k_cache, v_cache, query_start_loc, seq_lens, block_tables, (dense_k, dense_v)


# (q_len, context_len): prefill from 0 longer than a page and than a 16-row block, a
# chunk continuing earlier context, the first token of a sequence, decodes (one across a
# page boundary), an idle slot, a short chunk whose context ends mid-page.
ROWS = [(37, 37), (20, 50), (1, 1), (1, 17), (0, 5), (1, 70), (3, 21)]


def test_reference_matches_dense():
    q, k_cache, v_cache, qsl, seq_lens, tables, (dense_k, dense_v) = _mixed_batch(ROWS, 16, 2, 3, 32)
    out = paged_prefill_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.2, max_query_len=37)
    for b in range(len(ROWS)):
        lo, hi = qsl[b].item(), qsl[b + 1].item()
        if hi > lo:
            expected = _dense_attention(q[lo:hi], dense_k[b], dense_v[b], 0.2)
            torch.testing.assert_close(out[lo:hi].double(), expected, rtol=1e-5, atol=1e-5)


# (page_size, num_kv_heads, group, head_dim, block_m, block_n): page sizes 1 and 16, GQA
# groups 1/3/4, head_dim 64/128; small tiles make several query and key blocks per
# sequence, and one case runs the default 64x64 tiles.
CASES = [
    (1, 2, 1, 64, 16, 16),
    (16, 1, 3, 128, 16, 32),
    (16, 2, 4, 64, 32, 16),
    (8, 1, 4, 64, None, None),
]


@pytest.mark.parametrize("page_size, num_kv_heads, group, head_dim, block_m, block_n", CASES)
def test_triton_matches_reference(page_size, num_kv_heads, group, head_dim, block_m, block_n):
    batch = _mixed_batch(ROWS, page_size, num_kv_heads, group, head_dim, seed=page_size)
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = batch
    scale = head_dim**-0.5
    tiles = {} if block_m is None else {"block_m": block_m, "block_n": block_n}
    expected = paged_prefill_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, scale, max_query_len=37)
    out = paged_prefill_attention_triton(q, k_cache, v_cache, qsl, seq_lens, tables, scale, max_query_len=37, **tiles)
    assert out.shape == q.shape and out.dtype == q.dtype
    # fp32 tiles with exact products; only the online softmax's summation order differs.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_triton_oversized_grid_and_padding_rows():
    # A max_query_len above the real one only adds programs that exit at once, and rows
    # past the last sequence (CUDA-graph style padding) come out zero.
    rows = [(1, 9), (18, 18), (2, 40)]
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = _mixed_batch(rows, 4, 1, 2, 32)
    padded_q = torch.cat([q, torch.randn(5, *q.shape[1:])])
    args = (padded_q, k_cache, v_cache, qsl, seq_lens, tables, 0.3)
    out = paged_prefill_attention_triton(*args, max_query_len=50, block_m=16)
    expected = paged_prefill_attention_reference(*args, max_query_len=18)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[-5:].eq(0).all()


def test_triton_bf16_cache(bf16_rounds_to_nearest):
    # The interpreter computes bf16 inputs in fp32 (exact products), so only the output
    # rounding remains: within half a bf16 ulp. On the GPU the dots take bf16 operands and
    # p is rounded to bf16 before PV, which adds up to ~1e-2 absolute.
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = _mixed_batch(ROWS, 16, 2, 4, 64, seed=3)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    expected = paged_prefill_attention_reference(
        q.float(), k_cache.float(), v_cache.float(), qsl, seq_lens, tables, 0.125, max_query_len=37
    )
    out = paged_prefill_attention_triton(
        q, k_cache, v_cache, qsl, seq_lens, tables, 0.125, max_query_len=37, block_m=32
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-5)


def test_a_mixed_step_sends_its_decodes_to_the_decode_kernel():
    """attend_triton splits a step: leading single-token rows through the GQA-grouped decode
    kernel, the rest through the prefill kernel; together they equal the reference."""
    from spark.engine.attention import AttentionMetadata, attend_triton

    rows = [(1, 17), (1, 40), (1, 1), (20, 50), (37, 37), (1, 9)]  # three decodes, two chunks, a late decode
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = _mixed_batch(rows, 16, 2, 4, 64)
    meta = AttentionMetadata(
        slot_mapping=torch.full((q.shape[0],), -1), query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
        decode_only=False, max_query_len=37, num_single=3,
    )
    expected = paged_prefill_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125, max_query_len=37)
    torch.testing.assert_close(attend_triton(q, k_cache, v_cache, meta, 0.125), expected, rtol=2e-4, atol=2e-4)


def test_leading_single_rows_are_counted_from_the_start_only():
    from spark.engine.attention import leading_single_rows

    assert leading_single_rows([0, 1, 2, 3, 23, 24]) == 3
    assert leading_single_rows([0, 5, 6]) == 0
    assert leading_single_rows([0, 1, 2]) == 2
    assert leading_single_rows([0]) == 0


def _sentinel_rows(num_tokens, num_heads, head_dim, dtype=torch.float32):
    """A caller's buffer as the piecewise runner hands it: a [T, H, D] view with strides of its own
    (every other head of a wider buffer), filled with a value no kernel writes."""
    return torch.full((num_tokens, 2 * num_heads, head_dim), 7.0, dtype=dtype)[:, ::2]


@pytest.mark.parametrize("fp8_cache", [False, True])
def test_triton_writes_a_given_out_and_only_the_rows_of_sequences(fp8_cache):
    from tests.engine.kernels.test_fp8_kv import SCALES, _scaled_caches

    rows = [(1, 9), (18, 18), (2, 40)]
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = _mixed_batch(rows, 4, 2, 2, 32)  # 2 kv heads, as SCALES
    padded_q = torch.cat([q, torch.randn(5, *q.shape[1:])])  # 5 rows no sequence owns
    scales = ()
    if fp8_cache:
        (k_cache, v_cache), _ = _scaled_caches(k_cache, v_cache)
        scales = SCALES
    args = (padded_q, k_cache, v_cache, qsl, seq_lens, tables, 0.3, 18, *scales)
    given = _sentinel_rows(*padded_q.shape)
    out = paged_prefill_attention_triton(*args, out=given, block_m=16, block_n=16)
    assert out is given
    fresh = paged_prefill_attention_triton(*args, block_m=16, block_n=16)
    assert torch.equal(out[:-5], fresh[:-5]) and out[-5:].eq(7.0).all()
    # The reference takes `out` too, with the same contract.
    ref_given = _sentinel_rows(*padded_q.shape)
    ref = paged_prefill_attention_reference(*args, out=ref_given)
    assert ref is ref_given and ref[-5:].eq(7.0).all()
    assert torch.equal(ref[:-5], paged_prefill_attention_reference(*args)[:-5])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_single", [0, 3])
def test_a_mixed_step_writes_both_kernels_rows_into_one_out(num_single):
    """attend_triton given an output: the decode and prefill kernels each write their rows of it,
    bit for bit what it returns without one; the step's cut is made once and reused."""
    from spark.engine.attention import AttentionMetadata, attend_triton

    rows = [(1, 17), (1, 40), (1, 1), (20, 50), (37, 37), (1, 9)][3 - num_single:]
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = _mixed_batch(rows, 16, 2, 4, 64)
    meta = AttentionMetadata(
        slot_mapping=torch.full((q.shape[0],), -1), query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
        decode_only=False, max_query_len=37, num_single=num_single,
    )
    fresh = attend_triton(q, k_cache, v_cache, meta, 0.125)
    parts = meta.mixed
    given = _sentinel_rows(*q.shape)
    assert attend_triton(q, k_cache, v_cache, meta, 0.125, given) is given
    assert meta.mixed is parts  # cut once a step, not once a layer
    assert torch.equal(given, fresh)
    assert torch.equal(parts.prefill_query_start_loc, qsl[num_single:] - num_single)
    expected = paged_prefill_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125, max_query_len=37)
    torch.testing.assert_close(given, expected, rtol=2e-4, atol=2e-4)
