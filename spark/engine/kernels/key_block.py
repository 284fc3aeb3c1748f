"""Online softmax over a range of keys gathered from the paged KV cache (Triton).

The decode kernel (`paged_attention.py`) and the prefill kernel (`prefill_attention.py`)
walk a sequence's keys the same way and differ only in their query rows and in how far
each row may see: both call `attend_keys`, which each kernel module binds among its
globals when it jits its kernel (Triton resolves a called function there).
"""

import functools

# Bound by `attend_keys()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs.
triton = None
tl = None
_attend_step = None  # bound by `attend_keys()`, for `attend_keys` to call
_load_block = _attend_block = None  # the two halves of a step, bound by `attend_keys()`


@functools.cache
def attend_keys():
    """JIT and return ``attend_keys(q, m_i, l_i, acc, start, end, last_key, table, k_cache_ptr,
    v_cache_ptr, kv_head, strides..., dims, dim_ok, qk_scale_log2, PAGE_SIZE, BLOCK_N,
    HALF_DOT, FP8_V_EARLY, PRECISION, NUM_STAGES) -> (m_i, l_i, acc)``."""
    global triton, tl, _attend_step, _load_block, _attend_block
    import triton
    import triton.language as tl

    @triton.jit
    def load_block(
        n0, kv_end, table, k_cache_ptr, v_cache_ptr, kv_head,
        stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HALF_DOT: tl.constexpr, FP8_V_EARLY: tl.constexpr,
    ):
        """K and V `[BLOCK_N, BLOCK_D]` of keys [n0, n0 + BLOCK_N) below `kv_end`, gathered
        through the block-table row `table`; keys past `kv_end` load as zeros. An fp8 cache's
        values come as stored (unscaled): the caller folds its scales into the scores and output.

        FP8_V_EARLY (GPU, fp8 cache): convert V to fp16 in the layout it is loaded in. Triton would
        otherwise move an elementwise cast into the dot's operand layout, to keep the shared-memory
        copy narrow; but an mma.sync (the decode kernel's 16-row dots) reads V transposed, which
        ldmatrix cannot do for 8-bit values, so V came in byte by byte (64 LDS.U8 a step per thread,
        sm_90 SASS: benchmarks/decode_sass.py). Early, V takes 16-byte loads, is stored back as fp16
        and read by ldmatrix.trans: a 64-key step fell from 803 to 452 instructions (bf16's: 478) and
        184 to 142 registers. The prefill kernel's wgmma reads V from shared memory either way, and is
        better off late (654 instructions against 776)."""
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        # Gather token by token: any page size, any page order. Masked keys read
        # neither the block table past the sequence's pages nor the cache.
        page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = page * stride_cp + (keys % PAGE_SIZE) * stride_co + kv_head * stride_ch
        kv_off = kv_off[:, None] + dims[None, :] * stride_cd
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if not HALF_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif k.dtype == tl.float8e4nv:
            # An fp8 cache's values are exact in fp16, the kernels' dot dtype for them: e4m3 -> fp16 is
            # one packed cvt per two values, e4m3 -> bf16 three (through fp16), and on an H100 those
            # conversions, not the bytes, bounded the decode kernel (0.93x the bf16 cache's rate).
            k = k.to(tl.float16)
            if FP8_V_EARLY:
                # Triton's own e4m3 -> fp16 conversion, as asm that is not pure (what pins it here), four
                # values a call: one 32-bit register in, two out (packed two a call, each input half
                # took a PRMT to extract: 64 a step)
                v = tl.inline_asm_elementwise(
                    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                    "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)
            else:
                v = v.to(tl.float16)
        return k, v

    @triton.jit
    def attend_block(
        q, m_i, l_i, acc, k, v, n0, kv_end, last_key, qk_scale_log2,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One online-softmax step over the loaded keys [n0, n0 + BLOCK_N) below `kv_end`;
        query row r sees keys <= `last_key[r]`. Returns the new (m_i, l_i, acc)."""
        keys = n0 + tl.arange(0, BLOCK_N)
        # Scale after the dot so that half operands are not rounded a second time; scores
        # come out in log2 units, so exp2 below is exp of the scaled score.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        s = tl.where((keys[None, :] <= last_key[:, None]) & (keys < kv_end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def attend_step(
        q, m_i, l_i, acc, n0, kv_end, last_key, table, k_cache_ptr, v_cache_ptr, kv_head,
        stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok, qk_scale_log2,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HALF_DOT: tl.constexpr, FP8_V_EARLY: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """`load_block` then `attend_block`."""
        k, v = _load_block(n0, kv_end, table, k_cache_ptr, v_cache_ptr, kv_head, stride_cp, stride_co, stride_ch,
                           stride_cd, dims, dim_ok, PAGE_SIZE, BLOCK_N, HALF_DOT, FP8_V_EARLY)
        return _attend_block(q, m_i, l_i, acc, k, v, n0, kv_end, last_key, qk_scale_log2, BLOCK_N, PRECISION)

    @triton.jit
    def attend_keys(
        q, m_i, l_i, acc, start, end, last_key, table, k_cache_ptr, v_cache_ptr, kv_head,
        stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok, qk_scale_log2,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HALF_DOT: tl.constexpr, FP8_V_EARLY: tl.constexpr,
        PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        """Online softmax over keys [start, end), BLOCK_N at a time; row r sees keys <= `last_key[r]`.

        With NUM_STAGES > 0 (a GPU) the loop is software-pipelined: the page ids and K/V of
        the next blocks load while this one computes. 0 keeps a while loop, not
        `for n0 in range(start, end, BLOCK_N)`: the Triton 3.6 interpreter turns runtime loop
        bounds into Python ints with int(1-element array), which numpy >= 2.4 rejects, and
        the tests run the kernels there."""
        if NUM_STAGES > 0:
            for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
                m_i, l_i, acc = _attend_step(
                    q, m_i, l_i, acc, n0, end, last_key, table, k_cache_ptr, v_cache_ptr, kv_head,
                    stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok, qk_scale_log2,
                    PAGE_SIZE, BLOCK_N, HALF_DOT, FP8_V_EARLY, PRECISION)
        else:
            n0 = start
            while n0 < end:
                m_i, l_i, acc = _attend_step(
                    q, m_i, l_i, acc, n0, end, last_key, table, k_cache_ptr, v_cache_ptr, kv_head,
                    stride_cp, stride_co, stride_ch, stride_cd, dims, dim_ok, qk_scale_log2,
                    PAGE_SIZE, BLOCK_N, HALF_DOT, FP8_V_EARLY, PRECISION)
                n0 += BLOCK_N
        return m_i, l_i, acc

    _load_block, _attend_block, _attend_step = load_block, attend_block, attend_step
    return attend_keys


def steps():
    """`attend_keys()` and its two halves, `(load_block, attend_block)`, for a kernel that
    loads its first keys early (before waiting on the previous kernel)."""
    attend_keys()
    return _load_block, _attend_block
