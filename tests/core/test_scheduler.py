"""The scheduler, its policies and the core's step loop, as pure objects: no trio, no model.

``drive`` steps a ``Core`` over the engine double on a fake clock (a step takes
``A + B * tokens`` seconds), so every plan is checked by the double the way the real
engine would check it; ``on_plan`` sees each plan as the scheduler makes it.
"""

from __future__ import annotations

import random

import pytest

from spark.core.core import Core
from spark.core.events import Failed, TokenBatch
from spark.core.policies import POLICIES, Limits, make_policy
from spark.core.step_model import StepTimeModel
from spark.core.scheduler import Scheduler, SeqState
from spark.engine.sampling import SamplingParams
from tests.actors.engine_double import FakeClock, SimulatedEngine

A, B = 0.005, 0.00025  # step seconds = A + B * tokens
R = 4 * B  # and per decode row, in the SLAI tests


class WatchedScheduler(Scheduler):
    """Calls ``on_plan(plan, ids running before it)`` for each plan it makes."""

    on_plan = None

    def schedule(self, now):
        before = {s.request_id for s in self.running}
        plan = super().schedule(now)
        if self.on_plan is not None and plan:
            self.on_plan(plan, before)
        return plan


def make_scheduler(policy="fifo", *, num_pages=1024, page_size=16, max_batch_size=64, prefix_caching=False,
                   **limits):
    """Prefix caching is off by default here: these tests' prompts are all one token repeated, and what
    they count (steps, tokens computed, preemptions) is what the cache would change."""
    from spark.core.page_allocator import PageAllocator

    return WatchedScheduler(PageAllocator(num_pages, page_size), make_policy(policy, Limits(**limits)),
                            max_batch_size=max_batch_size, prefix_caching=prefix_caching)


def make(policy="fifo", *, num_pages=1024, page_size=16, depth=1, **kwargs):
    """A core (one step at a time unless ``depth``) over a double on a fake clock: (core, engine)."""
    clock = FakeClock()
    engine = SimulatedEngine(clock, base=A, per_token=B, num_pages=num_pages, page_size=page_size, vocab_size=1000)
    scheduler = make_scheduler(policy, num_pages=num_pages, page_size=page_size, **kwargs)
    return Core(engine, scheduler, depth=depth, clock=clock), engine


def add(core, request_id, prompt_len, *, max_tokens=8, arrival=0.0, **params):
    core.submit(request_id, [7] * prompt_len, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params), arrival)


def running(core):
    return core.scheduler.running


def drive(core, *, max_steps=10_000, until=None, on_plan=None):
    """Step until the core is idle (or ``until()``). Returns ({id: output ids}, {id: finish reason})."""
    outputs, reasons = {}, {}
    core.scheduler.on_plan = on_plan
    try:
        for _ in range(max_steps):
            if not core.busy or (until is not None and until()):
                return outputs, reasons
            for event in core.step():
                if isinstance(event, TokenBatch):
                    for out in event.outputs:
                        outputs.setdefault(out.seq_id, []).append(out.token_id)
                        if out.finish_reason is not None:
                            reasons[out.seq_id] = out.finish_reason
                elif isinstance(event, Failed):
                    reasons[event.request_id] = event.reason
        raise AssertionError(f"not done after {max_steps} steps")
    finally:
        core.scheduler.on_plan = None


def test_every_policy_is_registered_by_name():
    assert set(POLICIES) == {"fifo", "slai"}
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make_policy("lifo")


# -- decode, prefill, order ------------------------------------------------------


@pytest.mark.parametrize("name", ["fifo", "slai"])
def test_every_running_sequence_decodes_every_step(name):
    core, engine = make(name, max_prefill_tokens=64)
    for i in range(6):
        add(core, f"r{i}", 20 + 13 * i, max_tokens=12 + i, arrival=i)
    steps = []

    def check(plan, running_before):
        decodes = {c.seq_id for c in plan if c.num_tokens == 1 and core.scheduler.seq(c.seq_id) in running(core)}
        assert decodes == running_before
        steps.append(plan)

    outputs, reasons = drive(core, on_plan=check)
    assert {r: len(o) for r, o in outputs.items()} == {f"r{i}": 12 + i for i in range(6)}
    assert set(reasons.values()) == {"length"}
    assert len(steps) > 12  # prefills were spread over steps while others decoded


