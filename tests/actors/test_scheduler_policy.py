"""SchedulerPolicy and StepCostModel as pure objects: no trio, no model.

``drive`` plays the scheduler actor's part (schedule, reset the preempted,
step the engine double, account) so every plan is checked by the double the
way the real engine would check it.
"""

from __future__ import annotations

import random

import pytest

from spark.actors.scheduler_policy import SchedulerPolicy, SeqState, StepCostModel
from spark.engine.engine import ScheduledChunk, StepPlan
from spark.engine.sampling import SamplingParams
from tests.actors.engine_double import EngineDouble

A, B = 0.005, 0.00025  # step seconds = A + B * tokens


def make(policy="fifo", *, num_pages=1024, page_size=16, **kwargs):
    engine = EngineDouble(num_pages=num_pages, page_size=page_size, vocab_size=1000)
    return SchedulerPolicy(engine.new_page_allocator(), policy=policy, **kwargs), engine


def add(policy, engine, request_id, prompt_len, *, max_tokens=8, arrival=0.0, **params):
    engine.add_sequence(request_id, [7] * prompt_len, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))
    seq = SeqState(request_id, prompt_len, arrival)
    policy.add(seq)
    return seq


def drive(policy, engine, *, now=0.0, max_steps=10_000, until=None, on_plan=None):
    """Step until nothing is active (or ``until()``). Returns ({id: output ids}, {id: finish reason}, now)."""
    outputs, reasons = {}, {}
    for _ in range(max_steps):
        if not policy.num_active or (until is not None and until()):
            return outputs, reasons, now
        running_before = set(s.request_id for s in policy.running)
        planned = policy.schedule(now)
        assert planned, f"the policy planned nothing with {policy.num_active} active sequences"
        for request_id in policy.preempted:
            engine.reset_computed(request_id)
        if on_plan is not None:
            on_plan(planned, running_before)
        step = engine.step(as_plan(planned))
        now = account(policy, planned, step, now, outputs, reasons)
    raise AssertionError(f"not done after {max_steps} steps")


def as_plan(planned) -> StepPlan:
    return StepPlan(tuple(ScheduledChunk(p.seq.request_id, p.num_tokens, p.block_table) for p in planned))


def account(policy, planned, step, now, outputs, reasons) -> float:
    """Account a step's result as the actor does (its time from the cost model A + B * tokens):
    collect its tokens into ``outputs``, its ends into ``reasons``; returns the new time."""
    seconds = A + B * sum(p.num_tokens for p in planned)
    now += seconds
    policy.on_step_done(planned, (o.seq_id for o in step), now, seconds)
    for out in step:
        outputs.setdefault(out.seq_id, []).append(out.token_id)
        if out.finish_reason is not None:
            reasons[out.seq_id] = out.finish_reason
            assert policy.finish(out.seq_id)
    return now


# -- decode, prefill, order ------------------------------------------------------


@pytest.mark.parametrize("name", ["fifo", "slai"])
def test_every_running_sequence_decodes_every_step(name):
    policy, engine = make(name, max_prefill_tokens=64)
    for i in range(6):
        add(policy, engine, f"r{i}", 20 + 13 * i, max_tokens=12 + i, arrival=i)
    steps = []

    def check(planned, running_before):
        decodes = {p.seq.request_id for p in planned if p.num_tokens == 1 and p.seq in policy.running}
        assert decodes == running_before
        steps.append(planned)

    outputs, reasons, _ = drive(policy, engine, on_plan=check)
    assert {r: len(o) for r, o in outputs.items()} == {f"r{i}": 12 + i for i in range(6)}
    assert set(reasons.values()) == {"length"}
    assert len(steps) > 12  # prefills were spread over steps while others decoded


