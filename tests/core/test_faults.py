"""Faults on purpose (``spark.core.faults``): a chosen step raises, a chosen request fails; the rest finish."""

from __future__ import annotations

import pytest

from spark.core.core import Core
from spark.core.events import Failed, TokenBatch
from spark.core.faults import Faults
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler
from spark.engine.sampling import SamplingParams
from tests.actors.engine_double import EngineDouble


def run(faults: Faults, num_requests: int = 6):
    engine = EngineDouble(num_pages=256, page_size=4)
    scheduler = Scheduler(engine.new_page_allocator(), make_policy("fifo", Limits(max_prefill_tokens=16)),
                          max_batch_size=4)
    core = Core(engine, scheduler, faults=faults)
    for i in range(num_requests):
        core.submit(f"r{i}", [1] * (3 + i), SamplingParams(temperature=0.0, max_tokens=5))
    tokens, ends = {}, {}
    while core.busy:
        for event in core.step():
            if isinstance(event, TokenBatch):
                for out in event.outputs:
                    tokens[out.seq_id] = tokens.get(out.seq_id, 0) + 1
                    if out.finish_reason is not None:
                        ends[out.seq_id] = out.finish_reason
            elif isinstance(event, Failed):
                ends[event.request_id] = ("error", event.error)
    assert scheduler.allocator.num_used == 0 and engine.sequences == {}  # nothing left behind
    return tokens, ends


def test_no_faults_by_default():
    tokens, ends = run(Faults())
    assert set(ends.values()) == {"length"} and set(tokens.values()) == {5}


def test_every_nth_request_fails_alone():
    tokens, ends = run(Faults(every_nth_request=3))
    failed = sorted(r for r, e in ends.items() if e != "length")
    assert failed == ["r2", "r5"]
    assert all("told to fail" in ends[r][1] for r in failed)
    assert all(tokens[r] == 5 for r in ends if r not in failed)  # the others finish whole


def test_a_chosen_step_fails_the_requests_in_it_and_the_next_steps_run():
    tokens, ends = run(Faults(steps=frozenset({2})))
    failed = sorted(r for r, e in ends.items() if e != "length")
    assert failed and len(failed) < 6
    assert all("step 2 was told to fail" in ends[r][1] for r in failed)
    assert all(tokens[r] == 5 for r in ends if r not in failed)


@pytest.mark.parametrize("spec, faults", [("", Faults()), ("step=3,7", Faults(frozenset({3, 7}))),
                                          ("request=5", Faults(every_nth_request=5)),
                                          (" step=1 ; request=2 ", Faults(frozenset({1}), 2))])
def test_the_spec_reads(spec, faults):
    assert Faults.parse(spec) == faults


@pytest.mark.parametrize("spec", ["step", "step=x", "request=1,2", "disk=1", "step=0"])
def test_a_bad_spec_is_one_clear_error(spec):
    with pytest.raises(ValueError, match="faults: "):
        Faults.parse(spec)