def test_long_prompt_is_chunked_at_max_prefill_tokens():
    core, engine = make("fifo", max_prefill_tokens=256)
    add(core, "decoder", 10, max_tokens=50)
    drive(core, until=lambda: bool(running(core)))
    add(core, "long", 1000, max_tokens=2)
    chunks = []

    def record(plan, running_before):
        assert [c.seq_id for c in plan][:1] == ["decoder"]  # the stream keeps decoding
        chunks.extend(c.num_tokens for c in plan if c.seq_id == "long" and "long" not in running_before)

    drive(core, on_plan=record, until=lambda: "long" in core.scheduler
          and "long" not in {s.request_id for s in core.scheduler.waiting})
    assert chunks == [256, 256, 256, 232]


def test_prefill_budget_is_shared_in_arrival_order():
    scheduler = make_scheduler("fifo", max_prefill_tokens=512)
    for i, n in enumerate([300, 100, 400, 50]):
        scheduler.add(SeqState(f"p{i}", n, arrival=i, prompt_len=n))
    plan = scheduler.schedule(0.0)
    # p0 and p1 fit whole, p2 gets the rest of the budget, p3 waits behind it
    assert [(c.seq_id, c.num_tokens) for c in plan] == [("p0", 300), ("p1", 100), ("p2", 112)]


@pytest.mark.parametrize("name", ["fifo", "slai"])
def test_prompts_start_and_finish_prefill_in_arrival_order(name):
    rng = random.Random(1)
    core, engine = make(name, max_prefill_tokens=128, max_batch_size=64)
    add(core, "stream", 8, max_tokens=400)  # gives slai deadlines to honour
    for i in range(20):
        add(core, f"p{i:02}", rng.randint(1, 300), max_tokens=3, arrival=1.0 + i)
    first, last, step = {}, {}, [0]

    def record(plan, before):
        step[0] += 1
        prefills = [c for c in plan if c.seq_id not in before]
        for c in prefills:
            if c.seq_id.startswith("p"):
                first.setdefault(c.seq_id, step[0])
                last[c.seq_id] = step[0]
        assert sum(c.num_tokens for c in prefills) <= 128

    drive(core, on_plan=record)
    ids = sorted(first)
    assert [first[i] for i in ids] == sorted(first[i] for i in ids)
    assert [last[i] for i in ids] == sorted(last[i] for i in ids)


# -- pages -----------------------------------------------------------------------


def test_pages_are_claimed_when_prefill_starts():
    scheduler = make_scheduler("fifo", max_prefill_tokens=40, page_size=16)
    scheduler.add(SeqState("a", 100, 0.0, prompt_len=100))
    scheduler.add(SeqState("b", 10, 0.0, prompt_len=10))
    assert scheduler.allocator.num_used == 0  # admitted is not started
    plan = scheduler.schedule(0.0)
    assert [(c.seq_id, c.num_tokens, len(c.block_table)) for c in plan] == [("a", 40, 3)]
    assert scheduler.allocator.has("a") and not scheduler.allocator.has("b")
    assert scheduler.allocator.num_used == 3


def _gone(core, request_id):
    return lambda: request_id not in core.scheduler


@pytest.mark.parametrize("path", ["length", "stop_token", "cancel_running", "cancel_mid_prefill", "cancel_queued",
                                  "cancel_preempted"])
