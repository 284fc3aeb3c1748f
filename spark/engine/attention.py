"""Attention over the paged KV cache, for one flat varlen batch.

The engine builds one ``AttentionMetadata`` per step; every layer reuses it.
Which implementation runs is decided by the device: the torch references on
the CPU (Triton's interpreter is far too slow to serve from), the Triton
kernels on a GPU where they apply.
"""

from __future__ import annotations

import attrs
import torch

from spark.engine.kernels import kv_write, paged_attention as pa, prefill_attention


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


def leading_single_rows(query_start_loc: list[int]) -> int:
    """How many sequences at the start of a batch compute one token (``query_start_loc[i] == i``)."""
    n = 0
    while n + 1 < len(query_start_loc) and query_start_loc[n + 1] == n + 1:
        n += 1
    return n


def paged_attention(
    q: torch.Tensor,  # [T, H, Dh]
    k: torch.Tensor,  # [T, Hkv, Dh]
    v: torch.Tensor,  # [T, Hkv, Dh]
    k_cache: torch.Tensor,  # [pages, page_size, Hkv, Dh]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into their pages, then attend. Returns [T, H, Dh].

    ``kv_written``: the caller has already written k and v into the cache (the fused
    rope + KV-write kernel on a GPU), so they are not written again; k and v are unused.
    """
    on_gpu = q.is_cuda
    if not kv_written:
        write = kv_write.write_kv_triton if on_gpu else kv_write.write_kv_reference
        write(k, v, k_cache, v_cache, meta.slot_mapping)
    if on_gpu:
        return attend_triton(q, k_cache, v_cache, meta, scale)
    return pa.paged_attention_reference(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
    )


def attend_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """The Triton kernels for a step whose K/V are in the cache. Returns [T, H, Dh].

    Single-token rows take the decode kernel, which reads each KV head once for
    its whole GQA group; in the prefill kernel each of them would fill a block of
    query rows alone and read its context once per query head. A mixed step (the
    decodes first, as plans put them) is split in two: decodes, then prefill chunks.
    """
    if meta.decode_only:
        return pa.paged_decode_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    n = meta.num_single
    prefill = prefill_attention.paged_prefill_attention_triton(
        q[n:], k_cache, v_cache, meta.query_start_loc[n:] - n, meta.seq_lens[n:], meta.block_tables[n:], scale,
        meta.max_query_len,
    )
    if n == 0:
        return prefill
    decode = pa.paged_decode_attention_triton(q[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n], scale)
    return torch.cat((decode, prefill))


def paged_decode_attention_rope(
    q: torch.Tensor,  # [B, H, Dh] unrotated
    k: torch.Tensor,  # [B, Hkv, Dh] unrotated
    v: torch.Tensor,  # [B, Hkv, Dh]
    rope: tuple[torch.Tensor, torch.Tensor],  # positions [B] int64, inv_freq [Dh // 2] fp32
    k_cache: torch.Tensor,  # [pages, page_size, Hkv, Dh]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """GPU decode step (``meta.decode_only``): rope, KV write and attention in one launch. Returns [B, H, Dh].

    Decode at small batch is bound by kernel launches; this saves the separate rope +
    KV-write launch of every layer.
    """
    positions, inv_freq = rope
    return pa.paged_decode_attention_rope_triton(
        q, k, v, positions, inv_freq, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, scale
    )
