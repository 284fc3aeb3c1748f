"""Write this step's K/V into the paged cache: a torch reference and a Triton kernel.

Cache layout (shared with the model and the engine): per layer `k_cache` and
`v_cache`, each `[num_pages, page_size, num_kv_heads, head_dim]`. A token's flat
slot is `page * page_size + offset`; slot -1 marks a padding token (CUDA-graph
batches are padded to a captured size) whose K/V must not be written. An fp8 cache
comes with per-head scales (`k_scale`, `v_scale`, `[Hkv]` fp32) and stores each value
quantized (fp8.py); without scales the values are cast to the cache's dtype.
"""

import functools

import torch

from spark.engine.kernels import fp8

# Bound by `_kernel()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the reference may not have triton at all.
triton = None
tl = None
_quantize = None  # fp8's, bound by `_kernel()`: the kernel finds it among these globals


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K/V into its cache slot, in place (torch reference).

    Args:
      k, v: `[T, Hkv, D]` this step's keys and values.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, written in place.
      slot_mapping: `[T]` int64 flat slot of each token; -1 skips the token.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache (values stored quantized), or None.
    """
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # Index (page, offset) rather than viewing the cache flat: index_put_ writes through
    # any view, whatever the strides of the big allocation it lives in.
    pages, offsets = slots // page_size, slots % page_size
    if k_scale is None:
        k_cache[pages, offsets] = k[keep].to(k_cache.dtype)
        v_cache[pages, offsets] = v[keep].to(v_cache.dtype)
    else:
        k_cache[pages, offsets] = fp8.quantize_reference(k[keep], k_scale)
        v_cache[pages, offsets] = fp8.quantize_reference(v[keep], v_scale)


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K/V into its cache slot, in place (Triton).

    One program per token copies its `[Hkv, D]` block of K and of V. Inputs may be
    strided views (e.g. slices of a fused qkv projection).

    Args:
      k, v: `[T, Hkv, D]` this step's keys and values.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, written in place.
      slot_mapping: `[T]` int64 flat slot of each token; -1 skips the token.
      k_scale, v_scale: `[Hkv]` fp32 scales of an fp8 cache (values stored quantized), or None.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v.shape == k.shape
    assert k_cache.stride() == v_cache.stride()
    kernel = _kernel()
    scaled = k_scale is not None
    kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if scaled else slot_mapping, v_scale if scaled else slot_mapping,  # unread unless SCALED
        *k.stride(), *v.stride(), *k_cache.stride(),
        num_kv_heads, head_dim,
        PAGE_SIZE=k_cache.shape[1], SCALED=scaled,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl, _quantize
    import triton
    import triton.language as tl

    _quantize = fp8.jit_quantize()

    @triton.jit
    def write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_cp, stride_co, stride_ch, stride_cd,
        num_kv_heads, head_dim,
        PAGE_SIZE: tl.constexpr, SCALED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0)
        # int64: page * stride_cp overflows int32 on caches beyond 2G elements.
        slot = tl.load(slot_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        # Padding tokens (slot -1) are masked out rather than branched on: same code path.
        mask = (heads < num_kv_heads) & (dims < head_dim) & (slot >= 0)
        src_k = token * stride_kt + heads * stride_kh + dims * stride_kd
        src_v = token * stride_vt + heads * stride_vh + dims * stride_vd
        dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_co + heads * stride_ch + dims * stride_cd
        k = tl.load(k_ptr + src_k, mask=mask)
        v = tl.load(v_ptr + src_v, mask=mask)
        if SCALED:
            head_ok = heads < num_kv_heads
            k = _quantize(k.to(tl.float32), tl.load(k_scale_ptr + heads, mask=head_ok, other=1.0))
            v = _quantize(v.to(tl.float32), tl.load(v_scale_ptr + heads, mask=head_ok, other=1.0))
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    return write_kv_kernel
