"""Attention over the paged KV cache, for one flat varlen batch.

The engine builds one ``AttentionMetadata`` per step; every layer reuses it.
Two implementations of one step (rotate q and k, write k and v, attend): the torch
references (``rope_attend_reference``; the CPU, where Triton's interpreter is far too
slow to serve from) and the Triton kernels (``rope_attend_triton``). Which one a
model runs is chosen once, when it is built (``models/ops.py``). The caches are a layer's
entries of ``KVCache.layers``: plain tensors, or an fp8 cache's ``ScaledPages``, whose
scales go to the kernels beside the pages.
"""

from __future__ import annotations

import functools

import attrs
import torch

from spark.engine.kernels import kv_write, norm, paged_attention as pa, prefill_attention, rope
from spark.engine.kv_cache import pages_and_scale


@attrs.frozen
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to.

    B sequences, T tokens in all; sequence b owns query rows
    ``query_start_loc[b]:query_start_loc[b+1]``.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token (-1: skip)
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_pages] int32: pages of each sequence, 0-padded
    decode_only: bool  # every sequence computes exactly one token
    max_query_len: int = 1  # the longest query of the batch (sizes the prefill kernel's grid)
    num_single: int = 0  # leading sequences with one query token (the decodes of a mixed step)
    # Decode rows that read each other's K/V (a verify chunk flattened into rows, ``verify.py``):
    # every row's K/V is written before any row attends, never in the fused one-launch decode.
    writes_first: bool = False

    @functools.cached_property
    def mixed(self) -> MixedParts:
        """The step cut for ``attend_triton``'s two kernels, by the first layer that asks; every other
        layer reuses it (its tensors are not changed after the metadata is built)."""
        return MixedParts.cut(self)


@attrs.frozen
class MixedParts:
    """A mixed step's metadata cut in two: its ``n = num_single`` leading decode rows, and the
    sequences after them (the prefill chunks), rebased to start at query row 0.

    Cut once a step rather than once a layer: rebasing ``query_start_loc`` is a kernel launch,
    and each slice a trip through torch's dispatcher."""

    decode_seq_lens: torch.Tensor  # [n]
    decode_block_tables: torch.Tensor  # [n, max_pages]
    prefill_query_start_loc: torch.Tensor  # [B - n + 1]: query_start_loc[n:] - n
    prefill_seq_lens: torch.Tensor  # [B - n]
    prefill_block_tables: torch.Tensor  # [B - n, max_pages]

    @classmethod
    def cut(cls, meta: AttentionMetadata) -> MixedParts:
        n = meta.num_single
        qsl = meta.query_start_loc
        return cls(
            decode_seq_lens=meta.seq_lens[:n], decode_block_tables=meta.block_tables[:n],
            prefill_query_start_loc=qsl[n:] - n if n else qsl,
            prefill_seq_lens=meta.seq_lens[n:], prefill_block_tables=meta.block_tables[n:],
        )