def test_pages_are_released_on_every_path(path):
    core, engine = make("fifo", max_prefill_tokens=8 if path == "cancel_mid_prefill" else 512,
                        num_pages=1 + 12, page_size=4)
    a_params = {"stop_token_ids": (engine.token_fn("a", 5),)} if path == "stop_token" else {}
    _preemption_workload(core, **a_params)
    allocator = core.scheduler.allocator
    preempted = []
    until = {
        "length": lambda: engine.steps > 0 and "a" not in core.scheduler,
        "stop_token": lambda: engine.steps > 0 and "a" not in core.scheduler,
        "cancel_running": lambda: len(running(core)) == 3,
        "cancel_mid_prefill": lambda: allocator.has("c"),
        "cancel_queued": lambda: True,
        "cancel_preempted": lambda: bool(preempted),
    }[path]
    _, reasons = drive(core, until=until, on_plan=lambda plan, before: preempted.extend(core.scheduler.preempted))
    if path in ("length", "stop_token"):
        assert reasons == {"a": "length" if path == "length" else "stop"}
        assert not allocator.has("a")
    else:
        victim = "a" if path == "cancel_running" else "c"
        core.cancel(victim)  # the client left
        assert not allocator.has(victim) and victim not in core.scheduler
        core.cancel(victim)  # twice is harmless
    held = sum(len(allocator.block_table(r)) for r in "abc" if allocator.has(r))
    assert allocator.num_used == held  # nothing held by a request that is gone
    drive(core)  # the rest runs to its end
    assert allocator.num_used == 0
    assert engine.sequences == {}  # the engine forgot every one of them


# -- preemption ------------------------------------------------------------------


def _preemption_workload(core, **a_params):
    add(core, "a", 4, max_tokens=4, arrival=0.0, **a_params)
    add(core, "b", 8, max_tokens=20, arrival=1.0)
    add(core, "c", 8, max_tokens=20, arrival=2.0)


def _four_growing(num_pages):
    core, engine = make("fifo", max_prefill_tokens=512, num_pages=num_pages, page_size=4)
    for i, name in enumerate("abcd"):
        add(core, name, 8, max_tokens=20, arrival=float(i))
    return core, engine


def test_newest_running_sequence_is_preempted_and_recomputed():
    reference, _ = drive(_four_growing(num_pages=1024)[0])
    core, engine = _four_growing(num_pages=1 + 16)  # 64 token slots; together they grow to 112
    preempted = []

    def record(plan, running_before):
        if core.scheduler.preempted:
            preempted.append((tuple(core.scheduler.preempted), running_before))

    outputs, reasons = drive(core, on_plan=record)
    assert preempted, "the pool was meant to run out"
    # a, the oldest, asks first: of b, c, d the newest goes
    assert preempted[0] == (("d",), {"a", "b", "c", "d"})
    assert outputs == reference and set(reasons.values()) == {"length"}
    assert sum(engine.step_tokens) > 4 * (8 + 20 - 1)  # preempted tokens were computed twice
    allocator = core.scheduler.allocator
    assert allocator.num_used == 0 and allocator.peak_used == 16


def test_a_sequence_that_outgrows_the_pool_preempts_itself():
    core, engine = make("fifo", num_pages=1 + 2, page_size=4)  # 8 token slots
    add(core, "a", 4, max_tokens=100)
    scheduler = core.scheduler
    drive(core, until=lambda: running(core) and running(core)[0].num_tokens == 9)
    plan = scheduler.schedule(1.0)
    assert scheduler.preempted == ["a"] and scheduler.allocator.num_used == 2
    # what is left of its recompute fits no more: it takes what the pool holds
    assert [(c.seq_id, c.num_tokens) for c in plan] == [("a", 8)]


def test_a_sequence_that_fills_the_whole_pool_ends_with_length():
    core, engine = make("fifo", num_pages=1 + 2, page_size=4)  # 8 token slots
    add(core, "a", 4, max_tokens=100)
    outputs, reasons = drive(core)
    assert reasons == {"a": "length"} and len(outputs["a"]) == 5  # 4 + 4 fill the pool; the 5th is sampled from it
    assert core.scheduler.allocator.num_used == 0 and engine.sequences == {}


def test_a_prompt_the_pool_can_never_hold_fails_alone():
    core, engine = make("fifo", num_pages=1 + 2, page_size=4)
    add(core, "huge", 9, max_tokens=1)
    add(core, "small", 3, max_tokens=2, arrival=1.0)
    outputs, reasons = drive(core)
    assert reasons == {"huge": "error", "small": "length"} and len(outputs["small"]) == 2


