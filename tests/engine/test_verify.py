"""Verify steps as decode rows (``spark/engine/verify.py``, issue 22), on a tiny dummy model on the CPU.

The rows compute what the varlen verify chunk computes: the same logits at the model, the same
tokens at the engine, eagerly and through verify graphs. The graphs need a GPU; here a stand-in
"graph" runs the very forward a verify graph captures (staging buffer, unpacking, K/V written
before attending, the ring of greedy tokens), as ``test_cuda_graphs.py`` does for decode graphs.
The Triton kernels run in the interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated at its first launch

import pytest
import torch

from spark.core.page_allocator import PageAllocator
from spark.core.plan import Chunk, StepPlan
from spark.core.speculation import SpecConfig
from spark.engine.cuda_graphs import DecodeGraphs
from spark.engine.engine import Engine
from spark.engine.kv_cache import KVCache
from spark.engine.models.ops import CpuOps, TorchOps, TritonOps
from spark.engine.models.runtime import Runtime, build_model
from spark.engine.sampling import SamplingParams
from spark.engine.verify import decode_rows
from spark.engine.weights import iter_weights, resolve_model
from spark.serve_config import ServeConfig
from tests.engine.kernels.test_model_ops import PAGE, _step

OPS = [TorchOps, CpuOps, TritonOps]


def _model(ops):
    source = resolve_model("dummy:tiny-llama")
    runtime = Runtime(torch.device("cpu"), torch.float32, ops())
    return build_model(source.config, runtime, iter_weights(source, dtype=torch.float32, device="cpu", progress=False))


def test_decode_rows_spread_each_chunk_over_rows_of_growing_context():
    chunks = [Chunk("a", 1, (3,)), Chunk("b", 3, (5, 6), draft=(7, 8)), Chunk("c", 2, (9,), draft=(4,))]
    rows = decode_rows(chunks, seq_lens=[4, 7, 2], tables=[[3], [5, 6], [9]], limit=6)
    assert rows.seq_lens == [4, 5, 6, 7, 1, 2]
    assert rows.tables == [[3], [5, 6], [5, 6], [5, 6], [9], [9]]
    assert decode_rows(chunks, [4, 7, 2], [[3], [5, 6], [9]], limit=5) is None  # more rows than graphs hold
    assert decode_rows(chunks[:1], [4], [[3]], limit=6) is None  # a decode step: rows already
    prefill = [Chunk("a", 2, (3,)), chunks[1]]
    assert decode_rows(prefill, [5, 7], [[3], [5, 6]], limit=6) is None  # a prefill chunk is no row


def test_verify_graphs_are_planned_only_for_an_engine_that_speculates():
    assert ServeConfig().verify_graph_rows() == 0
    assert ServeConfig(speculative="ngram").verify_graph_rows() == SpecConfig().verify_rows == 8 * (1 + 4)
    plain = DecodeGraphs(None, None, max_batch_size=8, max_pages_per_seq=4, device="cpu")
    assert plain.verify_buckets == [] and plain.progress == (0, 4)  # buckets 1, 2, 4, 8: as before
    graphs = DecodeGraphs(None, None, max_batch_size=8, max_pages_per_seq=4, device="cpu", verify_rows=40)
    assert graphs.verify_buckets == [2, 4, 8, 16, 24, 32, 40] and graphs.progress == (0, 11)
    assert graphs.ring.shape[1] == graphs.input_ids.shape[0] == 40  # every verify row has its buffers' row
    assert graphs._to_capture[:4] == [(8, False), (4, False), (2, False), (1, False)]  # decode graphs first


def _meta(chunks, decode_only=False, writes_first=False):
    """(positions, meta) of chunks (seq, first position, tokens); seq b owns pages 8b..8b+7."""
    return _step(chunks, decode_only, writes_first)


def _as_rows(chunks):
    """The step's chunks as one-token rows, as the engine flattens a verify step."""
    return [(b, start + i, 1) for b, start, n in chunks for i in range(n)]


@pytest.mark.parametrize("ops", OPS, ids=lambda ops: ops.__name__)
def test_verify_rows_compute_what_the_varlen_verify_step_computes(ops):
    model = _model(ops)
    config = model.config
    caches = [KVCache(config, 24, PAGE, torch.float32, torch.device("cpu")) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    prefill = [(0, 0, 9), (1, 0, 14), (2, 0, 5)]
    # A decode, a verify of 1 + 4 tokens (crossing a page) and a verify of 1 + 1, as a plan puts them.
    verify = [(0, 9, 1), (1, 14, 5), (2, 5, 2)]
    with torch.inference_mode():
        positions, meta = _meta(prefill)
        ids = torch.randint(0, config.vocab_size, positions.shape, generator=gen)
        for cache in caches:
            model(ids, positions, cache.layers, meta)
        positions, varlen = _meta(verify)
        ids = torch.randint(0, config.vocab_size, positions.shape, generator=gen)
        expected = model.compute_logits(model(ids, positions, caches[0].layers, varlen))  # every row's logits
        row_positions, rows = _meta(_as_rows(verify), decode_only=True, writes_first=True)
        assert torch.equal(row_positions, positions)
        logits = model.compute_logits(model(ids, positions, caches[1].layers, rows))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    for (k0, v0), (k1, v1) in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)


