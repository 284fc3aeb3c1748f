"""Attention over the paged KV cache: torch references and a Triton decode kernel.

Cache layout: `k_cache`, `v_cache` each `[num_pages, page_size, Hkv, D]`; token
position p of sequence b lives at page `block_tables[b, p // page_size]`, offset
`p % page_size`. GQA: query head h reads kv head `h // (H // Hkv)`. `seq_lens`
counts this step's tokens. Every kernel here runs after this step's K/V were
written to the cache, except `paged_decode_attention_rope_*`, which rotate q and k
and write the new token's K/V themselves: decode at small batch is bound by kernel
launches, and folding the rope + KV-write launch into attention saves one per layer.

An fp8 cache (fp8.py) comes with per-head scales `k_scale`, `v_scale` (`[Hkv]` fp32): the
references dequantize what they gather; the kernels load the stored values and fold the
scales into the score multiplier (K) and the output (V), the same products in another order.
"""

import functools
import math

import torch
import torch.nn.functional as F

from spark.engine.kernels import fp8, key_block, launch, norm, rope
from spark.engine.kernels.decode_plan import (DecodeConfig, choose_num_splits, decode_config, one_row_fits,
                                               reduce_num_warps)

# Bound by `_kernels()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the references may not have triton at all.
triton = None
tl = None
# Steps of other modules, bound by `_kernels()`: the kernel finds a called function among these globals.
_attend_keys = None  # key_block's online softmax over a range of keys
_rope_cos_sin = None  # rope's cos/sin, so that k rotated here equals k rotated by the rope kernels
_load_block = _attend_block = None  # key_block's two halves of a step, for the early first block
_partition = _partitions_used = None  # the keys of one split-KV program; how many programs hold keys
_quantize = None  # fp8's: the decode kernel with rope stores the new token's K/V quantized
_head_norm = None  # Qwen3's per-head RMSNorm of q and k, taken before the rotation
_wait_for_previous = None  # launch's PDL wait, for the decode kernel and the reduce
# With rope (the decode kernel writes the new token's K/V itself) at batch 1: load the
# first key block and the positions before waiting on the previous kernel. A module flag
# for A/B runs.
EARLY_LOADS = True
# Over an fp8 cache (GPU): V converted to fp16 where it is loaded, not in the dot's operand layout
# (key_block.load_block says why). A module flag for A/B runs (attention_bench.py --kv-dtypes).
FP8_V_EARLY = True
# The split-KV reduce lets the kernel after it (batch 1: wo) launch before its own wait on the decode
# kernel returns (PDL's trigger ahead of the wait): wo's programs are then resident while attention
# runs. Qwen3-30B-A3B batch 1 on an H100: 371.2 tok/s against 369.9 with it after the wait
# (decode_ablation last:reduce, results 2026-12-06-h100-argmax-triggers-4ece645.json). A module flag
# for A/B runs.
REDUCE_TRIGGER_FIRST = True