# -- slai ------------------------------------------------------------------------


def _budget_at(now, *, policy="slai", observed=True, decoders=1, tbt=None):
    scheduler = make_scheduler(policy, max_prefill_tokens=2048, tbt_deadline=0.1)
    if observed:
        for rows, tokens in ((1, 8), (4, 200), (2, 1000), (8, 0), (1, 500)):
            scheduler.policy.observe_step(rows, tokens, A + R * rows + B * tokens)
    for i in range(decoders):
        seq = SeqState(f"d{i}", 10, arrival=0.0, num_computed=9, last_token_time=0.0 + 0.01 * i,
                       tbt=tbt if i == 0 else None)
        scheduler.add(seq)
        scheduler.allocator.allocate(seq.request_id, 9)
        scheduler.waiting.remove(seq)
        scheduler.running.append(seq)
    scheduler.add(SeqState("long", 4000, arrival=0.0))
    plan = scheduler.schedule(now)
    return sum(c.num_tokens for c in plan if c.seq_id == "long")


def test_slai_budget_shrinks_as_the_tightest_deadline_approaches():
    budgets = [_budget_at(now) for now in (0.0, 0.02, 0.05, 0.08, 0.099)]
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == len(budgets)
    # the step must end by 90% of the slack: A + R * 1 decode + B * chunk <= 0.9 * 0.1
    assert budgets[0] == pytest.approx((0.09 - A - R) / B, abs=1)
    assert budgets[1] == pytest.approx((0.9 * 0.08 - A - R) / B, abs=1)
    assert budgets[-1] == 16  # the floor: a prompt always moves
    # the tightest deadline rules: a second stream 10 ms behind does not widen it, its row costs R
    assert _budget_at(0.02, decoders=2) == pytest.approx(_budget_at(0.02) - R / B, abs=1)


def test_a_requests_own_tbt_target_sets_its_deadline():
    assert _budget_at(0.0, tbt=0.05) == pytest.approx((0.9 * 0.05 - A - R) / B, abs=2)
    assert _budget_at(0.0, tbt=0.05, decoders=2) < _budget_at(0.0, decoders=2)


def test_a_submitted_tbt_target_reaches_the_policy():
    core, _ = make("slai", tbt_deadline=0.2)
    core.submit("tight", [7] * 4, SamplingParams(temperature=0.0, max_tokens=8), 0.0, tbt=0.05)
    add(core, "plain", 4)
    core.step()
    seqs = {s.request_id: s for s in running(core)}
    policy = core.scheduler.policy
    assert policy.deadline(seqs["tight"]) == pytest.approx(seqs["tight"].last_token_time + 0.05)
    assert policy.deadline(seqs["plain"]) == pytest.approx(seqs["plain"].last_token_time + 0.2)
    assert policy.decode_order(list(seqs.values()))[0].request_id == "tight"


def test_slai_uses_the_full_budget_until_the_cost_model_has_data():
    assert _budget_at(0.099, observed=False) == 2048
    assert _budget_at(0.099, policy="fifo") == 2048


# -- the step time model ---------------------------------------------------------


def test_step_time_model_recovers_base_and_slopes():
    model = StepTimeModel()
    for rows, tokens in ((1, 0), (8, 64), (64, 512), (2, 2048), (16, 16), (32, 0)):
        model.observe(rows, tokens, 0.007 + 0.0002 * rows + 0.0003 * tokens)
    fit = model.fit()
    assert fit.base == pytest.approx(0.007, rel=0.01)
    assert fit.per_row == pytest.approx(0.0002, rel=0.01) and fit.per_token == pytest.approx(0.0003, rel=0.01)
    assert fit.tokens_within(0.007 + 0.0002 * 10 + 0.0003 * 100, 10) == pytest.approx(100, abs=1)