def leading_single_rows(query_start_loc: list[int]) -> int:
    """How many sequences at the start of a batch compute one token (``query_start_loc[i] == i``)."""
    n = 0
    while n + 1 < len(query_start_loc) and query_start_loc[n + 1] == n + 1:
        n += 1
    return n


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation (NeoX) RoPE. x: [T, H, Dh]; cos, sin: [T, Dh // 2] fp32, shared by every layer."""
    return rope.rotate(x, cos[:, None, :], sin[:, None, :])


def rope_attend_reference(
    q: torch.Tensor,  # [T, H, Dh] unrotated
    k: torch.Tensor,  # [T, Hkv, Dh] unrotated
    v: torch.Tensor,  # [T, Hkv, Dh]
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, Dh // 2] fp32 each
    k_cache,  # [pages, page_size, Hkv, Dh], or an fp8 cache's ScaledPages
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, Dh] to write the result into (a slice of a caller's buffer)
) -> torch.Tensor:
    """Rotate q and k, write this step's K/V into their pages, attend (torch). Returns [T, H, Dh]: ``out``
    when given."""
    (k_cache, k_scale), (v_cache, v_scale) = pages_and_scale(k_cache), pages_and_scale(v_cache)
    cos, sin = cos_sin
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv_write.write_kv_reference(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    return pa.paged_attention_reference(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, k_scale, v_scale, out=out
    )


def rope_attend_triton(
    q: torch.Tensor,  # [T, H, Dh] unrotated
    k: torch.Tensor,  # [T, Hkv, Dh] unrotated
    v: torch.Tensor,  # [T, Hkv, Dh]
    positions_inv_freq: tuple[torch.Tensor, torch.Tensor],  # [T] int64, [Dh // 2] fp32: kernels compute cos/sin
    k_cache,  # [pages, page_size, Hkv, Dh], or an fp8 cache's ScaledPages
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, Dh], any strides: the kernels write the result there
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q weight, k weight, eps): Qwen3's
) -> torch.Tensor:
    """``rope_attend_reference`` in Triton kernels. Returns [T, H, Dh]: ``out`` when given.

    ``qk_norm``: RMSNorm each head of q and k first (Qwen3), inside the decode launch where a step
    takes it, else by two launches of the norm kernel.

    Decode at small batch is bound by kernel launches: a decode-only step rotates,
    writes and attends in one launch; any other step rotates and writes in one, then
    attention only reads the cache. So do decode rows that read each other's K/V
    (``meta.writes_first``): in the one launch a row's program could read a key that
    another row's program has not written yet.
    """
    positions, inv_freq = positions_inv_freq
    (k_pages, k_scale), (v_pages, v_scale) = pages_and_scale(k_cache), pages_and_scale(v_cache)
    if meta.decode_only and not meta.writes_first:
        return pa.paged_decode_attention_rope_triton(
            q, k, v, positions, inv_freq, k_pages, v_pages, meta.slot_mapping, meta.block_tables, meta.seq_lens, scale,
            k_scale=k_scale, v_scale=v_scale, out=out, qk_norm=qk_norm,
        )
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = norm.rms_norm_triton(q, q_weight, eps), norm.rms_norm_triton(k, k_weight, eps)
    q = rope.rope_and_write_kv_triton(q, k, v, positions, inv_freq, k_pages, v_pages, meta.slot_mapping,
                                      k_scale, v_scale)
    return attend_triton(q, k_cache, v_cache, meta, scale, out)


def attend_triton(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernels for a step whose K/V are in the cache. Returns [T, H, Dh]: ``out`` when given
    (any strides), else a new tensor.

    Single-token rows take the decode kernel, which reads each KV head once for
    its whole GQA group; in the prefill kernel each of them would fill a block of
    query rows alone and read its context once per query head. A mixed step (the
    decodes first, as plans put them) is split in two: decodes, then prefill chunks,
    each kernel writing its rows of the one output (the step's cut, ``meta.mixed``, is
    made once for all layers). Every row belongs to a sequence (T is ``query_start_loc[-1]``).
    """
    (k_cache, k_scale), (v_cache, v_scale) = pages_and_scale(k_cache), pages_and_scale(v_cache)
    if meta.decode_only:
        return pa.paged_decode_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                k_scale=k_scale, v_scale=v_scale, out=out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n, parts = meta.num_single, meta.mixed
    if n:
        pa.paged_decode_attention_triton(q[:n], k_cache, v_cache, parts.decode_block_tables, parts.decode_seq_lens,
                                         scale, k_scale=k_scale, v_scale=v_scale, out=out[:n])
    prefill_attention.paged_prefill_attention_triton(
        q[n:], k_cache, v_cache, parts.prefill_query_start_loc, parts.prefill_seq_lens, parts.prefill_block_tables,
        scale, meta.max_query_len, k_scale, v_scale, out=out[n:],
    )
    return out
