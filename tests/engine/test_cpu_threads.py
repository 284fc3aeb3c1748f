"""The CPU engine's torch threads follow the cores other processes leave idle."""

import os
import threading

import pytest
import torch

from spark.engine.device import IdleCoreThreads, _busy_ticks, _own_ticks


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Machine:
    """Two cores' tick counters, advanced by hand: ``run(seconds, ours, others)`` in cores."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self):
        self.now, self.busy, self.own = 0.0, 0, 0

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.now += seconds
        self.own += round(ours * seconds * self.HZ)
        self.busy += round((ours + others) * seconds * self.HZ)


def threads_for(machine: Machine, **kwargs) -> IdleCoreThreads:
    return IdleCoreThreads(frozenset({0, 1}), busy_ticks=lambda cores: machine.busy, own_ticks=lambda: machine.own,
                           clock=lambda: machine.now, **kwargs)


def test_an_idle_machine_gets_every_core_after_a_settling_time_and_a_busy_core_is_left_at_once():
    before = torch.get_num_threads()
    try:
        m = Machine()
        t = threads_for(m, period_s=0.25, settle=3)
        assert t.threads == 1  # the usable cores less one, to start with
        seen = []
        for _ in range(4):
            m.run(0.3, ours=1.0, others=0.05)
            seen.append(t.adjust())
        assert seen == [1, 1, 2, 2]  # three quiet looks in a row, then both cores
        assert torch.get_num_threads() == 2
        m.run(0.3, ours=1.2, others=0.9)  # another process spins on a core
        assert t.adjust() == 1
        assert torch.get_num_threads() == 1
        m.run(0.3, ours=1.0, others=0.5)  # half a core is still too much to share a thread with
        assert t.adjust() == 1
        m.run(0.1, ours=1.0, others=0.0)  # looks come at most once a period
        assert t.adjust() == 1
    finally:
        torch.set_num_threads(before)


def test_what_others_did_while_the_engine_was_idle_does_not_count(restore_threads):
    m = Machine()
    t = threads_for(m, period_s=0.25, settle=1)
    m.run(0.3, ours=1.0, others=0.0)
    assert t.adjust() == 2
    m.run(5.0, ours=0.0, others=2.0)  # another server ran while this one waited for requests
    assert t.adjust() == 2  # a new count starts
    m.run(0.3, ours=2.0, others=0.0)
    assert t.adjust() == 2


def test_a_quiet_look_between_busy_ones_does_not_add_a_thread():
    m = Machine()
    t = threads_for(m, period_s=0.25, settle=2)
    for others in (0.0, 1.0, 0.0, 1.0, 0.0):
        m.run(0.3, ours=1.0, others=others)
        assert t.adjust() == 1


def test_the_readings_of_this_machine_move_as_this_process_computes():
    cores = frozenset(os.sched_getaffinity(0))
    busy, own = _busy_ticks(cores), _own_ticks()
    x = torch.randn(256, 256)
    deadline = own + Machine.HZ // 5  # 0.2 s of this process's time
    while _own_ticks() < deadline:
        x = (x @ x).tanh()
    assert _own_ticks() > own
    assert _busy_ticks(cores) - busy >= _own_ticks() - own - 2  # what we ran, the machine ran


def test_the_count_is_set_in_the_thread_that_adjusts():
    """torch's OpenMP threads are a setting of the thread that runs the ops (the engine's)."""
    before = torch.get_num_threads()
    m = Machine()
    t = threads_for(m, period_s=0.5, settle=1)
    seen = []

    def engine_thread():
        m.run(1.0, ours=1.0, others=0.0)
        t.adjust()
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=engine_thread)
    worker.start()
    worker.join()
    try:
        assert seen == [2]
    finally:
        torch.set_num_threads(before)
