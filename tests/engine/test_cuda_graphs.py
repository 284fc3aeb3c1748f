"""What a decode graph's replay reads: the static buffers ``DecodeGraphs.run`` fills.

The graphs themselves need a GPU (benchmarks/gpu_check.py replays them against the
CPU path); the staging before a replay is plain tensor copies, checked here on the CPU.
"""

import torch

from spark.engine.cuda_graphs import DecodeGraphs


class _Graph:
    replays = 0

    def replay(self):
        self.replays += 1


def test_one_step_fills_every_row_of_the_bucket():
    graphs = DecodeGraphs(None, None, max_batch_size=8, max_pages_per_seq=4, device="cpu")
    graph, logits = _Graph(), torch.arange(4 * 5, dtype=torch.float32).view(4, 5)
    graphs.graphs[4] = (graph, logits)
    # Stale values from an earlier, larger step: the padding rows must not keep them.
    graphs.slot_mapping.fill_(7)
    graphs.seq_lens.fill_(9)
    graphs.input_ids.fill_(5)
    sampled = torch.tensor([100, 200, 300])  # a launched step's tokens, still on the device
    out = graphs.run(
        ids=[11, 0, 0], positions=[3, 8, 1], slots=[35, 72, 17], seq_lens=[4, 9, 2],
        tables=[[2], [4, 5, 6], [1]], feeds=[(sampled, [1, 2], [2, 0])],
    )
    assert graph.replays == 1 and torch.equal(out, logits[:3])
    assert graphs.input_ids[:4].tolist() == [11, 300, 100, 0]  # rows 1 and 2 fed on the device
    assert graphs.positions[:4].tolist() == [3, 8, 1, 0]
    assert graphs.slot_mapping[:4].tolist() == [35, 72, 17, -1]  # the padding row writes no K/V
    assert graphs.seq_lens[:4].tolist() == [4, 9, 2, 0]  # ... and attends to nothing
    assert graphs.block_tables[:4, :3].tolist() == [[2, 0, 0], [4, 5, 6], [1, 0, 0], [0, 0, 0]]
    assert graphs.input_ids.dtype == graphs.slot_mapping.dtype == torch.int64
    assert graphs.seq_lens.dtype == graphs.block_tables.dtype == torch.int32


def test_no_bucket_or_too_wide_a_table_means_no_replay():
    graphs = DecodeGraphs(None, None, max_batch_size=8, max_pages_per_seq=2, device="cpu")
    graphs.graphs[2] = (_Graph(), torch.zeros(2, 5))
    assert graphs.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [1, 1, 1], [[0], [1], [2]]) is None  # 3 rows, bucket 2
    assert graphs.run([1], [0], [0], [1], [[0, 1, 2]]) is None  # 3 pages, 2 columns
