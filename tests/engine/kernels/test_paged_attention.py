import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels.decode_plan import DecodeConfig
from spark.engine.kernels.paged_attention import (
    paged_attention_reference,
    paged_decode_attention_reference,
    paged_decode_attention_rope_reference,
    paged_decode_attention_rope_triton,
    paged_decode_attention_triton,
)
from spark.engine.kernels.rope import rope_and_write_kv_reference, rope_and_write_kv_triton
from tests.engine.kernels.conftest import assert_bf16_nearly_exact


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


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton_writes_a_given_out(num_splits):
    """Into a caller's strided [B, H, D] view (split: only the merge writes it), bit for bit what it
    returns without one; an empty context's row is zeroed there too. The reference takes `out` as well."""
    context_lens = [1, 17, 0, 300]
    _, _, k_cache, v_cache, block_tables = _paged_batch(context_lens, 8, 2, 32)
    q = torch.randn(len(context_lens), 6, 32)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, seq_lens, 0.2)
    given = torch.full((len(context_lens), 12, 32), 7.0)[:, 3:9]
    out = paged_decode_attention_triton(*args, num_splits=num_splits, out=given)
    assert out is given and out[2].eq(0).all()
    assert torch.equal(out, paged_decode_attention_triton(*args, num_splits=num_splits))
    ref_given = torch.full_like(q, 7.0)
    assert paged_decode_attention_reference(*args, out=ref_given) is ref_given
    assert torch.equal(ref_given, paged_decode_attention_reference(*args))
    torch.testing.assert_close(out, ref_given, rtol=1e-5, atol=1e-5)


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


def _decode_step(context_lens, page_size, num_kv_heads, group, head_dim, dtype=torch.float32, cache_dtype=None, seed=0):
    """One decode step before rope and the KV write: caches, block tables, the new tokens' q/k/v.

    The caches come from `_paged_batch` (NaN wherever no key is), with each new token's
    slot (position ctx - 1) put back to NaN: this step has not written it yet. A context
    of 0 is a padding row: slot -1, seq_len 0. q, k, v are unrotated strided views of one
    fused `[B, (H + 2*Hkv) * D]` projection, as the model passes them.

    Returns:
      (q, k, v), positions `[B]`, slots `[B]`, (k_cache, v_cache), block_tables, seq_lens.
    """
    _, _, k_cache, v_cache, block_tables = _paged_batch(context_lens, page_size, num_kv_heads, head_dim, seed=seed)
    slots = []
    for b, n in enumerate(context_lens):
        if n == 0:
            slots.append(-1)
            continue
        page, offset = block_tables[b, (n - 1) // page_size].item(), (n - 1) % page_size
        k_cache[page, offset] = v_cache[page, offset] = float("nan")
        slots.append(page * page_size + offset)
    gen = torch.Generator().manual_seed(seed + 1)
    num_heads, kv_dim = num_kv_heads * group, num_kv_heads * head_dim
    fused = torch.randn(len(context_lens), num_heads * head_dim + 2 * kv_dim, generator=gen).to(dtype)
    q, k, v = fused.split((num_heads * head_dim, kv_dim, kv_dim), dim=-1)
    qkv = (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim))
    positions = (torch.tensor(context_lens) - 1).clamp(min=0)
    caches = (k_cache.to(cache_dtype or dtype), v_cache.to(cache_dtype or dtype))
    return qkv, positions, torch.tensor(slots), caches, block_tables, torch.tensor(context_lens, dtype=torch.int32)