def test_long_prompt_is_chunked_at_max_prefill_tokens():
    policy, engine = make("fifo", max_prefill_tokens=256)
    add(policy, engine, "decoder", 10, max_tokens=50)
    drive(policy, engine, until=lambda: bool(policy.running))
    add(policy, engine, "long", 1000, max_tokens=2)
    chunks = []

    def record(planned, running_before):
        assert [p.seq.request_id for p in planned][:1] == ["decoder"]  # the stream keeps decoding
        chunks.extend(p.num_tokens for p in planned if p.seq.request_id == "long" and "long" not in running_before)

    drive(policy, engine, on_plan=record, until=lambda: "long" not in {s.request_id for s in policy.waiting})
    assert chunks == [256, 256, 256, 232]


def test_prefill_budget_is_shared_in_arrival_order():
    policy, engine = make("fifo", max_prefill_tokens=512)
    for i, n in enumerate([300, 100, 400, 50]):
        add(policy, engine, f"p{i}", n, max_tokens=1, arrival=i)
    plan = policy.schedule(0.0)
    # p0 and p1 fit whole, p2 gets the rest of the budget, p3 waits behind it
    assert [(p.seq.request_id, p.num_tokens) for p in plan] == [("p0", 300), ("p1", 100), ("p2", 112)]


@pytest.mark.parametrize("name", ["fifo", "slai"])
def test_prompts_start_and_finish_prefill_in_arrival_order(name):
    rng = random.Random(1)
    policy, engine = make(name, max_prefill_tokens=128, max_batch_size=64)
    add(policy, engine, "stream", 8, max_tokens=400)  # gives slai deadlines to honour
    for i in range(20):
        add(policy, engine, f"p{i:02}", rng.randint(1, 300), max_tokens=3, arrival=1.0 + i)
    first, last, step = {}, {}, [0]

    def record(planned, _):
        step[0] += 1
        for p in planned:
            if p.seq.request_id.startswith("p") and p.seq not in policy.running:
                first.setdefault(p.seq.request_id, step[0])
                last[p.seq.request_id] = step[0]
        assert sum(p.num_tokens for p in planned if p.seq not in policy.running) <= 128

    drive(policy, engine, on_plan=record)
    ids = sorted(first)
    assert [first[i] for i in ids] == sorted(first[i] for i in ids)
    assert [last[i] for i in ids] == sorted(last[i] for i in ids)


# -- pages -----------------------------------------------------------------------


def test_pages_are_claimed_when_prefill_starts():
    policy, engine = make("fifo", max_prefill_tokens=40, page_size=16)
    add(policy, engine, "a", 100)
    add(policy, engine, "b", 10)
    assert policy.allocator.num_used == 0  # admitted is not started
    plan = policy.schedule(0.0)
    assert [(p.seq.request_id, p.num_tokens, len(p.block_table)) for p in plan] == [("a", 40, 3)]
    assert policy.allocator.has("a") and not policy.allocator.has("b")
    assert policy.allocator.num_used == 3


def _until_gone(policy, request_id):
    return lambda: all(s.request_id != request_id for s in policy.running + list(policy.waiting))


@pytest.mark.parametrize("path", ["length", "stop_token", "cancel_running", "cancel_mid_prefill", "cancel_queued", "cancel_preempted"])
def test_pages_are_released_on_every_path(path):
    policy, engine = _preemption_workload(num_pages=1 + 12)
    if path == "stop_token":
        engine.sequences["a"].params = SamplingParams(max_tokens=4, stop_token_ids=(engine.token_fn("a", 5),))
    if path == "cancel_mid_prefill":
        policy.max_prefill_tokens = 8
    preempted = []
    until = {
        "length": _until_gone(policy, "a"),
        "stop_token": _until_gone(policy, "a"),
        "cancel_running": lambda: len(policy.running) == 3,
        "cancel_mid_prefill": lambda: policy.allocator.has("c"),
        "cancel_queued": lambda: True,
        "cancel_preempted": lambda: bool(preempted),
    }[path]
    _, reasons, _ = drive(policy, engine, until=until, on_plan=lambda *_: preempted.extend(policy.preempted))
    if path in ("length", "stop_token"):
        assert reasons == {"a": "length" if path == "length" else "stop"}
        assert not policy.allocator.has("a")
    else:
        victim = "a" if path == "cancel_running" else "c"
        assert policy.finish(victim)  # the actor's cancel
        assert not policy.allocator.has(victim)
        engine.remove_sequence(victim)
        assert not policy.finish(victim)
    held = sum(len(policy.allocator.block_table(r)) for r in "abc" if policy.allocator.has(r))
    assert policy.allocator.num_used == held  # nothing held by a request that is gone
    drive(policy, engine)  # the rest runs to its end
    assert policy.allocator.num_used == 0


