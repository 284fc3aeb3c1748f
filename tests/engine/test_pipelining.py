"""Launching step N+1 before step N is collected must not change a token.

The engine reads the ids of tokens still being sampled on the device; a plan
made before an end was known names the ended sequence once more, and the
engine drops it. Runs on the default model (float32, CPU), where ``launch``
completes at once but the bookkeeping is the same as on a GPU.
"""

from __future__ import annotations

import pytest

from spark.engine.offline import generate
from spark.core.plan import Chunk, StepPlan
from spark.engine.sampling import SamplingParams

PROMPT = "Once upon a time, in a quiet village by the sea, there lived"


def _run_pipelined(engine, prompts: dict, params: SamplingParams, steps: int) -> dict[str, list[int]]:
    """Prefill all, then decode with two steps in flight; planned like a pipelined scheduler."""
    alloc = engine.new_page_allocator()
    for sid, ids in prompts.items():
        engine.add_sequence(sid, ids, params)
    tokens: dict[str, list[int]] = {sid: [] for sid in prompts}
    engine.launch(StepPlan(tuple(Chunk(s, len(ids), alloc.allocate(s, len(ids))) for s, ids in prompts.items())))
    live = set(prompts)
    for _ in range(steps):
        chunks = tuple(Chunk(s, 1, alloc.append(s, engine.num_tokens(s))) for s in sorted(live))
        engine.launch(StepPlan(chunks))
        for out in engine.collect():
            tokens[out.seq_id].append(out.token_id)
            if out.finish_reason is not None:
                live.discard(out.seq_id)
                alloc.free(out.seq_id)
    while engine.num_inflight:
        for out in engine.collect():
            tokens[out.seq_id].append(out.token_id)
    for sid in prompts:
        engine.remove_sequence(sid)
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=6, ignore_eos=True),
], ids=["greedy", "seeded", "penalties"])
def test_two_steps_in_flight_give_the_tokens_of_one_at_a_time(engine, params):
    ids = engine.tokenizer.encode(PROMPT)
    prompts = {"a": ids, "b": ids[:5]}
    expected = {sid: [o.token_id for o in outs] for sid, outs in zip(prompts, generate(engine, list(prompts.values()), params))}
    # generate() pipelines too: check it against strict step-by-step decoding first.
    alloc = engine.new_page_allocator()
    one_by_one = {}
    for sid, p in prompts.items():
        engine.add_sequence(sid, p, params)
        out = engine.step(StepPlan((Chunk(sid, len(p), alloc.allocate(sid, len(p))),)))
        got = [out[0].token_id]
        while out[0].finish_reason is None:
            out = engine.step(StepPlan((Chunk(sid, 1, alloc.append(sid, engine.num_tokens(sid))),)))
            got.append(out[0].token_id)
        one_by_one[sid] = got
        alloc.free(sid)
    assert one_by_one == expected
    assert _run_pipelined(engine, prompts, params, steps=10) == expected


def test_a_sequence_that_ends_at_a_launched_step_is_dropped_from_the_next(engine):
    ids = engine.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    first = generate(engine, [ids], greedy)[0][0].token_id
    alloc = engine.new_page_allocator()
    engine.add_sequence("stops", ids, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(first,)))
    engine.add_sequence("goes", ids, greedy)
    engine.launch(StepPlan(tuple(Chunk(s, len(ids), alloc.allocate(s, len(ids))) for s in ("stops", "goes"))))
    # Planned before the stop is known: both decode once more.
    engine.launch(StepPlan(tuple(Chunk(s, 1, alloc.append(s, len(ids) + 1)) for s in ("stops", "goes"))))
    outs = engine.collect()
    assert [(o.seq_id, o.finish_reason) for o in outs] == [("stops", "stop"), ("goes", None)]
    assert [o.seq_id for o in engine.collect()] == ["goes"]  # the ended sequence's extra row is dropped
    # A plan made later still may name it: skipped, not an error.
    engine.launch(StepPlan((Chunk("stops", 1, alloc.append("stops", len(ids) + 2)),)))
    assert engine.collect() == []
    with pytest.raises(ValueError, match="unknown sequence"):
        engine.launch(StepPlan((Chunk("never-added", 1, (1,)),)))
    engine.remove_sequence("goes")


def test_a_length_end_at_a_launched_step_is_not_computed_again(engine):
    ids = engine.tokenizer.encode(PROMPT)
    alloc = engine.new_page_allocator()
    engine.add_sequence("one", ids, SamplingParams(temperature=0, max_tokens=1))
    engine.launch(StepPlan((Chunk("one", len(ids), alloc.allocate("one", len(ids))),)))
    engine.launch(StepPlan((Chunk("one", 1, alloc.append("one", len(ids) + 1)),)))
    assert [o.finish_reason for o in engine.collect()] == ["length"]
    assert engine.collect() == []


