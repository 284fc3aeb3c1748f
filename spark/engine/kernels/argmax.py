"""A few rows' argmax over the vocabulary (greedy decoding's token), reference and Triton.

``torch.argmax`` gives a row one block: a batch-1 step's 152k scores took 28 us of an H200
that way. The sampler's torch path before this one (a max over equal slices, an argmax of the
slices' maxima, a gather; decode_ablation.py's ``chunked_argmax`` keeps it) was four launches,
which inside a graphed Qwen3-30B-A3B step on an H100 took 27 us from the head's end to the token
(benchmarks/profile_decode.py ``--graphs``, the kernel chain). Here: two launches. Each program of the first takes the first
maximum of ``BLOCK`` scores; the second, one program a row, takes the first maximum of those.

The maximum is taken on integer keys of the scores (a float's bits made to order as ints), so
that NaN ranks above everything, as in ``torch.argmax``, and the first index wins a tie: the
same index as ``torch.argmax``, which takes -0.0 and +0.0 as equal (the keys do too: -0.0 is
made +0.0 first).

Both launches take PDL on Hopper: the first's programs are resident while the head still streams,
and the second's while the first runs. The second can write each row's token where a table of
flat indices says (``argmax_triton``'s ``out`` and ``out_index``): a graphed decode step's tokens
go straight into its ring row, where an ``index_copy_`` launch after took 2.5 us of a
Qwen3-30B-A3B batch-1 step on an H100 (profile_decode.py ``--graphs``). In that chain the two
launches took 2.2 and 1.2 us end to end, 2.1 and 1.7 before, without PDL.
"""

from __future__ import annotations

import functools

import torch

from spark.engine.kernels import launch

triton = None  # bound by _kernels() on first use: TRITON_INTERPRET is read when @triton.jit runs
tl = None
_key = None  # the scores' integer keys, bound by _kernels() for the kernels below
_wait_for_previous = None  # launch's PDL wait, bound by _kernels() likewise

# Scores a first-pass program scans: Qwen3's 151936 make 75 programs, Llama 3's 128256 make 63.
BLOCK = 2048
MAX_ROWS = 16  # rows up to which the two passes beat torch's one block a row (a decode batch's)


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of ``[B, V]`` scores: the first index of each row's maximum, NaN the largest."""
    return x.argmax(dim=-1)


def argmax_triton(x: torch.Tensor, out: torch.Tensor | None = None,
                  out_index: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax_reference`` in two launches: int64 ``[B]``. Any float dtype, rows any stride.

    ``out`` (contiguous int64) and ``out_index`` (int64 ``[B]``, on the device): row r's index is
    written to ``out.view(-1)[out_index[r]]`` instead, and ``out`` returned (``out_index`` is read by
    the kernel: it may be what an earlier launch wrote).
    """
    rows, width = x.shape
    assert x.stride(1) == 1 and width < 2**31
    scatter = out is not None
    if scatter:
        assert out.dtype == torch.int64 and out.is_contiguous() and out_index is not None
        assert out_index.dtype == torch.int64 and out_index.shape == (rows,)
    else:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    partial_kernel, final_kernel = _kernels()
    parts = triton.cdiv(width, BLOCK)
    keys = torch.empty(rows, parts, dtype=torch.int32, device=x.device)
    index = torch.empty(rows, parts, dtype=torch.int32, device=x.device)
    partial_kernel[(rows, parts)](x, keys, index, x.stride(0), width, parts, BLOCK=BLOCK, num_warps=4,
                                  **launch.pdl(partial_kernel, x))
    final_kernel[(rows,)](keys, index, out, out_index if scatter else out, parts,
                          BLOCK_P=triton.next_power_of_2(parts), SCATTER=scatter, num_warps=1,
                          **launch.pdl(final_kernel, x))
    return out


@functools.cache
def _kernels():
    """(first-pass kernel, final kernel), JIT-ed at first use."""
    global triton, tl, _key, _wait_for_previous
    import triton
    import triton.language as tl

    _wait_for_previous = launch.jit_wait_for_previous()

    @triton.jit
    def key(scores):
        """int32 keys ordered as the fp32 ``scores`` are, NaN above +inf, -0.0 equal to +0.0."""
        bits = (scores + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0
        bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a negative float's magnitude bits flipped: ints' order
        return tl.where(scores != scores, 0x7FFFFFFF, bits)

    _key = key

    @triton.jit
    def argmax_partial_kernel(x_ptr, keys_ptr, index_ptr, stride_x, width, parts, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        # The largest key of BLOCK scores of a row and the first index holding it.
        row, part = tl.program_id(0), tl.program_id(1)
        if PDL:  # the scores are the head's
            _wait_for_previous(False)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        scores = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < width, other=float("-inf"))
        keys = _key(scores.to(tl.float32))
        best = tl.max(keys, axis=0)
        first = tl.min(tl.where(keys == best, cols, width), axis=0)  # padding's -inf never beats a real score
        tl.store(keys_ptr + row * parts + part, best)
        tl.store(index_ptr + row * parts + part, first)

    @triton.jit
    def argmax_final_kernel(keys_ptr, index_ptr, out_ptr, out_index_ptr, parts, BLOCK_P: tl.constexpr,
                            SCATTER: tl.constexpr, PDL: tl.constexpr):
        # The largest of a row's partial keys; among equal ones the lowest index (the blocks are in order).
        # SCATTER: the row's token goes to out[out_index[row]].
        row = tl.program_id(0)
        if PDL:  # the partial keys are the first launch's
            _wait_for_previous(False)
        p = tl.arange(0, BLOCK_P)
        keys = tl.load(keys_ptr + row * parts + p, mask=p < parts, other=-2147483648)
        index = tl.load(index_ptr + row * parts + p, mask=p < parts, other=2147483647)
        best = tl.max(keys, axis=0)
        token = tl.min(tl.where(keys == best, index, 2147483647), axis=0).to(tl.int64)
        if SCATTER:
            tl.store(out_ptr + tl.load(out_index_ptr + row), token)
        else:
            tl.store(out_ptr + row, token)

    return argmax_partial_kernel, argmax_final_kernel