# -- preemption ------------------------------------------------------------------


def _preemption_workload(num_pages):
    policy, engine = make("fifo", max_prefill_tokens=512, num_pages=num_pages, page_size=4)
    add(policy, engine, "a", 4, max_tokens=4, arrival=0.0)
    add(policy, engine, "b", 8, max_tokens=20, arrival=1.0)
    add(policy, engine, "c", 8, max_tokens=20, arrival=2.0)
    return policy, engine


def _four_growing(num_pages):
    policy, engine = make("fifo", max_prefill_tokens=512, num_pages=num_pages, page_size=4)
    for i, name in enumerate("abcd"):
        add(policy, engine, name, 8, max_tokens=20, arrival=float(i))
    return policy, engine


def test_newest_running_sequence_is_preempted_and_recomputed():
    reference, _, _ = drive(*_four_growing(num_pages=1024))
    policy, engine = _four_growing(num_pages=1 + 16)  # 64 token slots; together they grow to 112
    preempted = []

    def record(planned, running_before):
        if policy.preempted:
            preempted.append((tuple(policy.preempted), running_before))

    outputs, reasons, _ = drive(policy, engine, on_plan=record)
    assert preempted, "the pool was meant to run out"
    # a, the oldest, asks first: of b, c, d the newest goes
    assert preempted[0] == (("d",), {"a", "b", "c", "d"})
    assert outputs == reference and set(reasons.values()) == {"length"}
    assert sum(engine.step_tokens) > 4 * (8 + 20 - 1)  # preempted tokens were computed twice
    assert policy.allocator.num_used == 0 and policy.allocator.peak_used == 16


def test_a_sequence_that_outgrows_the_pool_preempts_itself():
    policy, engine = make("fifo", num_pages=1 + 2, page_size=4)  # 8 token slots
    add(policy, engine, "a", 4, max_tokens=100)
    drive(policy, engine, until=lambda: policy.running and policy.running[0].num_tokens == 9)
    plan = policy.schedule(1.0)
    assert policy.preempted == ["a"] and policy.allocator.num_used == 2
    # what is left of its recompute fits no more: it takes what the pool holds
    assert [(p.seq.request_id, p.num_tokens) for p in plan] == [("a", 8)]


# -- slai ------------------------------------------------------------------------


def _budget_at(now, *, policy="slai", observed=True, decoders=1):
    p, engine = make(policy, max_prefill_tokens=2048, tbt_deadline=0.1)
    if observed:
        for tokens in (8, 200, 1000):
            p.cost.observe(tokens, A + B * tokens)
    for i in range(decoders):
        seq = SeqState(f"d{i}", 10, arrival=0.0, num_computed=9, last_token_time=0.0 + 0.01 * i)
        p.allocator.allocate(seq.request_id, 9)
        p.running.append(seq)
    p.add(SeqState("long", 4000, arrival=0.0))
    plan = p.schedule(now)
    return sum(x.num_tokens for x in plan if x.seq.request_id == "long")


