"""What a decode graph's replay reads and what the engine does with what it returns.

The graphs themselves need a GPU (benchmarks/gpu_check.py replays them against the
CPU path). Here a stand-in "graph" runs the very forward a graph captures, eagerly on
the CPU: the staging buffer, its unpacking, the ring of greedy tokens and the engine's
use of them are the code a GPU runs, with the torch references in place of kernels.
"""

import pytest
import torch

from spark.engine.cuda_graphs import RING_ROWS, DecodeGraphs
from spark.core.plan import Chunk, StepPlan
from spark.engine.sampling import SamplingParams


class _Unpacks:
    """A graph whose replay only unpacks the staging buffer, as a captured graph does first."""

    def __init__(self, graphs, bucket):
        self.graphs, self.bucket, self.replays = graphs, bucket, 0

    def replay(self):
        self.replays += 1
        self.graphs.unpack(self.bucket)


class _Eager:
    """A graph whose replay runs the captured forward eagerly, into the same output buffer."""

    def __init__(self, graphs, bucket, vocab_size):
        self.graphs, self.bucket = graphs, bucket
        self.logits = torch.zeros(bucket, vocab_size)

    def replay(self):
        self.logits.copy_(self.graphs._forward(self.bucket))


def test_one_step_fills_every_row_of_the_bucket():
    graphs = DecodeGraphs(None, None, max_batch_size=8, max_pages_per_seq=4, device="cpu")
    graph, logits = _Unpacks(graphs, 4), torch.arange(4 * 5, dtype=torch.float32).view(4, 5)
    graphs.graphs[4] = (graph, logits)
    # Stale values from an earlier, larger step: the padding rows must not keep them.
    graphs.slot_mapping.fill_(7)
    graphs.seq_lens.fill_(9)
    graphs.input_ids.fill_(5)
    graphs.ring[2, :3] = torch.tensor([40, 50, 60])  # an earlier graph step's greedy tokens
    sampled = torch.tensor([100, 200, 300])  # a launched step's tokens from the sampler
    out, greedy = graphs.run(
        ids=[11, 0, 0, 0], positions=[3, 8, 1, 6], slots=[35, 72, 17, 9], seq_lens=[4, 9, 2, 7],
        tables=[[2], [4, 5, 6], [1], [3]], feeds=[(sampled, [1, 2], [2, 0]), (graphs.ring[2, :3], [3], [1])],
    )
    assert graph.replays == 1 and torch.equal(out, logits[:4])
    assert graphs.input_ids[:4].tolist() == [11, 300, 100, 50]  # rows 1-3 fed on the device
    assert graphs.positions[:4].tolist() == [3, 8, 1, 6]
    assert graphs.slot_mapping[:4].tolist() == [35, 72, 17, 9]
    assert graphs.seq_lens[:4].tolist() == [4, 9, 2, 7]
    assert graphs.block_tables[:4, :3].tolist() == [[2, 0, 0], [4, 5, 6], [1, 0, 0], [3, 0, 0]]
    assert graphs.input_ids.dtype == graphs.slot_mapping.dtype == torch.int64
    assert graphs.seq_lens.dtype == graphs.block_tables.dtype == torch.int32
    # This step's greedy tokens go to the first ring row, each row in its place.
    assert greedy.data_ptr() == graphs.ring[0].data_ptr() and greedy.shape == (4,)
    assert graphs._ring_index[:4].tolist() == [0, 1, 2, 3]

    graphs.run(ids=[8], positions=[4], slots=[36], seq_lens=[5], tables=[[2]])  # one row in the bucket of 4
    assert graphs.slot_mapping[:4].tolist() == [36, -1, -1, -1]  # padding rows write no K/V
    assert graphs.seq_lens[:4].tolist() == [5, 0, 0, 0]  # ... and attend to nothing
    assert graphs._ring_index[:4].tolist() == [8, 9, 10, 11]  # the next ring row


def test_no_bucket_or_too_wide_a_table_means_no_replay():
    graphs = DecodeGraphs(None, None, max_batch_size=8, max_pages_per_seq=2, device="cpu")
    graphs.graphs[2] = (_Unpacks(graphs, 2), torch.zeros(2, 5))
    assert graphs.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [1, 1, 1], [[0], [1], [2]]) is None  # 3 rows, bucket 2
    assert graphs.run([1], [0], [0], [1], [[0, 1, 2]]) is None  # 3 pages, 2 columns


