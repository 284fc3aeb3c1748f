"""Rotary position embedding (half rotation, NeoX style) on q and k: reference and Triton.

For each head vector x of a token at position p, with `x1, x2 = x[:Dh/2], x[Dh/2:]`
and angles `p * inv_freq` (fp32): `out = cat(x1*cos - x2*sin, x2*cos + x1*sin)`,
computed in fp32 and cast back to x's dtype. The angle is the same fp32 product in
both versions; cos/sin are not bit-identical (torch's vs numpy's in the interpreter,
libdevice's `__nv_cosf`/`__nv_sinf` on the GPU), each within ~2 fp32 ulps of the true
value, so results agree to ~1e-6 absolute for unit-scale inputs, far below a bf16 ulp.

`rope_and_write_kv_*` fuses the rotation with the paged KV-cache write (see kv_write.py
for the cache layout): decode at small batch is bound by kernel launches, and this
saves one per layer. An fp8 cache's K/V are stored quantized (fp8.py) by its per-head
scales `k_scale`, `v_scale`.
"""

import functools

import torch

from spark.engine.kernels import fp8
from spark.engine.kernels.kv_write import write_kv_reference

# Bound by `jit_cos_sin()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the reference may not have triton at all.
triton = None
tl = None
_cos_sin = None  # bound by `jit_cos_sin()`: Triton finds a called function among the caller's globals
_quantize = None  # fp8's, bound by `_kernel()`


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
    q_out, k_out = rotate(q, cos, sin), rotate(k, cos, sin)
    if inplace:
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half rotation of `x [..., Dh]` by `cos`, `sin` (fp32, broadcastable to `[..., Dh // 2]`),
    computed in fp32 and cast back to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_and_write_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k, write the rotated k and v into the paged cache (torch reference).

    Args:
      q: `[T, H, Dh]`, may be a strided view; not modified.
      k, v: `[T, Hkv, Dh]`, likewise.
      positions: `[T]` int64 position of each token.
      inv_freq: `[Dh // 2]` fp32 inverse frequencies.
      k_cache, v_cache: `[num_pages, page_size, Hkv, Dh]`, written in place.
      slot_mapping: `[T]` int64 flat slot of each token; -1 (padding) writes nothing.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache, or None.

    Returns:
      The rotated q, `[T, H, Dh]` in q's dtype.
    """
    q_rot, k_rot = apply_rope_reference(q, k, positions, inv_freq)
    write_kv_reference(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_rot


def rope_and_write_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k and write the rotated k and v into the paged cache: one launch (Triton).

    One program per token computes its cos/sin once, rotates all its q heads into a new
    contiguous output, rotates its k heads straight into the token's cache slot and
    copies its v there. q is not rotated in place: it is a view into the fused qkv
    output, and leaving that buffer as the projection wrote it keeps the call free of
    aliasing surprises for the caller; a [T, H, Dh] allocation costs no kernel launch.
    No host syncs and shapes only from the inputs' sizes, so it can be graph-captured.

    Args:
      q: `[T, H, Dh]`, any strides; not modified.
      k, v: `[T, Hkv, Dh]`, any strides; not modified.
      positions: `[T]` int64.
      inv_freq: `[Dh // 2]` fp32.
      k_cache, v_cache: `[num_pages, page_size, Hkv, Dh]`, same strides, written in place.
      slot_mapping: `[T]` int64 flat slot of each token; -1 (padding) still gets its q
        rotated but writes nothing to the cache.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache, or None.

    Returns:
      The rotated q, `[T, H, Dh]` contiguous, in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert inv_freq.shape == (half,) and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    kernel = _kernel()
    scaled = k_scale is not None
    kernel[(num_tokens,)](
        q, k, v, positions, inv_freq, slot_mapping, q_out, k_cache, v_cache,
        k_scale if scaled else inv_freq, v_scale if scaled else inv_freq,  # unread unless SCALED
        *q.stride(), *k.stride(), *v.stride(), *q_out.stride(), *k_cache.stride(), inv_freq.stride(0),
        num_heads, num_kv_heads, half,
        PAGE_SIZE=k_cache.shape[1], SCALED=scaled,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out


@functools.cache
def jit_cos_sin():
    """JIT and return `cos_sin`, which this module's kernel and the decode attention kernel
    (paged_attention.py) share: every kernel that rotates computes the same cos/sin
    bits, so a key rotated by one equals the key rotated by another."""
    global triton, tl, _cos_sin
    import triton
    import triton.language as tl

    @triton.jit
    def cos_sin(positions_ptr, inv_freq_ptr, token, dims, dim_ok, stride_f):
        """cos and sin `[1, len(dims)]` of token's angles at frequency lanes `dims`."""
        # The same fp32 product as the reference's `positions.float() * inv_freq`, so
        # only cos/sin themselves can differ (exact for positions below 2**24).
        pos = tl.load(positions_ptr + token).to(tl.float32)
        angle = pos * tl.load(inv_freq_ptr + dims * stride_f, mask=dim_ok, other=0.0)
        # tl.cos/tl.sin compile to libdevice's __nv_cosf/__nv_sinf, which reduce large
        # arguments properly (angles reach ~1e5 rad at long contexts), not to the
        # sin.approx instruction whose error grows outside [-100pi, 100pi].
        return tl.cos(angle)[None, :], tl.sin(angle)[None, :]

    _cos_sin = cos_sin
    return cos_sin


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global _quantize
    jit_cos_sin()
    _quantize = fp8.jit_quantize()

    @triton.jit
    def rope_write_kv_kernel(
        q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
        k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
        stride_qot, stride_qoh, stride_qod, stride_cp, stride_co, stride_ch, stride_cd, stride_f,
        num_heads, num_kv_heads, half,
        PAGE_SIZE: tl.constexpr, SCALED: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, BLOCK_HALF)
        dim_ok = dims < half
        cos, sin = _cos_sin(positions_ptr, inv_freq_ptr, token, dims, dim_ok, stride_f)

        # q: [BLOCK_H, BLOCK_HALF] halves, loaded as fp32 (the interpreter mishandles bf16
        # arithmetic), rotated into the contiguous output whatever the token's slot.
        heads = tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < num_heads) & dim_ok[None, :]
        src = q_ptr + token * stride_qt + heads * stride_qh + dims[None, :] * stride_qd
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half * stride_qd, mask=mask, other=0.0).to(tl.float32)
        dst = q_out_ptr + token * stride_qot + heads * stride_qoh + dims[None, :] * stride_qod
        tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half * stride_qod, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

        # int64 slot: page * stride_cp overflows int32 on caches beyond 2G elements.
        # Padding tokens (slot -1) are masked out of the cache stores, not branched on.
        slot = tl.load(slot_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_HKV)[:, None]
        mask = (heads < num_kv_heads) & dim_ok[None, :] & (slot >= 0)
        cache = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_co + heads * stride_ch
        cache_lo = cache + dims[None, :] * stride_cd
        cache_hi = cache_lo + half * stride_cd

        # k: rotated, rounded to k's dtype first (as the reference's k_rot is), then
        # cast to the cache's dtype, so that mixed dtypes match the reference bit for bit.
        src = k_ptr + token * stride_kt + heads * stride_kh + dims[None, :] * stride_kd
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half * stride_kd, mask=mask, other=0.0).to(tl.float32)
        k_lo = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
        k_hi = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)

        # v: a plain copy, in the same two halves so that it shares the k addressing.
        src = v_ptr + token * stride_vt + heads * stride_vh + dims[None, :] * stride_vd
        v_lo = tl.load(src, mask=mask)
        v_hi = tl.load(src + half * stride_vd, mask=mask)
        if SCALED:  # an fp8 cache: each head's values quantized by its scale
            head_ok = heads < num_kv_heads
            k_scale = tl.load(k_scale_ptr + heads, mask=head_ok, other=1.0)
            v_scale = tl.load(v_scale_ptr + heads, mask=head_ok, other=1.0)
            k_lo, k_hi = _quantize(k_lo.to(tl.float32), k_scale), _quantize(k_hi.to(tl.float32), k_scale)
            v_lo, v_hi = _quantize(v_lo.to(tl.float32), v_scale), _quantize(v_hi.to(tl.float32), v_scale)
        tl.store(k_cache_ptr + cache_lo, k_lo.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_cache_ptr + cache_hi, k_hi.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_lo, v_lo.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_hi, v_hi.to(v_cache_ptr.dtype.element_ty), mask=mask)

    return rope_write_kv_kernel