# Query rows per program, padded: tl.dot needs M >= 16 on GPUs, and a GQA group
# holds 1..8 heads. The padded rows are zero queries, masked at the store.
_MIN_GROUP_ROWS = 16


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a flat mixed batch of prefill chunks and decode tokens.

    Sequence b owns query rows `query_start_loc[b]:query_start_loc[b+1]` (q_len of them);
    its new token i sits at position `seq_lens[b] - q_len + i` and attends to keys
    0..that position, so a chunk continuing an earlier prefill and a decode token are
    the same case. Also the CPU engine's attention: per sequence it gathers the pages
    into contiguous K/V and calls SDPA, in q's dtype (fp32 on the CPU).

    Args:
      q: `[T, H, D]` queries of all sequences, in order.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, already holding this step's K/V.
      query_start_loc: `[B+1]` int32 cumulative query lengths.
      seq_lens: `[B]` int32 context length of each sequence, this step's tokens included.
      block_tables: `[B, max_pages]` int32 pages of each sequence, padded with anything.
      scale: softmax scale, usually `D ** -0.5`.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache (dequantized as gathered), or None.
      out: `[T, H, D]` in q's dtype to write into, as the kernels take it: the rows of every
        sequence are written, any other row is left as it is. None: a new tensor, zero elsewhere.

    Returns:
      `out`, or a new `[T, H, D]`: the attention output; rows of sequences with an empty context are zero.
    """
    given = out is not None
    if given:
        assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    else:
        out = torch.zeros_like(q)
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, context_len in enumerate(lens):
        q_lo, q_hi = starts[b], starts[b + 1]
        q_len = q_hi - q_lo
        if q_len == 0 or context_len == 0:
            if given and q_len:  # a caller's `out` may hold anything there
                out[q_lo:q_hi] = 0
            continue
        pages = block_tables[b, : -(-context_len // page_size)].long()
        # [pages, page_size, Hkv, D] -> [1, Hkv, context_len, D]. SDPA gets 4-D inputs
        # throughout: on the CPU 3-D ones miss the fused kernel and run ~10x slower.
        k, v = k_cache[pages].flatten(0, 1)[:context_len], v_cache[pages].flatten(0, 1)[:context_len]
        if k_scale is not None:
            k, v = fp8.dequantize_reference(k, k_scale, q.dtype), fp8.dequantize_reference(v, v_scale, q.dtype)
        k, v = k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype)
        if q_len == 1:
            # A lone query sees every key, so no mask: fold each GQA group's heads into
            # query rows of its kv head, [1, Hkv, group, D], one small matmul per kv head.
            qb = q[q_lo].reshape(1, num_kv_heads, -1, q.shape[-1])
            out[q_lo] = F.scaled_dot_product_attention(qb, k, v, scale=scale).reshape(q.shape[1:])
            continue
        qb = q[q_lo:q_hi].transpose(0, 1)[None]  # [1, H, q_len, D]
        # A prefill from position 0 is plain causal; a chunk continuing earlier context
        # needs the mask aligned bottom-right (is_causal aligns top-left).
        mask, causal = None, q_len == context_len
        if not causal:
            query_pos = torch.arange(context_len - q_len, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        out[q_lo:q_hi] = o[0].transpose(0, 1)
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence attends to its whole context (torch reference).

    Args:
      q: `[B, H, D]` the new token of each sequence, its K/V already in the cache.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`.
      block_tables: `[B, max_pages]` int32.
      seq_lens: `[B]` int32 context lengths, the new token included.
      scale: softmax scale.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache, or None.
      out: `[B, H, D]` in q's dtype to write into, or None.

    Returns:
      `out`, or a new `[B, H, D]`.
    """
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                     k_scale, v_scale, out=out)


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence attends to its whole context (Triton, online softmax).

    One program per (sequence, kv head, split) handles every query head of that kv
    head's GQA group, so each K/V page is read once per group rather than once per
    query head. With `num_splits > 1` (flash-decoding) the context of each sequence is
    cut into that many partitions, each program writes a partial (max, sum, unnormalised
    output), and a small kernel merges them: a few long sequences would otherwise
    leave most SMs idle while one program per (sequence, kv head) walks all the pages.
    The launch shape depends only on tensor shapes (no host sync), so it can be captured
    in a CUDA graph.

    Args:
      q: `[B, H, D]` the new token of each sequence, its K/V already in the cache.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`.
      block_tables: `[B, max_pages]` int32.
      seq_lens: `[B]` int32 context lengths, the new token included (0: output zeros).
      scale: softmax scale.
      num_splits: partitions per sequence; None picks them from the batch shape.
      config: how the kernel walks keys; None picks it by `decode_config`.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache, or None.
      out: `[B, H, D]` in q's dtype, any strides (a slice of a caller's buffer), to write the
        result into; with splits only the final merge writes it. None: a new tensor.

    Returns:
      `out`, or a new `[B, H, D]` in q's dtype.
    """
    return _launch_decode(q, None, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, config,
                          k_scale, v_scale, out)


def paged_decode_attention_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rope.rope_and_write_kv_reference`, then `paged_decode_attention_reference` (torch).

    Args and Returns: as `paged_decode_attention_rope_triton` (no `num_splits`).
    """
    q_rot = rope.rope_and_write_kv_reference(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping,
                                             k_scale, v_scale)
    return paged_decode_attention_reference(q_rot, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                                            out=out)


def paged_decode_attention_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rope, KV write and decode attention in one launch (plus the reduce when split).

    The kernel of `paged_decode_attention_triton`, with every program (sequence, kv
    head, split) rotating its group's q heads itself. The program whose partition
    holds the new token (position `seq_len - 1`) also rotates k and writes k and v
    into the token's slot, bit for bit as `rope.rope_and_write_kv_triton` would, and
    scores that token from registers: nothing orders a store before loads of the same
    launch, so no program reads the new token's slot back; every other key was written
    by an earlier step. Graph-capturable like the plain kernel.

    Args:
      q: `[B, H, D]` the new token of each sequence, unrotated; any strides (a view
        of the fused qkv output); not modified.
      k, v: `[B, Hkv, D]` its unrotated key and its value; any strides; not modified.
      positions: `[B]` int64 position of each new token (its rope angle).
      inv_freq: `[D // 2]` fp32 rope inverse frequencies.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, same strides; the new
        tokens' slots are written, nothing else.
      slot_mapping: `[B]` int64 flat slot of each new token; -1 marks a padding row
        (its seq_len must be 0: nothing is written, its output is zeros).
      block_tables: `[B, max_pages]` int32.
      seq_lens: `[B]` int32 context lengths, the new token included.
      scale: softmax scale.
      num_splits: partitions per sequence; None picks them from the batch shape.
      config: how the kernel walks keys; None picks it by `decode_config`.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache (the new token stored quantized), or None.
      out: as `paged_decode_attention_triton`'s.
      qk_norm: (q weight `[D]`, k weight `[D]`, eps) of Qwen3's per-head RMSNorm, taken on q and k
        before the rotation, as `norm.rms_norm_reference` rounds it (two launches fewer a layer
        than the unfused norms); None: q and k come normed, or take no norm.

    Returns:
      `out`, or a new `[B, H, D]` in q's dtype.
    """
    batch, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and q.shape[0] == batch and q.shape[2] == head_dim and head_dim % 2 == 0
    assert inv_freq.shape == (head_dim // 2,) and positions.shape == slot_mapping.shape == (batch,)
    if qk_norm is not None:
        assert qk_norm[0].shape == qk_norm[1].shape == (head_dim,)
    rope_args = (k, v, positions, inv_freq, slot_mapping)
    return _launch_decode(q, rope_args, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, config,
                          k_scale, v_scale, out, qk_norm)


def _launch_decode(q, rope_args, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, config,
                   k_scale=None, v_scale=None, out=None, qk_norm=None):
    """Launch the decode kernel (with rope + KV write when `rope_args` is given) and the reduce."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and k_cache.shape[3] == head_dim
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    max_context = block_tables.shape[1] * page_size
    cfg = config or decode_config(head_dim, k_cache.dtype == fp8.FP8,
                                  rope_args is not None and one_row_fits(batch, num_kv_heads, head_dim, max_context))
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, cfg.block_n)
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    if batch == 0:
        return out
    decode_kernel, reduce_kernel = _kernels()
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = max(_MIN_GROUP_ROWS, triton.next_power_of_2(group))
    # On the GPU, bf16/fp16 caches feed tl.dot in their own dtype (q is exact in it; p
    # is rounded to it for PV, as in flash-attention), fp8 caches in fp16 (their values are
    # exact in it, and it is one conversion away; a bf16 q is too). fp32 caches and the
    # interpreter, which mishandles dot and arithmetic on bf16, use fp32 tiles with exact products.
    interpreted = launch.interpreting(decode_kernel)
    half_dot = half_dots(k_cache.dtype, q.dtype) and not interpreted
    scaled = k_scale is not None
    split = num_splits > 1
    if split:
        partial_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel; any fp32 tensor fills the arguments
        partial_max = partial_sum = partial_out = _no_partials(q.device)
    # Without rope the kernel never touches the rope arguments: any tensors fill them.
    k, v, positions, inv_freq, slot_mapping = rope_args or (q, q, seq_lens, partial_max, seq_lens)
    q_norm_w, k_norm_w, norm_eps = qk_norm or (q, q, 0.0)  # unread without QK_NORM
    decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k, v, positions, inv_freq, slot_mapping, q_norm_w, k_norm_w, norm_eps,
        k_cache, v_cache, block_tables, seq_lens, out, partial_max, partial_sum, partial_out,
        k_scale if scaled else seq_lens, v_scale if scaled else seq_lens,  # unread unless SCALED
        *q.stride(), *k.stride(), *v.stride(), inv_freq.stride(0) if rope_args else 0,
        *k_cache.stride(), block_tables.stride(0), *out.stride(),
        scale * math.log2(math.e), group, head_dim, num_splits,
        PAGE_SIZE=page_size, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        SPLIT=split, HALF_DOT=half_dot, PRECISION="tf32" if half_dot else "ieee", ROPE=rope_args is not None,
        SCALED=scaled, FP8_V_EARLY=FP8_V_EARLY, QK_NORM=qk_norm is not None,
        # Batch 1 only: there the projection before this kernel is the small-row linear,
        # whose PDL trigger lets this one start early. Behind cuBLAS (larger batches) the
        # loads are not early, and taking the first block out of the pipelined key loop
        # cost 2.7% at 8B batch 64.
        EARLY_LOADS=rope_args is not None and batch == 1 and EARLY_LOADS,
        EXIT_EMPTY=cfg.exit_empty and split,
        NUM_STAGES=0 if interpreted else cfg.num_stages, num_warps=cfg.num_warps, **launch.pdl(decode_kernel, q),
    )
    if split:
        block_s = triton.next_power_of_2(num_splits)
        reduce_kernel[(batch, num_heads)](
            partial_max, partial_sum, partial_out, out, seq_lens, *out.stride(), head_dim, num_splits,
            BLOCK_S=block_s, BLOCK_D=block_d, BLOCK_N=cfg.block_n, num_warps=reduce_num_warps(block_s, block_d),
            TRIGGER_FIRST=REDUCE_TRIGGER_FIRST,
            **launch.pdl(reduce_kernel, q),
        )
    return out


@functools.cache
def _no_partials(device: torch.device) -> torch.Tensor:
    """An empty fp32 tensor for an unsplit launch's partial arguments: made once, not at every launch."""
    return torch.empty(0, dtype=torch.float32, device=device)


def half_dots(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether a GPU kernel's dots take half-precision tiles: a bf16/fp16 cache, or an fp8 one
    (as fp16) under half-precision queries."""
    return cache_dtype in (torch.bfloat16, torch.float16) or (
        cache_dtype == fp8.FP8 and q_dtype in (torch.bfloat16, torch.float16))


@functools.cache
def _kernels():
    """Import triton and JIT the kernels: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl
    import triton
    import triton.language as tl

    global _attend_keys, _load_block, _attend_block, _rope_cos_sin, _partition, _partitions_used, _quantize, _head_norm
    global _wait_for_previous
    _quantize = fp8.jit_quantize()
    _wait_for_previous = launch.jit_wait_for_previous()
    _head_norm = norm.jit_head_norm()
    _attend_keys = key_block.attend_keys()
    _load_block, _attend_block = key_block.steps()
    _rope_cos_sin = rope.jit_cos_sin()

    @triton.jit
    def partition(seq_lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr):
        """`(seq_len, start, end)`: the sequence's length and this program's keys [start,
        end), partitions rounded up to whole BLOCK_N steps; the last ones may be empty
        when the sequence is short."""
        seq_len = tl.load(seq_lens_ptr + seq)
        part_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * part_len
        return seq_len, start, tl.minimum(start + part_len, seq_len)

    @triton.jit
    def partitions_used(seq_lens_ptr, seq, num_splits, BLOCK_N: tl.constexpr):
        """How many of the sequence's partitions hold keys (`partition`'s): 1 at least, the first
        one, which alone writes a sequence with an empty context. The programs of the others
        return at once, as a short context under a wide block table leaves most of them (a
        server's 40960-key table splits in 32 at batch 1; 256 keys fill 2 or 4)."""
        seq_len = tl.load(seq_lens_ptr + seq)
        part_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        return tl.maximum(tl.cdiv(seq_len, tl.maximum(part_len, 1)), 1)

    _partition, _partitions_used = partition, partitions_used

    # What changes from step to step is not specialized on: the ints (the block table's width, the
    # split count: Triton's ==1 and %16 cases) and the alignment of the int32 metadata (a mixed step
    # slices its decode rows' and its chunks' out of one array, at any row). Each case was a compile
    # of 0.6-1.5 s in the middle of serving (SPARK_SLOW_TURN_MS on an H100), in a shape no warm-up
    # can list; the kernel reads them as scalars, which the hints do not speed up.
    @triton.jit(do_not_specialize=["stride_bt", "num_splits"], do_not_specialize_on_alignment=[
        "positions_ptr", "slot_ptr", "block_tables_ptr", "seq_lens_ptr", "k_scale_ptr", "v_scale_ptr"])
    def decode_kernel(
        q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, slot_ptr, q_norm_ptr, k_norm_ptr, norm_eps,
        k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
        partial_max_ptr, partial_sum_ptr, partial_out_ptr, k_scale_ptr, v_scale_ptr,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd, stride_f,
        stride_cp, stride_co, stride_ch, stride_cd,
        stride_bt, stride_ob, stride_oh, stride_od,
        qk_scale_log2, group, head_dim, num_splits,
        PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, HALF_DOT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
        SCALED: tl.constexpr, FP8_V_EARLY: tl.constexpr, EARLY_LOADS: tl.constexpr, NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr, QK_NORM: tl.constexpr, EXIT_EMPTY: tl.constexpr,
    ):
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = tl.arange(0, BLOCK_G)  # query heads of the group, padded
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < group
        dim_ok = dims < head_dim
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        half = head_dim // 2
        lane = dims % half  # rope's frequency lane of each dim
        if EARLY_LOADS:
            # The block table, the lengths, the positions and the cached keys are no earlier
            # kernel's output in this step (the new token's K/V is written below, and not
            # read from the cache): they load before the wait, while the projection before
            # this kernel drains, and their round trips leave the critical path. On an
            # H200, 8B batch 1: 239.9 tok/s against 235.6 without the early key block.
            seq_len, start, end = _partition(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
            if EXIT_EMPTY:  # a constexpr if of its own: off, the code is the branch-free kernel's
                if split > 0 and start >= seq_len:
                    return  # no key: nothing to write, and reduce_kernel reads nothing of it
            k_first, v_first = _load_block(
                start, tl.minimum(end, seq_len - 1), table, k_cache_ptr, v_cache_ptr, kv_head,
                stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok, PAGE_SIZE, BLOCK_N, HALF_DOT, FP8_V_EARLY)
            # The positions too: the rotation's cos/sin, libdevice's range-reduced calls, also.
            cos, sin = _rope_cos_sin(positions_ptr, inv_freq_ptr, seq, lane, dim_ok, stride_f)
        if PDL:  # everything below reads what earlier kernels wrote
            _wait_for_previous(False)
        if not EARLY_LOADS:
            seq_len, start, end = _partition(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
            if EXIT_EMPTY:
                if split > 0 and start >= seq_len:
                    return
        heads = kv_head * group + rows
        q_mask = row_ok[:, None] & dim_ok[None, :]
        if SCALED:  # an fp8 cache: K's scale folds into the scores' multiplier, V's into the output
            k_scale = tl.load(k_scale_ptr + kv_head)
            v_scale = tl.load(v_scale_ptr + kv_head)
            qk_scale_log2 = qk_scale_log2 * k_scale
        q_src = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
        if ROPE:
            # Rope in the full [.., D] layout the dots need: lane d takes x1 = x[d % half]
            # and x2 = x[half + d % half] and keeps `x1*cos - x2*sin` (first half) or
            # `x2*cos + x1*sin` (second half): the rope kernel's expressions term for term, so
            # they compile to the same FMAs (checked in the sm_90 PTX) and k matches its bits.
            # cos/sin from rope.py's own helper, over the lanes; fp32 loads for the interpreter's sake.
            first = (dims < half)[None, :]
            if not EARLY_LOADS:
                cos, sin = _rope_cos_sin(positions_ptr, inv_freq_ptr, seq, lane, dim_ok, stride_f)
            x1 = tl.load(q_src + lane[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
            x2 = tl.load(q_src + (half + lane[None, :]) * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
            if QK_NORM:
                x1, x2 = _head_norm(x1, x2, q_norm_ptr, lane, half, dim_ok, head_dim, norm_eps, q_ptr.dtype.element_ty)
            q = tl.where(first, x1 * cos - x2 * sin, x2 * cos + x1 * sin)
            # Rounded to q's dtype, as the unfused path hands attention a rotated q.
            q = q.to(q_ptr.dtype.element_ty).to(tl.float32)
            # The new token's key, the same rotation on its kv head's [D] vector.
            k_src = k_ptr + seq * stride_kb + kv_head * stride_kh
            x1 = tl.load(k_src + lane * stride_kd, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
            x2 = tl.load(k_src + (half + lane) * stride_kd, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
            if QK_NORM:
                x1, x2 = _head_norm(x1, x2, k_norm_ptr, lane, half, dim_ok, head_dim, norm_eps, k_ptr.dtype.element_ty)
            k_new = tl.where(first, x1 * cos - x2 * sin, x2 * cos + x1 * sin)
            # Rounded to k's dtype, then the cache's (as the unfused path stores it); v copied.
            k_new = k_new.to(k_ptr.dtype.element_ty)  # [1, BLOCK_D]
            v_new = tl.load(v_ptr + seq * stride_vb + kv_head * stride_vh + dims[None, :] * stride_vd,
                            mask=dim_ok[None, :], other=0.0)
            if SCALED:  # stored quantized, and scored as stored: as every later step will read it
                k_new = _quantize(k_new.to(tl.float32), k_scale)
                v_new = _quantize(v_new.to(tl.float32), v_scale)
            k_new = k_new.to(k_cache_ptr.dtype.element_ty)
            v_new = v_new.to(v_cache_ptr.dtype.element_ty)
            # The new token (key seq_len - 1) is this program's when its partition holds it;
            # only that program writes it, and it reads no key at or after it from the cache.
            owner = (start < seq_len) & (seq_len - 1 < end)
            slot = tl.load(slot_ptr + seq).to(tl.int64)  # int64: page * stride_cp may pass 2**31
            dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_co + kv_head * stride_ch
            dst = dst + dims[None, :] * stride_cd
            write = dim_ok[None, :] & owner & (slot >= 0)
            tl.store(k_cache_ptr + dst, k_new, mask=write)
            tl.store(v_cache_ptr + dst, v_new, mask=write)
            end = tl.minimum(end, seq_len - 1)
        else:
            q = tl.load(q_src + dims[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
        # Running max of the scores, finite: exp2(m_old - m_new) stays 1, not NaN, while a
        # program has seen only masked keys (or none, in an empty partition).
        m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        q_dot = q
        if HALF_DOT:
            if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
                # fp16, the dtype key_block hands fp8 keys in: exact for a bf16 q inside fp16's range,
                # clamped to it (a q past 65504 would score inf, then NaN)
                q_dot = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
            else:
                q_dot = q.to(k_cache_ptr.dtype.element_ty)
        last_key = tl.full([BLOCK_G], 0, tl.int32) + end - 1  # every row sees the whole partition
        loop_start = start
        if EARLY_LOADS:
            m_i, l_i, acc = _attend_block(q_dot, m_i, l_i, acc, k_first, v_first, start, end, last_key,
                                          qk_scale_log2, BLOCK_N, PRECISION)
            loop_start = start + BLOCK_N
        m_i, l_i, acc = _attend_keys(
            q_dot, m_i, l_i, acc, loop_start, end, last_key, table, k_cache_ptr, v_cache_ptr, kv_head,
            stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok, qk_scale_log2,
            PAGE_SIZE, BLOCK_N, HALF_DOT, FP8_V_EARLY, PRECISION, NUM_STAGES)

        if ROPE:
            # One more online-softmax step for the new token, from registers; a no-op
            # (score -inf: alpha 1, p 0) in every program but its owner.
            s = tl.sum(q * k_new.to(tl.float32), axis=1) * qk_scale_log2  # [BLOCK_G]
            s = tl.where(owner, s, float("-inf"))
            m_new = tl.maximum(m_i, s)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
            m_i = m_new

        out_mask = row_ok[:, None] & dim_ok[None, :]
        if SCALED:
            acc = acc * v_scale
        if SPLIT:
            # Partial results in fp32, [B, H, S(, D)], merged by reduce_kernel. Merged here instead, by
            # the last of a sequence's programs to finish (an atomic count), the step was slower:
            # Qwen3-30B-A3B batch 1 on an H100, 333.3 tok/s against 340.8 with the reduce launch (91aa44c).
            part = (seq * tl.num_programs(1) * group + heads) * num_splits + split
            tl.store(partial_max_ptr + part, m_i, mask=row_ok)
            tl.store(partial_sum_ptr + part, l_i, mask=row_ok)
            tl.store(partial_out_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=out_mask)
        else:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty context: zeros, not NaN
            o_off = seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od
            tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["seq_lens_ptr"])  # as decode_kernel's
    def reduce_kernel(
        partial_max_ptr, partial_sum_ptr, partial_out_ptr, out_ptr, seq_lens_ptr,
        stride_ob, stride_oh, stride_od, head_dim, num_splits,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
        TRIGGER_FIRST: tl.constexpr,
    ):
        seq, head = tl.program_id(0), tl.program_id(1)
        used = _partitions_used(seq_lens_ptr, seq, num_splits, BLOCK_N)  # no earlier kernel's output
        if PDL:
            _wait_for_previous(TRIGGER_FIRST)
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        split_ok = splits < used
        part = (seq * tl.num_programs(1) + head) * num_splits + splits
        m = tl.load(partial_max_ptr + part, mask=split_ok, other=float("-inf"))
        l = tl.load(partial_sum_ptr + part, mask=split_ok, other=0.0)
        acc = tl.load(
            partial_out_ptr + part[:, None] * head_dim + dims[None, :],
            mask=split_ok[:, None] & (dims < head_dim)[None, :], other=0.0,
        )
        # Rescale every partition to the global max; empty partitions (max -1e30, sum 0) weigh 0.
        weight = tl.exp2(m - tl.max(m, axis=0))
        total = tl.sum(l * weight, axis=0)
        o = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=dims < head_dim)

    return decode_kernel, reduce_kernel
