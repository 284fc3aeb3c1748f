"""Rotary position embedding (half rotation, NeoX style) on q and k: reference and Triton.

For each head vector x of a token at position p, with `x1, x2 = x[:Dh/2], x[Dh/2:]`
and angles `p * inv_freq` (fp32): `out = cat(x1*cos - x2*sin, x2*cos + x1*sin)`,
computed in fp32 and cast back to x's dtype. The angle is the same fp32 product in
both versions; cos/sin are not bit-identical (torch's vs numpy's in the interpreter,
libdevice's `__nv_cosf`/`__nv_sinf` on the GPU), each within ~2 fp32 ulps of the true
value, so results agree to ~1e-6 absolute for unit-scale inputs, far below a bf16 ulp.
"""

import functools

import torch

# Bound by `_kernel()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the reference may not have triton at all.
triton = None
tl = None


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions (torch reference).

    Args:
      q: `[T, H, Dh]`, may be a strided view (a slice of a fused qkv output).
      k: `[T, Hkv, Dh]`, likewise.
      positions: `[T]` int64 position of each token.
      inv_freq: `[Dh // 2]` fp32 inverse frequencies.
      inplace: write the results into q and k and return them.

    Returns:
      `(q_out, k_out)` in q's and k's dtypes.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh // 2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    q_out, k_out = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if inplace:
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions (Triton); see `apply_rope_reference`.

    One program per token rotates all its q and k heads: the cos/sin of its position
    are computed once and shared by every head, and no cos/sin cache is read.

    Args:
      q: `[T, H, Dh]`, any strides.
      k: `[T, Hkv, Dh]`, any strides.
      positions: `[T]` int64.
      inv_freq: `[Dh // 2]` fp32.
      inplace: write into q and k (safe even when both are views of one fused
        buffer: each program reads a token's heads before writing them, and q and k
        do not overlap) and return them; otherwise return new contiguous tensors.

    Returns:
      `(q_out, k_out)` in q's and k's dtypes.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and inv_freq.shape == (half,) and head_dim % 2 == 0
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    kernel = _kernel()
    kernel[(num_tokens,)](
        q, k, positions, inv_freq, q_out, k_out,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), inv_freq.stride(0),
        num_heads, num_kv_heads, half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(
        q_ptr, k_ptr, positions_ptr, inv_freq_ptr, q_out_ptr, k_out_ptr,
        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
        stride_qot, stride_qoh, stride_qod, stride_kot, stride_koh, stride_kod, stride_f,
        num_heads, num_kv_heads, half,
        BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, BLOCK_HALF)
        dim_ok = dims < half
        # The same fp32 product as the reference's `positions.float() * inv_freq`, so
        # only cos/sin themselves can differ (exact for positions below 2**24).
        pos = tl.load(positions_ptr + token).to(tl.float32)
        angle = pos * tl.load(inv_freq_ptr + dims * stride_f, mask=dim_ok, other=0.0)
        # tl.cos/tl.sin compile to libdevice's __nv_cosf/__nv_sinf, which reduce large
        # arguments properly (angles reach ~1e5 rad at long contexts), not to the
        # sin.approx instruction whose error grows outside [-100pi, 100pi].
        cos = tl.cos(angle)[None, :]
        sin = tl.sin(angle)[None, :]

        # q: [BLOCK_H, BLOCK_HALF] halves. fp32 loads: the interpreter mishandles bf16
        # arithmetic, and fp32 is what the reference computes in.
        heads = tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < num_heads) & dim_ok[None, :]
        src = q_ptr + token * stride_qt + heads * stride_qh + dims[None, :] * stride_qd
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half * stride_qd, mask=mask, other=0.0).to(tl.float32)
        dst = q_out_ptr + token * stride_qot + heads * stride_qoh + dims[None, :] * stride_qod
        tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half * stride_qod, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

        # k: the same rotation on [BLOCK_HKV, BLOCK_HALF].
        heads = tl.arange(0, BLOCK_HKV)[:, None]
        mask = (heads < num_kv_heads) & dim_ok[None, :]
        src = k_ptr + token * stride_kt + heads * stride_kh + dims[None, :] * stride_kd
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half * stride_kd, mask=mask, other=0.0).to(tl.float32)
        dst = k_out_ptr + token * stride_kot + heads * stride_koh + dims[None, :] * stride_kod
        tl.store(dst, (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half * stride_kod, (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)

    return rope_kernel