class _Eager:
    """A graph whose replay runs the captured forward (a verify graph's, if ``verify``) eagerly."""

    def __init__(self, graphs, bucket, verify, vocab_size):
        self.graphs, self.bucket, self.verify, self.replays = graphs, bucket, verify, 0
        self.logits = torch.zeros(bucket, vocab_size)

    def replay(self):
        self.replays += 1
        self.logits.copy_(self.graphs._forward(self.bucket, self.verify))


def _stand_in_graphs(engine, verify_rows: int) -> DecodeGraphs:
    graphs = DecodeGraphs(engine.model, engine.kv_cache.layers, max_batch_size=4, verify_rows=verify_rows,
                          max_pages_per_seq=-(-engine.max_model_len // engine.page_size), device="cpu")
    for buckets, captured, verify in ((graphs.buckets, graphs.graphs, False),
                                      (graphs.verify_buckets, graphs.verify_graphs, True)):
        for b in buckets:
            graph = _Eager(graphs, b, verify, engine.vocab_size)
            captured[b] = (graph, graph.logits)
    return graphs


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _generate(engine, prompts, params, reference=None) -> dict:
    """Each prompt's tokens; with ``reference`` (tokens by sequence), drafts from it: none for the
    first sequence, the next 4 tokens for the second, the next 3 with the second wrong for the others."""
    alloc = PageAllocator(engine.num_pages, engine.page_size)
    for sid, ids in enumerate(prompts):
        engine.add_sequence(sid, ids, params[sid])
    engine.step(StepPlan(tuple(Chunk(s, len(ids), alloc.allocate(s, len(ids))) for s, ids in enumerate(prompts))))
    tokens = {sid: [] for sid in range(len(prompts))}
    live = set(tokens)
    while live:
        chunks = []
        for sid in sorted(live):
            draft = ()
            if reference is not None and sid > 0:
                at = engine.num_tokens(sid) - len(prompts[sid])  # outputs so far, the launched one included
                draft = list(reference[sid][at:at + (4 if sid == 1 else 3)])
                if sid > 1 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % engine.vocab_size
                draft = tuple(draft)
            known = engine.num_tokens(sid)
            chunks.append(Chunk(sid, 1 + len(draft), alloc.append(sid, known + len(draft)), draft=draft))
        for out in engine.step(StepPlan(tuple(chunks))):
            tokens[out.seq_id].append(out.token_id)
            if out.finish_reason is not None:
                live.discard(out.seq_id)
    for sid in tokens:
        engine.remove_sequence(sid)
        alloc.free(sid)
    return tokens


# The interpreter's kernels take seconds a step: one case, of fewer tokens, runs them.
CASES = [(CpuOps, (GREEDY,) * 3), (CpuOps, (GREEDY, SEEDED, GREEDY)), (TritonOps, (SHORT,) * 3)]


@pytest.mark.parametrize("ops, mix", CASES, ids=["cpu-greedy", "cpu-seeded", "triton-greedy"])
def test_verify_steps_give_the_tokens_of_decoding_as_varlen_chunks_rows_and_graphs(ops, mix):
    engine = Engine(_model(ops), page_size=PAGE, kv_cache_tokens=256)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist() for n in (7, 13, 4)]
    params = list(mix)
    plain = _generate(engine, prompts, params)
    assert _generate(engine, prompts, params, reference=plain) == plain  # varlen verify chunks
    flattened = []
    forward = engine._forward_eager
    engine._forward_eager = lambda *args, **kw: flattened.append(kw.get("writes_first")) or forward(*args, **kw)
    engine.verify_rows = 64
    try:
        assert _generate(engine, prompts, params, reference=plain) == plain  # eager decode rows
        assert flattened.count(True) >= 2  # the verify steps ran as rows
        engine.graphs = _stand_in_graphs(engine, verify_rows=12)  # a step has 10 rows at most
        engine.verify_rows = 12
        eager_rows = flattened.count(True)
        assert _generate(engine, prompts, params, reference=plain) == plain  # verify graphs, greedy from the ring
        assert sum(graph.replays for graph, _ in engine.graphs.verify_graphs.values()) >= 2
        assert flattened.count(True) == eager_rows  # no verify step ran eagerly
    finally:
        engine.graphs, engine.verify_rows, engine._forward_eager = None, 0, forward
