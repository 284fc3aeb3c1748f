"""The warm-up grid: every step shape a server will plan, run once, leaving the engine as it found it."""

import logging
import re

import pytest

from spark.core.plan import Chunk, StepPlan
from spark.engine.engine import Engine
from spark.engine.sampling import SamplingParams
from spark.engine.warmup import WarmupShape, decode_batches, prefill_sizes, warm_up


@pytest.fixture(scope="module")
def engine():
    return Engine.load("dummy:tiny-llama", device="cpu", progress=False, max_model_len=2048, weight_format="dense")


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    pages = engine.new_page_allocator()
    engine.add_sequence("probe", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tokens, size = [], len(prompt)
    while len(tokens) < n:
        done = engine.num_computed("probe") + size
        table = pages.append("probe", done) if pages.has("probe") else pages.allocate("probe", done)
        tokens += [o.token_id for o in engine.step(StepPlan((Chunk("probe", size, table),)))]
        size = 1
    return tokens


def test_the_grid_meets_every_size_class():
    assert prefill_sizes(512) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129,
                                  255, 256, 257, 511, 512]
    assert prefill_sizes(100)[-1] == 100 and 101 not in prefill_sizes(100)
    assert decode_batches(3) == [3, 2, 1]


def test_a_cpu_engine_is_not_warmed(engine, caplog):
    with caplog.at_level(logging.INFO, logger="spark.load"):
        assert warm_up(engine, WarmupShape(4, 64)) == 0.0
    assert not caplog.records


def test_warm_up_runs_every_step_it_announced_and_leaves_the_engine_as_it_was(engine, caplog):
    before = greedy(engine, [5, 9, 2, 7, 1], 12)
    engine.remove_sequence("probe")
    with caplog.at_level(logging.INFO, logger="spark.load"):
        warm_up(engine, WarmupShape(max_batch=6, max_prefill_tokens=128), any_device=True)
    progress = [m for r in caplog.records if (m := re.search(r"(\d+) steps / (\d+) steps", r.getMessage()))]
    assert progress[-1][1] == progress[-1][2]  # the announced count is the steps run: the bar reaches its end
    assert not engine._seqs and not engine._inflight  # its sequences are gone
    assert greedy(engine, [5, 9, 2, 7, 1], 12) == before  # and a request computes as before
    engine.remove_sequence("probe")