def _inv_freq(head_dim, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def _run_rope_decode(fn, qkv, positions, slots, caches, block_tables, seq_lens, **kwargs):
    """fn's output and the caches it wrote, on fresh copies of `caches`."""
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    inv_freq = _inv_freq(qkv[0].shape[-1], 500000.0)
    scale = qkv[0].shape[-1] ** -0.5
    out = fn(*qkv, positions, inv_freq, k_cache, v_cache, slots, block_tables, seq_lens, scale, **kwargs)
    return out, k_cache, v_cache


def _rope_write_only(qkv, positions, slots, caches):
    """The caches as the unfused path's `rope_and_write_kv_triton` leaves them."""
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    rope_and_write_kv_triton(*qkv, positions, _inv_freq(qkv[0].shape[-1], 500000.0), k_cache, v_cache, slots)
    return k_cache, v_cache


# Contexts: the new token alone, a padding row, a page boundary, and 65 / 129 / 300, whose
# new token (key 64 / 128 / 299) opens a partition for 2 and 3 splits (64-key partitions:
# for 65 keys and 3 splits the last one is empty) or sits inside the last one.
ROPE_CONTEXTS = [1, 0, 17, 65, 129, 300]
# (page_size, num_kv_heads, group, head_dim, num_splits): GQA groups 1 to 8, head_dim
# 64 and 128, page sizes 1 and 16, split-KV off, forced (2, 3) and chosen (None).
ROPE_CASES = [
    (1, 2, 1, 64, 1),
    (16, 1, 2, 128, 2),
    (16, 2, 3, 64, 3),
    (1, 1, 4, 64, 2),
    (16, 1, 8, 128, 1),
    (16, 1, 5, 64, None),
]


@pytest.mark.parametrize("page_size, num_kv_heads, group, head_dim, num_splits", ROPE_CASES)
def test_decode_rope_triton_matches_reference(page_size, num_kv_heads, group, head_dim, num_splits):
    step = _decode_step(ROPE_CONTEXTS, page_size, num_kv_heads, group, head_dim, seed=page_size + group)
    qkv, fused_before = step[0], [x.clone() for x in step[0]]

    out, k_tri, v_tri = _run_rope_decode(paged_decode_attention_rope_triton, *step, num_splits=num_splits)
    expected, k_ref, v_ref = _run_rope_decode(paged_decode_attention_rope_reference, *step)

    assert out.shape == qkv[0].shape and out.dtype == torch.float32
    # Only cos/sin differ from torch's (~1-2 fp32 ulps); the padding row comes out zero.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[1].eq(0).all()
    torch.testing.assert_close(k_tri, k_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    # Bit for bit what the unfused kernel writes, and nothing anywhere else (NaN stays NaN).
    k_unfused, v_unfused = _rope_write_only(*step[:4])
    assert torch.equal(k_tri.isnan(), k_ref.isnan()) and torch.equal(v_tri.isnan(), v_ref.isnan())
    torch.testing.assert_close(k_tri, k_unfused, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_tri, v_unfused, rtol=0, atol=0, equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(qkv, fused_before))  # inputs untouched


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("context", [1, 17, 65, 129, 300])
def test_decode_rope_triton_batch_1_early_loads(context, num_splits, monkeypatch):
    """Batch 1 loads its first key block and positions before the wait on the previous
    kernel (`EARLY_LOADS`): the reference's result, and the same as without them."""
    from spark.engine.kernels import paged_attention

    step = _decode_step([context], 16, 1, 4, 128, seed=context)
    early, k_early, v_early = _run_rope_decode(paged_decode_attention_rope_triton, *step, num_splits=num_splits)
    expected, k_ref, _ = _run_rope_decode(paged_decode_attention_rope_reference, *step)
    torch.testing.assert_close(early, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_early, k_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    monkeypatch.setattr(paged_attention, "EARLY_LOADS", False)
    late, k_late, v_late = _run_rope_decode(paged_decode_attention_rope_triton, *step, num_splits=num_splits)
    torch.testing.assert_close(early, late, rtol=1e-6, atol=1e-6)
    assert torch.equal(k_early.nan_to_num(), k_late.nan_to_num()) and torch.equal(v_early.nan_to_num(), v_late.nan_to_num())


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_decode_rope_triton_bf16(cache_dtype, bf16_rounds_to_nearest):
    step = _decode_step([5, 0, 65, 130], 16, 2, 4, 64, torch.bfloat16, cache_dtype)
    (q, k, v), positions, slots, caches, block_tables, seq_lens = step
    k_unfused, v_unfused = _rope_write_only(*step[:4])
    expected, k_ref, v_ref = _run_rope_decode(paged_decode_attention_rope_reference, *step)
    # The reference attends in bf16; the kernel in fp32 on the bf16 rotated q and cache,
    # rounding once: hold it to that computation, within one bf16 rounding of the output.
    scratch = [c.clone() for c in caches]
    q_rot = rope_and_write_kv_reference(q, k, v, positions, _inv_freq(64, 500000.0), *scratch, slots)
    exact = paged_decode_attention_reference(q_rot.float(), k_ref.float(), v_ref.float(), block_tables, seq_lens, 0.125)
    for num_splits in (1, 2):
        out, k_tri, v_tri = _run_rope_decode(paged_decode_attention_rope_triton, *step, num_splits=num_splits)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2e-2)
        torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-4)
        # A bf16 k rounds to bf16 before the cache's dtype, exactly as the unfused kernel.
        torch.testing.assert_close(k_tri, k_unfused, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_tri, v_unfused, rtol=0, atol=0, equal_nan=True)
        written = caches[0].isnan() & ~k_ref.isnan()  # the new tokens' slots: 3 tokens, 2 kv heads
        assert torch.equal(k_tri.isnan(), k_ref.isnan()) and written.sum() == 3 * 2 * 64
        assert_bf16_nearly_exact(k_tri[written].bfloat16(), k_ref[written].bfloat16())


def test_decode_rope_triton_scores_the_new_token_from_registers():
    # Send every new token to a spare slot on page 0, outside all block tables: a kernel
    # that read the token back from the cache would now read NaN at its block-table slot.
    step = _decode_step([1, 40, 100], 16, 1, 2, 64)
    spare = torch.tensor([3, 4, 5])
    out, k_cache, _ = _run_rope_decode(paged_decode_attention_rope_triton, *step, num_splits=2)
    moved, k_moved, _ = _run_rope_decode(paged_decode_attention_rope_triton, *step[:2], spare, *step[3:], num_splits=2)
    assert torch.equal(moved, out) and not out.isnan().any()
    for slot, moved_to in zip(step[2].tolist(), spare.tolist()):
        assert torch.equal(k_moved[0, moved_to], k_cache[slot // 16, slot % 16])
        assert k_moved[slot // 16, slot % 16].isnan().all()


def test_decode_rope_reference_is_rope_write_then_decode():
    (q, k, v), positions, slots, (k_cache, v_cache), block_tables, seq_lens = _decode_step([3, 0, 20], 8, 2, 2, 64)
    inv_freq = _inv_freq(64)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    rope_args = (q, k, v, positions, inv_freq)
    out = paged_decode_attention_rope_reference(*rope_args, k_cache, v_cache, slots, block_tables, seq_lens, 0.1)
    q_rot = rope_and_write_kv_reference(*rope_args, k_ref, v_ref, slots)
    assert torch.equal(out, paged_decode_attention_reference(q_rot, k_ref, v_ref, block_tables, seq_lens, 0.1))
    torch.testing.assert_close((k_cache, v_cache), (k_ref, v_ref), rtol=0, atol=0, equal_nan=True)


def test_pdl_is_off_off_the_gpu():
    """Interpreted or on the CPU, a kernel never gets the Hopper-only launch attribute."""
    from spark.engine.kernels import launch, small_linear

    kernel = small_linear._kernel()
    assert launch.interpreting(kernel)
    assert launch.pdl(kernel, torch.zeros(1)) == {"PDL": False}


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("exit_empty", [False, True])
def test_split_decode_merges_only_the_partitions_holding_keys(rope, exit_empty, monkeypatch):
    """The reduce merges only the partitions holding keys; with `exit_empty` the programs of the
    others return at once and write nothing. Fresh buffers are NaN here: a merge that read an
    unwritten partition would come out NaN."""
    from spark.engine.kernels import paged_attention

    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    contexts = [1, 0, 17, 65, 300]
    step = _decode_step(contexts, 16, 2, 4, 64, seed=5)
    if rope:
        expected, _, _ = _run_rope_decode(paged_decode_attention_rope_reference, *step)
    else:
        (q, _, _), _, _, caches, block_tables, seq_lens = step
        caches = tuple(c.nan_to_num() for c in caches)  # no write this step: the new slots hold a key
        expected = paged_decode_attention_reference(q, *caches, block_tables, seq_lens, 0.125)
    monkeypatch.setattr(paged_attention.torch, "empty", nan_empty)
    config = DecodeConfig(exit_empty=exit_empty)
    for num_splits in (2, 8):
        if rope:
            out, _, _ = _run_rope_decode(paged_decode_attention_rope_triton, *step, num_splits=num_splits,
                                         config=config)
        else:
            out = paged_decode_attention_triton(q, *caches, block_tables, seq_lens, 0.125, num_splits=num_splits,
                                                out=torch.zeros_like(q), config=config)
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_one_row_decode_splits_by_its_own_key_step(monkeypatch):
    """A batch-1 launch given no split count partitions by its 128-key step: a 272-key table in 2, where
    64-key steps made 4 (each partition is whole steps; the result is the reference's either way)."""
    from spark.engine.kernels import paged_attention

    seen = []
    real = paged_attention.choose_num_splits
    monkeypatch.setattr(paged_attention, "choose_num_splits", lambda *a: seen.append(a) or real(*a))
    step = _decode_step([250], 16, 1, 4, 128, seed=3)  # a table of 17 pages
    out, _, _ = _run_rope_decode(paged_decode_attention_rope_triton, *step)
    expected, _, _ = _run_rope_decode(paged_decode_attention_rope_reference, *step)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert seen[-1] == (1, 1, step[4].shape[1] * 16, 128) and real(*seen[-1]) == 2  # the launch's own ask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_rope_triton_with_qk_norm_is_norms_then_the_kernel(dtype, num_splits, bf16_rounds_to_nearest):
    """Qwen3's per-head q/k RMSNorm inside the decode launch (``qk_norm``): the output and the cache the
    unfused path gives (``rms_norm_triton`` on q and k, then the kernel), bit for bit in the cache's k."""
    from spark.engine.kernels import norm

    step = _decode_step([1, 0, 17, 65], 16, 2, 4, 128, seed=11, dtype=dtype)
    q, k, v = step[0]
    gen = torch.Generator().manual_seed(12)
    q_weight, k_weight = ((1 + 0.3 * torch.randn(128, generator=gen)).to(dtype) for _ in range(2))
    fused, k_fused, v_fused = _run_rope_decode(paged_decode_attention_rope_triton, *step, num_splits=num_splits,
                                               qk_norm=(q_weight, k_weight, 1e-6))
    normed = (norm.rms_norm_triton(q, q_weight, 1e-6), norm.rms_norm_triton(k, k_weight, 1e-6), v)
    unfused, k_unfused, v_unfused = _run_rope_decode(paged_decode_attention_rope_triton, normed, *step[1:],
                                                     num_splits=num_splits)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused, unfused, rtol=tol, atol=tol)
    # The row's mean square summed in another order: rarely an ulp of the normed k in bf16.
    same = (k_fused == k_unfused) | (k_fused.isnan() & k_unfused.isnan())
    assert same.float().mean() > 0.99 and torch.equal(v_fused.nan_to_num(), v_unfused.nan_to_num())
    torch.testing.assert_close(k_fused, k_unfused, rtol=tol, atol=tol, equal_nan=True)