def test_step_refuses_to_run_beside_launched_steps(engine):
    ids = engine.tokenizer.encode(PROMPT)
    alloc = engine.new_page_allocator()
    engine.add_sequence("x", ids, SamplingParams(temperature=0, max_tokens=4))
    engine.launch(StepPlan((Chunk("x", len(ids), alloc.allocate("x", len(ids))),)))
    with pytest.raises(RuntimeError, match="launch"):
        engine.step(StepPlan((Chunk("x", 1, alloc.append("x", len(ids) + 1)),)))
    engine.collect()
    engine.remove_sequence("x")
    with pytest.raises(RuntimeError, match="collect"):
        engine.collect()


def test_a_launch_that_raises_leaves_nothing_to_collect(engine, monkeypatch):
    """A failed forward (say, out of memory) fails that step only: the engine keeps stepping."""
    ids = engine.tokenizer.encode(PROMPT)
    alloc = engine.new_page_allocator()
    engine.add_sequence("oom", ids, SamplingParams(temperature=0, max_tokens=2))

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "_forward_eager", fail)
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.step(StepPlan((Chunk("oom", len(ids), alloc.allocate("oom", len(ids))),)))
    assert engine.num_inflight == 0
    (out,) = engine.step(StepPlan((Chunk("oom", len(ids), alloc.append("oom", len(ids))),)))
    assert out.seq_id == "oom" and out.finish_reason is None
    engine.remove_sequence("oom")


def test_a_chunks_token_mask_limits_what_it_samples(engine):
    """The plan's per-row token mask (the seam for grammars): greedy decoding picks the best
    allowed token, rows without a mask are untouched."""
    import numpy as np

    ids = engine.tokenizer.encode(PROMPT)
    alloc = engine.new_page_allocator()
    greedy = SamplingParams(temperature=0, max_tokens=2)
    for sid in ("free", "masked"):
        engine.add_sequence(sid, ids, greedy)
    (free,) = [o.token_id for o in engine.step(StepPlan((Chunk("free", len(ids), alloc.allocate("free", len(ids))),)))]
    allowed = np.zeros(engine.vocab_size, dtype=bool)
    allowed[[7, 4242]] = True
    mask = np.packbits(allowed, bitorder="little").tobytes()
    out = engine.step(StepPlan((
        Chunk("masked", len(ids), alloc.allocate("masked", len(ids)), token_mask=mask),
        Chunk("free", 1, alloc.append("free", len(ids) + 1)),
    )))
    assert out[0].token_id in (7, 4242) and free not in (7, 4242)
    assert out[1].seq_id == "free"  # decoding on, unmasked
    with pytest.raises(ValueError, match="token mask of 8 bits"):
        engine.step(StepPlan((Chunk("masked", 1, alloc.append("masked", len(ids) + 1), token_mask=b"\x01"),)))
    (after,) = engine.step(StepPlan((Chunk("masked", 1, alloc.block_table("masked")),)))  # refused whole: it steps on
    assert after.seq_id == "masked" and after.finish_reason == "length"
    engine.remove_sequence("free")
    engine.remove_sequence("masked")


def test_a_late_mask_is_applied_when_it_comes_and_nothing_steps_before_it(engine):
    """A ``mask_later`` chunk runs its forward at launch and samples only at ``sample_late``: the
    token it samples is the mask's, the step before it is collected first, and launching or collecting
    the waiting step is refused until its masks came."""
    import numpy as np

    ids = engine.tokenizer.encode(PROMPT)
    alloc = engine.new_page_allocator()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    engine.add_sequence("late", ids, greedy)
    engine.add_sequence("now", ids, greedy)
    allowed = np.zeros(engine.vocab_size, dtype=bool)
    allowed[4242] = True
    only_4242 = np.packbits(allowed, bitorder="little").tobytes()
    allowed[:] = False
    allowed[7] = True
    only_7 = np.packbits(allowed, bitorder="little").tobytes()
    engine.launch(StepPlan((Chunk("late", len(ids), alloc.allocate("late", len(ids))),)))
    engine.launch(StepPlan((Chunk("late", 1, alloc.append("late", len(ids) + 1), mask_later=True),
                            Chunk("now", len(ids), alloc.allocate("now", len(ids)), token_mask=only_7))))
    with pytest.raises(RuntimeError, match="waits for its masks"):
        engine.launch(StepPlan((Chunk("late", 1, alloc.append("late", len(ids) + 2)),)))
    (first,) = engine.collect()
    with pytest.raises(RuntimeError, match="waits for its masks"):
        engine.collect()
    engine.sample_late({"late": only_4242, "gone": b""})
    second, now = engine.collect()
    assert second.seq_id == "late" and second.token_id == 4242 != first.token_id
    assert now.seq_id == "now" and now.token_id == 7  # the mask it came with holds too
    engine.sample_late({})  # nothing waits: a no-op
    # a late mask of the wrong size fails the step: the engine drops it (the core then fails its requests)
    engine.launch(StepPlan((Chunk("late", 1, alloc.append("late", len(ids) + 2), mask_later=True),)))
    with pytest.raises(ValueError, match="token mask of 8 bits"):
        engine.sample_late({"late": b"\x01"})
    assert engine.num_inflight == 0
    engine.remove_sequence("late")
    engine.remove_sequence("now")
