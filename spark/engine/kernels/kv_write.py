"""Write this step's K/V into the paged cache: a torch reference and a Triton kernel.

Cache layout (shared with the model and the engine): per layer `k_cache` and
`v_cache`, each `[num_pages, page_size, num_kv_heads, head_dim]`. A token's flat
slot is `page * page_size + offset`; slot -1 marks a padding token (CUDA-graph
batches are padded to a captured size) whose K/V must not be written.
"""

import functools

import torch

# Bound by `_kernel()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the reference may not have triton at all.
triton = None
tl = None


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter each token's K/V into its cache slot, in place (torch reference).

    Args:
      k, v: `[T, Hkv, D]` this step's keys and values.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, written in place.
      slot_mapping: `[T]` int64 flat slot of each token; -1 skips the token.
    """
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # Index (page, offset) rather than viewing the cache flat: index_put_ writes through
    # any view, whatever the strides of the big allocation it lives in.
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = k[keep].to(k_cache.dtype)
    v_cache[pages, offsets] = v[keep].to(v_cache.dtype)


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter each token's K/V into its cache slot, in place (Triton).

    One program per token copies its `[Hkv, D]` block of K and of V. Inputs may be
    strided views (e.g. slices of a fused qkv projection).

    Args:
      k, v: `[T, Hkv, D]` this step's keys and values.
      k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, written in place.
      slot_mapping: `[T]` int64 flat slot of each token; -1 skips the token.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v.shape == k.shape
    assert k_cache.stride() == v_cache.stride()
    kernel = _kernel()
    kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(),
        num_kv_heads, head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_cp, stride_co, stride_ch, stride_cd,
        num_kv_heads, head_dim,
        PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    return write_kv_kernel
