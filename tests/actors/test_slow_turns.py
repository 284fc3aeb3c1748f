"""The core loop's slow-turn diagnostics (``slow_turn_ms``): a turn past the threshold is one log line
saying where its time went and which steps it collected; a quick turn says nothing."""

import logging
import re
import time

import pytest

from spark.actors.host import SlowTurns
from spark.core.events import StepShape


@pytest.fixture(autouse=True)
def no_compile_hook_left():
    """SlowTurns logs Triton's compiles from its start on: take the hook away after each test."""
    yield
    from triton import knobs

    knobs.runtime.jit_cache_hook = None


def test_a_slow_turn_is_logged_with_its_laps_and_steps(caplog):
    turns = SlowTurns(0.002)
    timer = turns.start()
    timer.lap("take")
    time.sleep(0.005)
    timer.lap("step")
    with caplog.at_level(logging.WARNING, logger="spark.host"):
        turns.check(timer, (StepShape(0.0123, 64, 128),))
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("slow turn ")
    assert float(re.search(r"step (\d+\.\d)", line)[1]) >= 5.0  # the lap that slept
    assert "[12.3 ms: 64 rows + 128 tok]" in line and "gc +" in line


def test_a_quick_turn_says_nothing(caplog):
    turns = SlowTurns(10.0)
    timer = turns.start()
    timer.lap("step")
    with caplog.at_level(logging.WARNING, logger="spark.host"):
        turns.check(timer, ())
    assert not caplog.records
