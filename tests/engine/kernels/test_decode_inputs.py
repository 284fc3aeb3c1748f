import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels import decode_inputs
from spark.engine.kernels.decode_inputs import unpack_decode_inputs_reference, unpack_decode_inputs_triton


def _buffers(rows: int, columns: int, ring_rows: int = 3):
    """The step's static buffers, filled with stale values a step must overwrite."""
    return dict(
        ring=torch.arange(ring_rows * rows, dtype=torch.int64).view(ring_rows, rows) + 1000,
        fed=torch.arange(rows, dtype=torch.int64) + 500,
        input_ids=torch.full((rows,), 7, dtype=torch.int64),
        positions=torch.full((rows,), 7, dtype=torch.int64),
        slot_mapping=torch.full((rows,), 7, dtype=torch.int64),
        seq_lens=torch.full((rows,), 7, dtype=torch.int32),
        block_tables=torch.full((rows, columns), 7, dtype=torch.int32),
        ring_index=torch.full((rows,), 7, dtype=torch.int64),
    )


def _staged(bucket: int, width: int, ring_row: int, ring_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 1 << 40, (4, bucket), generator=gen)  # ids, positions, slots, lengths
    rows[2, -1] = -1  # a padding row's slot
    feed = torch.randint(-2, ring_size, (bucket,), generator=gen)  # as sent, from fed, from the ring
    tables = torch.randint(0, 1 << 30, (bucket * width,), generator=gen)
    return torch.cat([torch.tensor([width, ring_row]), rows.reshape(-1), feed, tables, torch.zeros(11, dtype=torch.int64)])


# Buckets of 1 and a few rows; widths of none, under one block, and past two blocks of 128 columns.
@pytest.mark.parametrize("bucket, width", [(1, 1), (3, 0), (5, 17), (2, 300)])
def test_triton_matches_reference(bucket, width):
    rows, columns, ring_rows = 6, 320, 3
    staged = _staged(bucket, width, ring_row=2, ring_size=ring_rows * rows, seed=bucket + width)
    expected, actual = _buffers(rows, columns, ring_rows), _buffers(rows, columns, ring_rows)
    unpack_decode_inputs_reference(staged, bucket, **expected)
    unpack_decode_inputs_triton(staged, bucket, **actual)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_reference_reads_the_layout_the_module_documents():
    bucket, width = 2, 3
    staged = torch.tensor([width, 1, 10, 11, 20, 21, 30, -1, 4, 0, -1, 2,  # ids, positions, slots, lengths, feeds
                           5, 6, 7, 8, 9, 0])  # tables
    assert decode_inputs.table_offset(bucket) == 12
    b = _buffers(4, 5, ring_rows=2)
    unpack_decode_inputs_reference(staged, bucket, **b)
    assert b["input_ids"].tolist() == [10, 1002, 7, 7]  # row 1 fed from the ring's flat index 2
    assert b["positions"].tolist() == [20, 21, 7, 7]
    assert b["slot_mapping"].tolist() == [30, -1, 7, 7]
    assert b["seq_lens"].tolist() == [4, 0, 7, 7]
    assert b["block_tables"][:2].tolist() == [[5, 6, 7, 7, 7], [8, 9, 0, 7, 7]]  # columns past the width kept
    assert b["ring_index"].tolist() == [4, 5, 7, 7]  # ring row 1 of width 4

    staged[decode_inputs.HEADER + 4 * bucket] = decode_inputs.FEED_FROM_FED  # row 0
    unpack_decode_inputs_reference(staged, bucket, **b)
    assert b["input_ids"][0] == 500  # fed by the host
