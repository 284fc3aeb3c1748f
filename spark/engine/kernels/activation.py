"""SwiGLU's gate: `silu(gate) * up` on the fused gate/up projection, reference and Triton.

Both compute in fp32 and round once to the input dtype. Eager bf16 torch
(`silu(gate) * up` on bf16 tensors) rounds twice, after the silu and after the
product, so it can differ from these by one bf16 ulp on a few elements.
"""

import functools

import torch
import torch.nn.functional as F

# Bound by `_kernel()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the reference may not have triton at all.
triton = None
tl = None
_silu_mul = None  # bound by `jit_silu_mul()`: Triton finds a called function among the caller's globals

# Columns per program: enough work per program for wide rows, few programs idle on narrow ones.
_BLOCK_I = 1024


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `gate, up = x.chunk(2, -1)` (torch reference).

    Args:
      x: `[T, 2 * I]`, gate columns first, as the fused w13 projection produces them.

    Returns:
      `[T, I]` in x's dtype, computed in fp32.
    """
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `gate, up = x.chunk(2, -1)` (Triton).

    Args:
      x: `[T, 2 * I]`, rows may be strided.

    Returns:
      `[T, I]` contiguous, in x's dtype, computed in fp32.
    """
    num_tokens, width = x.shape
    assert width % 2 == 0
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    kernel = _kernel()
    block = min(_BLOCK_I, triton.next_power_of_2(inter))
    # Grid (rows, column blocks): I reaches ~30k in large models, too wide for one
    # program to hold, and every element is independent, so blocks need not meet.
    kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), x.stride(1), inter, BLOCK=block,
    )
    return out


@functools.cache
def jit_silu_mul():
    """JIT and return `silu_mul(gate, up)` on fp32 tensors, which this module's kernel and
    the small-row linear's gate prologue and epilogue (small_linear.py) share: the gate is
    the same bits wherever it is computed."""
    global triton, tl, _silu_mul
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul(gate, up):
        # silu(g) = g / (1 + exp(-g)), the form torch uses; exp(-g) = inf for very
        # negative g gives -0, not NaN.
        return gate / (1.0 + tl.exp(-gate)) * up

    _silu_mul = silu_mul
    return silu_mul


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl
    import triton
    import triton.language as tl

    jit_silu_mul()

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_xi, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        x_row = x_ptr + row * stride_xt
        # fp32 loads: the interpreter mishandles bf16 arithmetic, and fp32 is what the reference uses.
        gate = tl.load(x_row + cols * stride_xi, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_row + (cols + inter) * stride_xi, mask=ok, other=0.0).to(tl.float32)
        out = _silu_mul(gate, up)
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    return silu_and_mul_kernel
