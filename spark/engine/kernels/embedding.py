"""The embedding lookup, the first kernel of a step after its inputs are unpacked: reference and Triton.

torch's lookup is a plain launch in the middle of a graphed decode step's PDL chain: the first
block's wqkv can only launch once it is done, and it took 4.0 us from the inputs' unpacking to its
end in a Qwen3-30B-A3B batch-1 step on an H100 (profile_decode.py ``--graphs``). The Triton lookup
takes PDL with its trigger ahead of its wait (``launch.jit_wait_for_previous``): wqkv's programs
are launched, resident, while it still waits on the ids. In the same chain it took 3.3 us; with the
argmax's launches under PDL (argmax.py) the step gained 0.2% (371.7 tok/s against 371.0, one H100
call; results 2026-12-06-h100-ring-argmax-embedding.json).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from spark.engine.kernels import launch

triton = None  # bound by _kernel() on first use: TRITON_INTERPRET is read when @triton.jit runs
tl = None
_wait_for_previous = None  # launch's PDL wait, bound by _kernel() for the kernel below

BLOCK_D = 1024  # columns a program copies: a 2048-wide row is two programs, 4096 four


def embedding_reference(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``: ids [T] (int64, each in 0..V-1), weight [V, D] -> [T, D]."""
    return F.embedding(ids, weight)


def embedding_triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``embedding_reference`` in one launch. The ids are not checked: out-of-range ids read out of bounds."""
    assert ids.dim() == 1 and weight.stride(1) == 1
    num_tokens, (_, dim) = ids.shape[0], weight.shape
    out = torch.empty(num_tokens, dim, dtype=weight.dtype, device=weight.device)
    if num_tokens == 0:
        return out
    kernel = _kernel()
    block = min(BLOCK_D, triton.next_power_of_2(dim))
    kernel[(num_tokens, triton.cdiv(dim, block))](ids, weight, out, weight.stride(0), dim, BLOCK=block,
                                                  num_warps=4, **launch.pdl(kernel, weight))
    return out


@functools.cache
def _kernel():
    global triton, tl, _wait_for_previous
    import triton
    import triton.language as tl

    _wait_for_previous = launch.jit_wait_for_previous()

    @triton.jit
    def embedding_kernel(ids_ptr, weight_ptr, out_ptr, stride_v, dim, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # BLOCK columns of one token's row.
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if PDL:  # the ids are the kernel before's; the kernel after may launch while this one waits
            _wait_for_previous(True)
        row = tl.load(ids_ptr + token)
        keep = cols < dim
        values = tl.load(weight_ptr + row * stride_v + cols, mask=keep)
        tl.store(out_ptr + token.to(tl.int64) * dim + cols, values, mask=keep)

    return embedding_kernel