def test_slai_budget_shrinks_as_the_tightest_deadline_approaches():
    budgets = [_budget_at(now) for now in (0.0, 0.02, 0.05, 0.08, 0.099)]
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == len(budgets)
    # the step must end by 90% of the slack: A + B * (1 decode + chunk) <= 0.9 * 0.1
    assert abs(budgets[0] - ((0.09 - A) / B - 1)) <= 1
    assert budgets[1] == pytest.approx((0.9 * 0.08 - A) / B - 1, abs=1)
    assert budgets[-1] == 16  # the floor: a prompt always moves
    # the tightest deadline rules: a second stream 10 ms behind does not widen it
    assert _budget_at(0.02, decoders=2) == _budget_at(0.02) - 1


def test_slai_uses_the_full_budget_until_the_cost_model_has_data():
    assert _budget_at(0.099, observed=False) == 2048
    assert _budget_at(0.099, policy="fifo") == 2048


# -- the cost model --------------------------------------------------------------


def test_cost_model_recovers_a_and_b():
    model = StepCostModel()
    for tokens in (1, 8, 64, 512, 2048, 16):
        model.observe(tokens, 0.007 + 0.0003 * tokens)
    a, b = model.fit()
    assert a == pytest.approx(0.007, rel=1e-9) and b == pytest.approx(0.0003, rel=1e-9)
    assert model.tokens_within(0.007 + 0.0003 * 100) == pytest.approx(100, abs=1)


def test_cost_model_fits_noisy_steps_and_follows_the_recent_window():
    rng = random.Random(0)
    model = StepCostModel(window=64)
    for _ in range(200):  # an old regime, then the window fills with a new one
        tokens = rng.randint(1, 2000)
        model.observe(tokens, 0.05 + 0.001 * tokens)
    for _ in range(64):
        tokens = rng.randint(1, 2000)
        model.observe(tokens, (A + B * tokens) * rng.uniform(0.97, 1.03))
    a, b = model.fit()
    assert b == pytest.approx(B, rel=0.05) and a == pytest.approx(A, abs=0.01)


def test_cost_model_says_nothing_until_the_data_can_tell():
    model = StepCostModel()
    assert model.fit() is None and model.tokens_within(1.0) is None
    model.observe(8, 0.01)
    assert model.fit() is None
    model.observe(8, 0.02)  # same token count twice: b is unknown
    assert model.fit() is None
    model.observe(100, 0.001)  # more tokens, less time: no positive slope
    assert model.fit() is None


# -- pipelined planning ------------------------------------------------------------

@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("policy_name", ["fifo", "slai"])
def test_planning_a_step_ahead_finishes_every_request_with_its_tokens(policy_name, depth):
    """Plan step N+1 before N's result is accounted (as the actor does), on a pool small
    enough to preempt: the double checks every plan's pages, and the tokens come out as
    if each request ran alone."""
    from collections import deque

    from tests.actors.engine_double import hashed_token

    rng = random.Random(3)
    policy, engine = make(policy_name, num_pages=64, page_size=4, max_batch_size=8, max_prefill_tokens=32)
    specs = {f"r{i}": (rng.randint(1, 40), rng.randint(1, 20)) for i in range(30)}
    queue = deque(specs.items())
    outputs, inflight, now, preempted = {}, deque(), 0.0, 0
    for _ in range(5000):
        while queue and policy.has_room():  # admitted as the actor admits: while the batch has room
            rid, (n, m) = queue.popleft()
            add(policy, engine, rid, n, max_tokens=m, arrival=now)
        if not (policy.num_active or inflight):
            break
        if len(inflight) < depth:
            planned = policy.schedule(now)
            preempted += len(policy.preempted)
            for request_id in policy.preempted:
                engine.reset_computed(request_id)
            if planned:
                inflight.append((planned, engine.step(as_plan(planned))))
                if len(inflight) < depth:
                    continue
        planned, step = inflight.popleft()
        now = account(policy, planned, step, now, outputs, {})
    assert preempted > 0  # the pool was small enough to exercise recompute under pipelining
    assert policy.allocator.num_used == 0
    assert outputs == {rid: [hashed_token(rid, n + k, 1000) for k in range(m)] for rid, (n, m) in specs.items()}
