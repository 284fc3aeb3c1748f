"""Flash-attention over the paged KV cache for a flat mixed batch: reference and Triton.

Same semantics as `paged_attention_reference`: sequence b owns query rows
`query_start_loc[b]:query_start_loc[b+1]` (q_len of them), its new token i sits at
position `seq_lens[b] - q_len + i` and attends causally to keys 0..that position,
all read from the paged cache (this step's K/V already written). Prefill from 0,
a chunk continuing earlier context and a single decode token are one case.

Cache layout: `k_cache`, `v_cache` each `[num_pages, page_size, Hkv, D]`; position p
of sequence b lives at page `block_tables[b, p // page_size]`, offset `p % page_size`.
An fp8 cache comes with per-head scales `k_scale`, `v_scale` (`[Hkv]` fp32), folded into
the kernel's score multiplier and output as in the decode kernel.
"""

import functools
import math

import torch

from spark.engine.kernels import key_block, launch
from spark.engine.kernels.paged_attention import half_dots, paged_attention_reference

# Bound by `_kernel()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the reference may not have triton at all.
triton = None
tl = None
_attend_keys = None  # key_block's, bound by `_kernel()`: the kernel finds it among these globals

# Query rows per program and keys per inner step: the usual flash-attention tile for
# head_dim <= 128 on Hopper (tl.dot needs every dim >= 16). Pages are gathered token by
# token, so BLOCK_N need not match the page size.
_BLOCK_M = 64
_BLOCK_N = 64


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a flat mixed batch (torch reference: `paged_attention_reference`).

    `max_query_len` is accepted for signature parity with the Triton version and unused.
    """
    return paged_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                     k_scale, v_scale, out=out)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int = _BLOCK_M,
    block_n: int = _BLOCK_N,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention for a flat mixed batch of prefill chunks and decode tokens (Triton).

    Grid `(B, cdiv(max_query_len, block_m), H)`: one program per block of `block_m`
    query rows of one sequence and one query head, online softmax over key blocks
    gathered page by page. The caller's `max_query_len` sizes the grid without reading
    `query_start_loc` back from the GPU; programs whose block starts past their
    sequence's q_len exit at once. Key blocks wholly above the causal diagonal of the
    query block are never visited.

    Args:
      q: `[T, H, D]` queries of all sequences, in order; may be a strided view.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, already holding this step's K/V.
      query_start_loc: `[B+1]` int32 cumulative query lengths.
      seq_lens: `[B]` int32 context length of each sequence, this step's tokens included.
      block_tables: `[B, max_pages]` int32 pages of each sequence, padded with anything.
      scale: softmax scale, usually `D ** -0.5`.
      max_query_len: at least the largest q_len in the batch (a host-side int).
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache, or None.
      out: `[T, H, D]` in q's dtype, any strides (a slice of a caller's buffer), to write the
        result into: the rows of every sequence are written, any other row is left as it is.
        None: a new tensor, zero outside every sequence.
      block_m, block_n: tile sizes, each a power of two >= 16 (tests shrink them).
      num_stages: software-pipelining depth of the key loop on a GPU (0: a plain loop);
        2 was fastest in `benchmarks/attention_bench.py` on an H200 for 512-token chunks.

    Returns:
      `out`, or a new `[T, H, D]` tensor in q's dtype, contiguous; rows outside every sequence are zero.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and k_cache.shape[3] == head_dim
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    batch = seq_lens.shape[0]
    if out is None:
        # Zeros, not empty: matches the reference for rows no sequence owns (padding).
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    kernel = _kernel()
    # On the GPU, bf16/fp16 caches feed tl.dot in their own dtype (full tensor-core rate;
    # p is rounded to that dtype for PV, as in flash-attention). fp32 caches and the
    # interpreter, which mishandles dot and arithmetic on bf16, use fp32 tiles with exact
    # "ieee" products ("tf32" is the default for half operands, where it changes nothing).
    interpreted = launch.interpreting(kernel)
    half_dot = half_dots(k_cache.dtype, q.dtype) and not interpreted
    scaled = k_scale is not None
    kernel[(batch, triton.cdiv(max_query_len, block_m), num_heads)](
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out,
        k_scale if scaled else seq_lens, v_scale if scaled else seq_lens,  # unread unless SCALED
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        scale * math.log2(math.e), group, head_dim,
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HALF_DOT=half_dot, PRECISION="tf32" if half_dot else "ieee", SCALED=scaled,
        # Pipelined on a GPU: the next key blocks' page ids and K/V load while this one computes.
        NUM_STAGES=0 if interpreted else num_stages,
        num_warps=8 if head_dim > 128 else 4,
    )
    return out


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl
    import triton
    import triton.language as tl

    global _attend_keys
    _attend_keys = key_block.attend_keys()

    # The block table's width and the metadata's alignment change from step to step (a mixed step's
    # chunks are sliced after its decode rows): not specialized on (see paged_attention's decode_kernel).
    @triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=[
        "query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "k_scale_ptr", "v_scale_ptr"])
    def prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, out_ptr,
        k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_qd,
        stride_cp, stride_co, stride_ch, stride_cd,
        stride_bt, stride_ot, stride_oh, stride_od,
        qk_scale_log2, group, head_dim,
        PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HALF_DOT: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        seq, q_block, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first_row = q_block * BLOCK_M
        # The grid is sized by the longest sequence; shorter ones (decode rows, idle
        # slots) own fewer blocks, and the rest of their programs have nothing to do.
        if first_row >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_start = seq_len - q_len  # position of the sequence's first new token
        kv_head = head // group

        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        query_pos = context_start + rows
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd,
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        )
        if HALF_DOT:
            if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
                # fp16, the dtype key_block hands fp8 keys in (exact for a bf16 q in its range)
                q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
            else:
                q = q.to(k_cache_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)

        # Running max of the scores, finite: exp2(m_old - m_new) stays 1, not NaN, before
        # a row has seen an unmasked key (rows past q_len never do; they are not stored).
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # Keys past the block's last valid position are masked for every row: stop there.
        kv_end = context_start + tl.minimum(first_row + BLOCK_M, q_len)
        if SCALED:  # an fp8 cache: K's scale folds into the scores' multiplier (V's below)
            qk_scale_log2 = qk_scale_log2 * tl.load(k_scale_ptr + kv_head)
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, 0, kv_end, query_pos, table, k_cache_ptr, v_cache_ptr, kv_head,
            stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok, qk_scale_log2,
            PAGE_SIZE, BLOCK_N, HALF_DOT, False, PRECISION, NUM_STAGES)  # V late: wgmma reads it from shared memory

        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty context (seq_len 0): zeros
        if SCALED:
            acc = acc * tl.load(v_scale_ptr + kv_head)
        o_off = tokens[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    return prefill_kernel