def test_step_time_model_fits_noisy_steps_and_follows_the_recent_window():
    rng = random.Random(0)
    model = StepTimeModel(window=64)
    for _ in range(200):  # an old regime, then the window fills with a new one
        model.observe(rng.randint(0, 64), rng.randint(0, 2000), 0.05 + 0.001 * rng.random())
    for _ in range(64):
        rows, tokens = rng.randint(0, 64), rng.randint(0, 2000)
        model.observe(rows, tokens, (A + R * rows + B * tokens) * rng.uniform(0.97, 1.03))
    fit = model.fit()
    assert fit.per_token == pytest.approx(B, rel=0.05) and fit.per_row == pytest.approx(R, rel=0.25)
    assert fit.seconds(32, 1000) == pytest.approx(A + R * 32 + B * 1000, rel=0.03)


def test_step_time_model_says_nothing_until_the_data_can_tell():
    model = StepTimeModel()
    assert model.fit() is None
    for _ in range(4):
        model.observe(8, 0, 0.01)  # the same step again and again: no slope to learn
    assert model.fit() is None
    model = StepTimeModel()
    for rows in (1, 2, 3, 4, 5):
        model.observe(rows, 0, 0.01 + 0.001 * rows)  # decodes alone: a prompt token is priced as a row
    fit = model.fit()
    assert fit.per_row == pytest.approx(0.001) and fit.per_token == pytest.approx(0.001)
    assert fit.base == pytest.approx(0.01)
    model.observe(1, 100, 0.011 + 0.0001 * 100)  # then prompts teach their own price
    model.observe(2, 300, 0.012 + 0.0001 * 300)
    assert model.fit().per_token == pytest.approx(0.0001, rel=1e-3)


def test_the_overrun_of_steps_with_prompts_is_kept_back_from_slai_budgets():
    """Steps with prompt tokens that keep taking 10 ms longer than the line says (padding to a graph
    bucket, the host): the model reports that overrun, and SLAI's budget leaves room for it."""
    from spark.core.policies.slai import prefill_within

    model = StepTimeModel()
    for rows, tokens in ((1, 0), (8, 0), (64, 0), (16, 0)) * 4:  # decodes alone: the line's own steps
        model.observe(rows, tokens, 0.007 + 0.0002 * rows)
    assert model.overrun() == 0.0  # nothing with prompt tokens yet
    for tokens in (64, 512, 256, 1024, 128) * 8:
        model.observe(8, tokens, 0.007 + 0.0002 * 8 + 0.0003 * tokens + 0.010)
    overrun = model.overrun()
    assert 0.005 < overrun < 0.020
    fit = model.fit()
    plain = prefill_within(fit, 0.1, 8, 8192, 16)
    hedged = prefill_within(fit, 0.1, 8, 8192, 16, overrun)
    assert hedged == pytest.approx(plain - overrun / fit.per_token, abs=2) and hedged < plain
    assert fit.seconds(8, hedged) + overrun <= 0.9 * 0.1 + 1e-9


# -- pipelined planning ------------------------------------------------------------

@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("policy_name", ["fifo", "slai"])
def test_planning_a_step_ahead_finishes_every_request_with_its_tokens(policy_name, depth):
    """Plan step N+1 before N's result is accounted (as the host does), on a pool small
    enough to preempt: the double checks every plan's pages, and the tokens come out as
    if each request ran alone."""
    from tests.actors.engine_double import hashed_token

    rng = random.Random(3)
    core, engine = make(policy_name, num_pages=64, page_size=4, max_batch_size=8, max_prefill_tokens=32, depth=depth)
    specs = {f"r{i}": (rng.randint(1, 40), rng.randint(1, 20)) for i in range(30)}
    for rid, (n, m) in specs.items():
        add(core, rid, n, max_tokens=m)
    preempted = []
    outputs, reasons = drive(core, on_plan=lambda plan, before: preempted.extend(core.scheduler.preempted))
    assert preempted  # the pool was small enough to exercise recompute under pipelining
    assert core.scheduler.allocator.num_used == 0 and engine.sequences == {}
    assert outputs == {rid: [hashed_token(rid, n + k, 1000) for k in range(m)] for rid, (n, m) in specs.items()}
