"""Verify steps as decode rows: the shape the verify CUDA graphs capture (issue 22).

A verify chunk of n = 1 + k tokens at positions start..start+n-1 is, for attention, n
one-token rows of one sequence: row i attends to its first start + i + 1 positions,
through the sequence's block table. A step of decode and verify chunks only is then a
decode-shaped batch of as many rows as it has tokens, every row's logits wanted (the rows
and order the varlen path's ``logit_rows`` gives such a step), so it can replay a graph
of fixed shape instead of launching the varlen prefill kernels eagerly.

Unlike a decode step's rows, a verify chunk's rows read each other's K/V: the fused decode
kernel writes a row's K/V and attends in one launch, where another row's program may not
have written its key yet. So these rows write every K/V first, then attend
(``AttentionMetadata.writes_first``), in the graphs and eagerly alike.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from spark.core.plan import Chunk

# The most rows a verify step runs as decode rows, and the largest verify graph: a server's verify
# steps are its speculating batch (``SpecConfig.max_batch``, 8) times 1 + its drafts (4), 40 rows.
# Past this a varlen chunk reads its context once where its rows would each read it again.
MAX_ROWS = 64


@attrs.frozen
class DecodeRows:
    """A step's tokens as one-token rows: each row's context length and block table."""

    seq_lens: list[int]  # [rows]: positions each row attends to, its own included
    tables: list[list[int]]  # [rows]: its sequence's pages


def decode_rows(chunks: Sequence[Chunk], seq_lens: Sequence[int], tables: Sequence[list[int]],
                limit: int) -> DecodeRows | None:
    """The rows of a step of decode and verify chunks (``seq_lens``, ``tables``: per chunk, after the
    step), or None: a chunk that is neither, no verify chunk (a decode step is rows already), or more
    than ``limit`` rows."""
    if not any(c.draft for c in chunks) or sum(c.num_tokens for c in chunks) > limit:
        return None
    if any(not c.decodes for c in chunks):
        return None  # a prefill chunk: its logits are the last row's only, and the varlen kernel is cheaper
    row_lens, row_tables = [], []
    for chunk, end, table in zip(chunks, seq_lens, tables):
        row_lens.extend(range(end - chunk.num_tokens + 1, end + 1))
        row_tables.extend([table] * chunk.num_tokens)
    return DecodeRows(row_lens, row_tables)
