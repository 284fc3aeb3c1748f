"""RMSNorm, alone and fused with the residual add: torch references and a Triton kernel.

Numerics follow Hugging Face's LlamaRMSNorm so that bf16 runs round where the
reference does: normalise in fp32, cast to the input dtype, then multiply by the
weight. The fused add rounds `x + residual` to the input dtype before normalising,
as the eager model's `h = x + attn_out` in bf16 does.
"""

import functools

import torch

from spark.engine.kernels import launch

# Bound by `_kernel()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the references may not have triton at all.
triton = None
tl = None
_wait_for_previous = None  # launch's PDL wait, bound by `_kernel()` for the kernel


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row (torch reference).

    Args:
      x: `[..., D]`.
      weight: `[D]`.
      eps: added to the mean square before the rsqrt.

    Returns:
      `[..., D]` in x's dtype: `weight * (x / rms(x)).to(x.dtype)`, the division in fp32.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm (torch reference).

    Args:
      x: `[..., D]` the sublayer output, or `[S, ..., D]` fp32 split-K partial products
        of it (`small_linear.small_linear_split_k_triton`), summed and rounded to the
        residual's dtype first, as the unsplit projection rounds its output.
      residual: `[..., D]` the residual stream, x's dtype (unless partials).
      weight: `[D]`.
      eps: added to the mean square before the rsqrt.

    Returns:
      `(normed, new_residual)`: `new_residual = x + residual` in the residual's dtype and
      `normed = rms_norm(new_residual)`.
    """
    if x.dim() == residual.dim() + 1:
        x = x.sum(0).to(residual.dtype)
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row (Triton); same arguments and result as `rms_norm_reference`.

    Args:
      x: `[..., D]`, rows may be strided.
      weight: `[D]`.
      eps: added to the mean square before the rsqrt.

    Returns:
      `[..., D]` contiguous, in x's dtype.
    """
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm in one pass over memory (Triton).

    Same arguments and results as `add_rms_norm_reference`; both outputs are new
    contiguous tensors, the inputs are left alone.
    """
    if x.dim() == residual.dim() + 1:  # split-K partials: the kernel sums them
        assert x.shape[1:] == residual.shape and x.dtype == torch.float32
        return _launch(x.reshape(x.shape[0], -1, x.shape[-1]), residual, weight, eps, shape=residual.shape)
    assert residual.shape == x.shape and residual.dtype == x.dtype
    return _launch(x, residual, weight, eps)


def _launch(x, residual, weight, eps, shape=None):
    """With `shape` given, x is `[S, rows, D]` partials of the rows of that shape."""
    parts = 1 if shape is None else x.shape[0]
    shape, dim = shape or x.shape, x.shape[-1]
    assert weight.shape == (dim,)
    has_residual = residual is not None
    # Leading dims flattened into rows; reshape copies only when they cannot be viewed.
    x = x.reshape(-1, dim) if parts == 1 else x
    dtype = residual.dtype if has_residual else x.dtype
    out = torch.empty(x.shape[-2:], dtype=dtype, device=x.device)
    # Without a residual the kernel never touches these; x fills the arguments.
    residual = residual.reshape(-1, dim) if has_residual else x
    residual_out = torch.empty_like(out) if has_residual else x
    if out.shape[0] > 0:
        kernel = _kernel()
        block_d = triton.next_power_of_2(dim)
        kernel[(out.shape[0],)](
            x, residual, weight, out, residual_out,
            x.stride(0) if parts > 1 else 0, x.stride(-2), x.stride(-1),
            residual.stride(0), residual.stride(1), weight.stride(0),
            dim, eps,
            HAS_RESIDUAL=has_residual, PARTS=parts, BLOCK_D=block_d,
            # ~8-16 fp32 elements of the row per thread; 8 warps carry D = 8192 at 32 each.
            num_warps=min(max(block_d // 512, 1), 8), **launch.pdl(kernel, x),
        )
    return out.view(shape), (residual_out.view(shape) if has_residual else None)


@functools.cache
def jit_head_norm():
    """JIT and return `head_norm`, Qwen3's per-head q/k RMSNorm as the decode attention kernel
    (paged_attention.py) takes it inside its launch, rounded as `rms_norm_reference` rounds."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def head_norm(x1, x2, weight_ptr, lane, half, dim_ok, head_dim, eps, dtype):
        """RMSNorm of each row of heads held as rope's halves: lane d has x1 = x[d % half] and
        x2 = x[half + d % half] ([rows, BLOCK_D] fp32, masked lanes 0). Returns them normed as
        `rms_norm_reference` rounds: x * rstd rounded to `dtype`, times the weight, rounded.
        Every element sits in two lanes (as x1 in one, x2 in another), so the lanes' x1^2 + x2^2
        sum to twice the row's sum of squares."""
        mean_square = tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * head_dim)
        rstd = tl.rsqrt(mean_square + eps)[:, None]
        w1 = tl.load(weight_ptr + lane, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + lane, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        return x1, x2

    return head_norm


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl, _wait_for_previous
    import triton
    import triton.language as tl

    _wait_for_previous = launch.jit_wait_for_previous()

    @triton.jit
    def rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
        stride_xs, stride_xt, stride_xd, stride_rt, stride_rd, stride_w,
        dim, eps,
        HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # the rows come from the kernel before
            _wait_for_previous(False)
        # One program per row, the whole row in registers: the mean square needs every
        # element before any can be written, and D <= 8192 fits (32 fp32 per thread at 8
        # warps), so each element is read once and written once, with no second pass.
        row = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < dim
        # Loaded as fp32: the interpreter mishandles bf16 arithmetic, and fp32 is where
        # the reference computes anyway.
        x = tl.load(x_ptr + row * stride_xt + dims * stride_xd, mask=dim_ok, other=0.0).to(tl.float32)
        if PARTS > 1:
            # Split-K partial products of the projection before: their fp32 sum, rounded
            # as that projection would round its output.
            for part in tl.static_range(1, PARTS):
                x += tl.load(x_ptr + part * stride_xs + row * stride_xt + dims * stride_xd, mask=dim_ok, other=0.0)
            x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_rt + dims * stride_rd, mask=dim_ok, other=0.0).to(tl.float32)
            # Round the sum to the input dtype before normalising, as eager bf16 `x + r` does;
            # the rounded value is both the new residual and the norm's input.
            h = (x + r).to(out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * dim + dims, h, mask=dim_ok)
            x = h.to(tl.float32)
        mean_square = tl.sum(x * x, axis=0) / dim  # masked lanes are 0 and add nothing
        normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(weight_ptr + dims * stride_w, mask=dim_ok, other=0.0).to(tl.float32)
        # Product of the rounded normalised value and the weight, rounded once: what
        # torch's `weight * normed` in the input dtype computes.
        out = w * normed.to(tl.float32)
        tl.store(out_ptr + row * dim + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    return rms_norm_kernel
