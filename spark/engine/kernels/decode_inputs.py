"""Unpack a decode step's inputs from one flat staging buffer: a torch reference and a Triton kernel.

A decode graph reads static buffers (input ids, positions, slots, context lengths,
block tables). Filling each from the host costs a launch apiece, and at batch 1 of a
small model the host's launches are what a step waits on. So the host sends one flat
int64 buffer in one copy, and the graph's first kernel spreads it into the typed
buffers. Layout for a bucket of ``B`` rows::

    [0]                 width: block-table columns sent per row
    [1]                 ring row: where this step's greedy tokens go (``ring_index``)
    [2 + 0B : 2 + 1B]   input ids
    [2 + 1B : 2 + 2B]   positions
    [2 + 2B : 2 + 3B]   cache slots (-1: a padding row, writes no K/V)
    [2 + 3B : 2 + 4B]   context lengths (0: attends to nothing)
    [2 + 4B : 2 + 5B]   feeds: -1 the id as sent; -2 ``fed[row]``; k >= 0 ``ring.flat[k]``
    [2 + 5B : ...]      block tables, ``width`` per row, row-major

A feed is a token that a launched step is still sampling: the id exists only on the
device. The ring holds the greedy tokens of the last few graph steps, so a step right
behind another takes its ids without any host launch; tokens from elsewhere (the
general sampler) are copied into ``fed`` by the host first.

The kernel takes PDL with its trigger first: the embedding lookup after it (kernels/embedding.py)
launches at once and waits there for the ids.
"""

from __future__ import annotations

import functools

import torch

from spark.engine.kernels import launch

# Bound by `_kernel()` on first use, never at import (see activation.py).
triton = None
tl = None
_wait_for_previous = None  # launch's PDL wait, bound by `_kernel()` for the kernel

HEADER = 2  # width, ring row
FEED_AS_SENT, FEED_FROM_FED = -1, -2


def table_offset(bucket: int) -> int:
    """Where the block tables start in the staging buffer of ``bucket`` rows."""
    return HEADER + 5 * bucket


def unpack_decode_inputs_reference(staged, bucket, ring, fed, input_ids, positions, slot_mapping, seq_lens,
                                   block_tables, ring_index) -> None:
    """Fill rows ``[:bucket]`` of the step's buffers from ``staged`` (torch reference; reads the
    width from the buffer on the host, so it is for the CPU). Columns of ``block_tables`` past
    the width keep what they held: attention reads no page past a row's length."""
    width, ring_row = int(staged[0]), int(staged[1])
    ids, pos, slots, lens, feed = staged[HEADER:table_offset(bucket)].view(5, bucket)
    from_ring = ring.reshape(-1)[feed.clamp(min=0)]
    ids = torch.where(feed >= 0, from_ring, torch.where(feed == FEED_FROM_FED, fed[:bucket], ids))
    input_ids[:bucket] = ids
    positions[:bucket] = pos
    slot_mapping[:bucket] = slots
    seq_lens[:bucket] = lens.to(seq_lens.dtype)
    at = table_offset(bucket)
    block_tables[:bucket, :width] = staged[at:at + bucket * width].view(bucket, width).to(block_tables.dtype)
    ring_index[:bucket] = ring_row * ring.shape[1] + torch.arange(bucket, device=staged.device)


def unpack_decode_inputs_triton(staged, bucket, ring, fed, input_ids, positions, slot_mapping, seq_lens,
                                block_tables, ring_index) -> None:
    """As the reference, in one launch that reads the width on the device (so a CUDA graph
    can replay it for any width up to the tables' columns). One program per row."""
    assert staged.dtype == ring.dtype == fed.dtype == input_ids.dtype == torch.int64
    assert block_tables.stride(1) == 1 and ring.is_contiguous()
    kernel = _kernel()
    kernel[(bucket,)](
        staged, ring, fed, input_ids, positions, slot_mapping, seq_lens, block_tables, ring_index,
        block_tables.stride(0), ring.shape[1], bucket, BLOCK=128, FROM_FED=FEED_FROM_FED,
        **launch.pdl(kernel, staged),
    )


@functools.cache
def _kernel():
    global triton, tl, _wait_for_previous
    import triton
    import triton.language as tl

    _wait_for_previous = launch.jit_wait_for_previous()

    # One compile for every bucket and engine: Triton would otherwise specialise the ints
    # (== 1, multiples of 16) and compile several variants while graphs are captured, which
    # happens in the background of a serving process.
    @triton.jit(do_not_specialize=["table_stride", "ring_width", "bucket"])
    def unpack_decode_inputs_kernel(
        staged, ring, fed, input_ids, positions, slot_mapping, seq_lens, block_tables, ring_index,
        table_stride, ring_width, bucket, BLOCK: tl.constexpr, FROM_FED: tl.constexpr, PDL: tl.constexpr,
    ):
        row = tl.program_id(0)
        if PDL:  # the ring holds an earlier kernel's tokens
            _wait_for_previous(True)
        width = tl.load(staged)
        ring_row = tl.load(staged + 1)
        rows = staged + 2 + row
        token = tl.load(rows)
        feed = tl.load(rows + 4 * bucket)
        # Both candidates are loaded from valid addresses and one is picked: no branch.
        from_ring = tl.load(ring + tl.maximum(feed, 0))
        from_fed = tl.load(fed + row)
        token = tl.where(feed >= 0, from_ring, tl.where(feed == FROM_FED, from_fed, token))
        tl.store(input_ids + row, token)
        tl.store(positions + row, tl.load(rows + bucket))
        tl.store(slot_mapping + row, tl.load(rows + 2 * bucket))
        tl.store(seq_lens + row, tl.load(rows + 3 * bucket).to(tl.int32))
        tl.store(ring_index + row, ring_row * ring_width + row)
        table = staged + 2 + 5 * bucket + row * width
        # A while loop, not range(0, width, BLOCK): Triton 3.6's interpreter cannot take a
        # runtime bound of a for loop (key_block.py says why), and the tests run it there.
        start = 0
        while start < width:
            cols = start + tl.arange(0, BLOCK)
            keep = cols < width
            pages = tl.load(table + cols, mask=keep)
            tl.store(block_tables + row * table_stride + cols, pages.to(tl.int32), mask=keep)
            start += BLOCK

    return unpack_decode_inputs_kernel
