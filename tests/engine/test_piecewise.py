"""Piecewise graphs' split of the forward: the same hidden states, logits and greedy tokens as the
plain forward, for steps padded up to a bucket.

CUDA graphs need a GPU (benchmarks/piecewise_check.py replays them there); here the runner's
segments run uncaptured, the very functions a graph would hold, on the same padded static
buffers, with the GPU's Triton kernels in the interpreter and with the CPU's ops.
"""

import os

# Before anything can JIT a kernel (see tests/engine/kernels/test_model_ops.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from spark.engine.engine import Engine  # noqa: E402
from spark.engine.kv_cache import KVCache  # noqa: E402
from spark.engine.models.ops import CpuOps, TritonOps  # noqa: E402
from spark.engine.offline import generate  # noqa: E402
from spark.engine.piecewise import PiecewiseGraphs  # noqa: E402
from spark.engine.sampling import SamplingParams  # noqa: E402
from spark.engine.weights import resolve_model  # noqa: E402
from tests.engine.kernels.test_model_ops import PAGE, _model, _step  # noqa: E402

# (seq, first position, tokens) chunks, decodes first as plans put them: a prefill of exactly a
# bucket (16), mixed steps padded from 17 and 18 to 32, a mixed step of 9 padded to 16, and one
# filling the largest bucket (40).
STEPS = [
    [(0, 0, 6), (1, 0, 3), (2, 0, 5), (3, 0, 2)],
    [(0, 6, 1), (1, 3, 1), (2, 5, 1), (3, 2, 1), (4, 0, 13)],
    [(0, 7, 1), (1, 4, 1), (4, 13, 7), (5, 0, 9)],
    [(0, 8, 1), (2, 6, 1), (5, 9, 7)],
    [(0, 9, 1), (1, 5, 1), (2, 7, 1), (3, 3, 1), (4, 20, 6), (5, 16, 12), (6, 0, 18)],
]


@pytest.mark.parametrize("ops", [TritonOps, CpuOps])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def test_piecewise_forward_matches_the_plain_forward(preset, ops):
    source = resolve_model(f"dummy:{preset}")
    model, plain_cache = _model(source, ops(), torch.float32, num_seqs=7)
    pieces_cache = KVCache(source.config, 8 * 7, PAGE, torch.float32, torch.device("cpu"))
    runner = PiecewiseGraphs(model, max_tokens=40, device="cpu", dtype=torch.float32)
    assert runner.buckets == [16, 32, 40] and runner.bucket_for(1) is None
    runner.capture_all()
    assert runner.progress == (3, 3)
    # Stale rows from earlier, larger steps: what the padding rows compute must not reach a real row.
    gen = torch.Generator().manual_seed(0)
    for buffer in (runner.residual, runner.qkv, runner.attn, runner.hidden):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    runner.input_ids.copy_(torch.randint(0, source.config.vocab_size, runner.input_ids.shape, generator=gen))
    with torch.inference_mode():
        for chunks in STEPS:
            positions, meta = _step(chunks, decode_only=False)
            ids = torch.randint(0, source.config.vocab_size, positions.shape, generator=gen)
            expected = model(ids, positions, plain_cache.layers, meta)
            got = runner.forward(ids, positions, pieces_cache.layers, meta)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            last = meta.query_start_loc[1:].long() - 1
            logits, want = model.compute_logits(got[last]), model.compute_logits(expected[last])
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(logits.argmax(-1), want.argmax(-1))
    # Attention ran on the real rows only: the same K/V in the same slots, nothing else written.
    torch.testing.assert_close(pieces_cache.storage, plain_cache.storage, rtol=1e-5, atol=1e-5)


def test_a_step_larger_than_every_bucket_is_left_to_the_plain_forward():
    source = resolve_model("dummy:tiny-llama")
    model, cache = _model(source, CpuOps(), torch.float32)
    runner = PiecewiseGraphs(model, max_tokens=8, device="cpu", dtype=torch.float32)
    runner.capture_all()
    positions, meta = _step([(0, 0, 9)], decode_only=False)
    assert runner.forward(torch.zeros(9, dtype=torch.int64), positions, cache.layers, meta) is None


def test_the_largest_bucket_is_made_first_then_the_smallest_upward():
    source = resolve_model("dummy:tiny-llama")
    model, _ = _model(source, CpuOps(), torch.float32)
    runner = PiecewiseGraphs(model, max_tokens=100, device="cpu", dtype=torch.float32)
    runner.capture_all()
    assert list(runner.ready) == [100, 16, 32, 48, 64, 96]  # in the order made


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_an_engine_generates_the_same_tokens_through_the_pieces(preset):
    """Chunked prompts beside decoding sequences: every mixed step through the runner, the same
    greedy tokens as the plain forward's."""
    engine = Engine.load(f"dummy:{preset}", device="cpu", dtype=torch.float32, kv_cache_tokens=2048, progress=False)
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 9, 40, 2)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def tokens():
        outs = generate(engine, prompts, params, max_prefill_tokens=12, max_batch_size=4)
        return [[o.token_id for o in out] for out in outs]

    plain = tokens()
    engine.piecewise = runner = PiecewiseGraphs(engine.model, max_tokens=16, device="cpu", dtype=engine.dtype)
    runner.capture_all()
    used, forward = [], runner.forward

    def counted(*args):
        hidden = forward(*args)
        used.append(hidden is not None)
        return hidden

    runner.forward = counted
    try:
        assert tokens() == plain
    finally:
        engine.piecewise = None
    assert used and all(used)