def _with_graphs(engine, max_batch: int = 4) -> DecodeGraphs:
    graphs = DecodeGraphs(engine.model, engine.kv_cache.layers, max_batch_size=max_batch,
                          max_pages_per_seq=-(-engine.max_model_len // engine.page_size), device="cpu")
    for b in graphs.buckets:
        graph = _Eager(graphs, b, engine.vocab_size)
        graphs.graphs[b] = (graph, graph.logits)
    return graphs


def _decode(engine, prompts, *, in_flight: int) -> dict:
    """Prefill every prompt, then decode with ``in_flight`` steps launched ahead of the one read."""
    alloc = engine.new_page_allocator()
    for sid, (ids, p) in prompts.items():
        engine.add_sequence(sid, ids, p)
    tokens = {sid: [] for sid in prompts}
    engine.step(StepPlan(tuple(Chunk(s, len(ids), alloc.allocate(s, len(ids))) for s, (ids, _) in prompts.items())))
    live = set(prompts)
    while live or engine.num_inflight:
        if live and engine.num_inflight < in_flight:
            engine.launch(StepPlan(tuple(Chunk(s, 1, alloc.append(s, engine.num_tokens(s))) for s in sorted(live))))
            continue
        for out in engine.collect():
            tokens[out.seq_id].append(out.token_id)
            if out.finish_reason is not None:
                live.discard(out.seq_id)
    for sid in prompts:
        engine.remove_sequence(sid)
    return tokens


GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=7, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0, logprobs=2, max_tokens=7, ignore_eos=True)


@pytest.mark.parametrize("mix", [(GREEDY, GREEDY, GREEDY), (GREEDY, SEEDED, LOGPROBS)], ids=["greedy", "mixed"])
@pytest.mark.parametrize("in_flight", [2, RING_ROWS + 1])
def test_graph_steps_decode_the_tokens_of_eager_steps(engine, mix, in_flight):
    """Plain greedy batches take the graph's argmax and feed the next step from the ring; a
    batch the sampler must see feeds it through the host copy; with more steps in flight
    than the ring holds, the engine reads the oldest back before a row is reused."""
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    prompts = {f"s{i}": (ids[: 6 + 2 * i], p) for i, p in enumerate(mix)}
    eager = _decode(engine, prompts, in_flight=1)
    assert engine.graph_progress() == (0, 0)
    engine.graphs = _with_graphs(engine)
    assert engine.graph_progress() == (3, 3)  # buckets 1, 2 and 4, all "captured"
    sampled = []
    sampler = engine.sampler
    engine.sampler = lambda logits, batch, *mask: sampled.append(len(batch)) or sampler(logits, batch, *mask)
    try:
        assert _decode(engine, prompts, in_flight=in_flight) == eager
    finally:
        engine.graphs, engine.sampler = None, sampler
    # The prefill samples through the sampler; the decode steps only where a row needs it.
    assert len(sampled) == (1 if mix[1] is GREEDY else 1 + 6)


def test_a_step_feeding_from_an_old_ring_row_reads_it_back_before_the_row_is_reused(engine):
    ids = engine.tokenizer.encode("Once upon a time, in a quiet village by the sea")
    alloc = engine.new_page_allocator()

    def decode(*sids):
        engine.launch(StepPlan(tuple(Chunk(s, 1, alloc.append(s, engine.num_tokens(s))) for s in sids)))

    def run(graphs):
        engine.graphs = graphs
        for sid in ("a", "b"):
            engine.add_sequence(sid, ids, GREEDY)
        engine.step(StepPlan(tuple(Chunk(s, len(ids), alloc.allocate(s, len(ids))) for s in ("a", "b"))))
        decode("a", "b")  # a's next token: in ring row 0, on the device only
        for _ in range(RING_ROWS):
            decode("b")  # rows 1, 2, 3, then row 0 again
        decode("a")  # feeds from the first decode's tokens
        tokens = [o.token_id for _ in range(RING_ROWS + 2) for o in engine.collect() if o.seq_id == "a"]
        for sid in ("a", "b"):
            engine.remove_sequence(sid)
            alloc.free(sid)
        engine.graphs = None
        return tokens

    assert run(_with_graphs(engine)) == run(None)
