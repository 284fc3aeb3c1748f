"""The GPU-runner actor: drives the synchronous engine off the event loop.

The engine steps in a thread of its own (``run_in_thread``), so HTTP, SSE and
detokenization keep going while the GPU (or the CPU) computes, and the next
step never waits for a turn of a busy event loop. Only that thread touches the
engine, so the engine needs no locks. ``run`` drives an async executor instead
(simulations on a mock clock).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import deque
from typing import Awaitable, Callable

import trio

from spark.actors.channels import take_waiting
from spark.actors.messages import StepResult, StepWork
from spark.engine.engine import TokenOutput

log = logging.getLogger("spark.gpu_runner")

Executor = Callable[[StepWork], Awaitable[list[TokenOutput]]]

_SWITCH_INTERVAL = 0.0005  # seconds


def apply_work(engine, work: StepWork) -> list[TokenOutput]:
    """Forget ended sequences, reset preempted ones, register new ones, then step."""
    _register(engine, work)
    return engine.step(work.plan)


def register_work(engine, work: StepWork) -> None:
    """``apply_work`` that launches the step without waiting for it (collect it with ``engine.collect``)."""
    _register(engine, work)
    engine.launch(work.plan)


def _register(engine, work: StepWork) -> None:
    for seq_id in work.removed:
        engine.remove_sequence(seq_id)
    for seq_id in work.reset:
        engine.reset_computed(seq_id)
    for seq_id, prompt_ids, params in work.added:
        engine.add_sequence(seq_id, prompt_ids, params)


async def run_in_thread(
    engine,
    inbox: trio.MemoryReceiveChannel,
    outbox: trio.MemorySendChannel,
    *,
    capture_next: Callable[[], bool] | None = None,
    on_captured: Callable[[int, int], None] | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Step ``engine`` in a thread of its own: each ``StepWork`` from ``inbox`` is queued for
    it at once, and each ``StepResult`` is put straight into ``outbox``, whose buffer must
    hold every step the scheduler keeps in flight.

    A step that raises fails only the sequences in it. ``capture_next`` (CUDA-graph
    capture, one bucket per call) runs in the thread whenever no step is waiting; after
    each call, ``on_captured(captured, planned)`` runs on the event loop with the engine's
    ``graph_progress()`` (``graph_gauges`` sets the metrics).
    """
    # The event loop holds the interpreter lock most of the time at hundreds of streams;
    # by default another thread gets it only every 5 ms, which the engine thread would
    # pay a few times per step. A shorter interval hands it over within a millisecond.
    sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL))
    works: queue.SimpleQueue = queue.SimpleQueue()
    thread = threading.Thread(
        target=_step_loop, args=(engine, works, trio.lowlevel.current_trio_token(), outbox, capture_next, on_captured),
        name="spark-engine", daemon=True,
    )
    thread.start()
    try:
        async with inbox:
            task_status.started()
            await hand_over(inbox, works)
    finally:
        works.put(None)
        with trio.CancelScope(shield=True):  # the step under way ends before the engine may be unloaded
            await trio.to_thread.run_sync(thread.join)
        outbox.close()


async def hand_over(inbox: trio.MemoryReceiveChannel, works: queue.SimpleQueue) -> None:
    """Put each ``StepWork`` from ``inbox`` into ``works`` for a thread, until ``inbox`` ends.

    Everything waiting is taken in one turn of the event loop: a ``receive`` per step
    would wait for every other runnable task each time.
    """
    async for work in inbox:
        for each in take_waiting(inbox, [work]):
            works.put(each)


def _step_loop(engine, works: queue.SimpleQueue, token, outbox: trio.MemorySendChannel, capture_next,
               on_captured=None) -> None:
    """Step every ``StepWork`` from ``works`` until None; each ``StepResult`` goes to ``outbox``.

    An engine that can ``launch`` a step without waiting for it keeps two in flight:
    the host prepares step N+1 (and the next plan is on its way) while the device
    runs step N, and step N's tokens are read back only then. With nothing new to
    launch it finishes the oldest; with nothing at all it captures a CUDA graph.
    """
    keep = 1 if hasattr(engine, "launch") else 0  # launched steps left in flight after a launch
    graph_progress = engine.graph_progress if on_captured is not None else None
    if not keep:
        engine = _StepAtLaunch(engine)
    capturing = capture_next is not None
    inflight: deque[tuple[float, str | None]] = deque()  # (launch time, launch error), oldest first
    last_done = time.perf_counter()

    def answer() -> bool:
        """Collect the oldest launched step and hand its result on; False once the loop is gone."""
        nonlocal last_done
        started, error = inflight.popleft()
        outputs = []
        if error is None:
            try:
                outputs = engine.collect()
            except Exception as exc:
                error = step_failure(exc)
        done = time.perf_counter()
        # The device time of a pipelined step: from when it could start (launched, and the
        # one before it done) to its end.
        seconds, last_done = done - max(started, last_done), done
        try:
            token.run_sync_soon(deliver, outbox, StepResult(tuple(outputs), seconds, error))
        except trio.RunFinishedError:
            return False
        return True

    while True:
        if inflight and works.empty():
            if not answer():
                return
            continue
        if capturing and not inflight and works.empty():
            capturing = capture_one(capture_next)
            if on_captured is not None:
                try:
                    token.run_sync_soon(on_captured, *graph_progress())
                except trio.RunFinishedError:
                    return
            continue
        work = works.get()
        if work is None:
            while inflight and answer():  # the steps under way end before the engine may be unloaded
                pass
            return
        launched = time.perf_counter()
        try:
            register_work(engine, work)
            error = None
        except Exception as exc:
            error = step_failure(exc)
        inflight.append((launched, error))
        while len(inflight) > keep:
            if not answer():
                return


class _StepAtLaunch:
    """``launch``/``collect`` for an engine that only has ``step`` (an engine double): the step
    runs at launch and is answered at once, so nothing is held back a step."""

    def __init__(self, engine):
        self._engine = engine
        self._done: deque = deque()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def launch(self, plan) -> None:
        self._done.append(self._engine.step(plan))

    def collect(self) -> list[TokenOutput]:
        return self._done.popleft()


def deliver(outbox: trio.MemorySendChannel, result: StepResult) -> None:
    """Put a result into the scheduler's channel (called in the event loop from a thread)."""
    try:
        outbox.send_nowait(result)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass  # shutting down


def graph_gauges(metrics, engine) -> Callable[[int, int], None]:
    """``on_captured`` for ``run_in_thread``: the decode-graph gauges of ``metrics``, set now
    to ``engine``'s progress (call it before the engine's thread starts)."""
    def on_captured(captured: int, planned: int) -> None:
        metrics.decode_graphs_captured.set(captured)
        metrics.decode_graphs_planned.set(planned)

    on_captured(*engine.graph_progress())
    return on_captured


def capture_one(capture_next: Callable[[], bool]) -> bool:
    """Capture one more CUDA graph; False when all are (or capture failed: decoding stays eager)."""
    try:
        return capture_next()
    except Exception:
        log.exception("CUDA graph capture failed; decoding stays eager")
        return False


def step_failure(exc: Exception) -> str:
    """Log a step that raised; the error its requests end with (the engine's failure, not the server's)."""
    log.exception("engine step failed")
    return f"engine step failed: {type(exc).__name__}: {exc}"


async def run(
    execute: Executor,
    inbox: trio.MemoryReceiveChannel,
    outbox: trio.MemorySendChannel,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run each ``StepWork`` from ``inbox`` with ``execute`` (an async executor: simulations
    on a mock clock) and answer a ``StepResult`` on ``outbox``.

    A step that raises fails only the sequences in it: the error goes back to
    the scheduler, and the runner keeps serving.
    """
    async with inbox, outbox:
        task_status.started()
        async for work in inbox:
            start = trio.current_time()
            try:
                outputs, error = await execute(work), None
            except Exception as exc:
                outputs, error = [], step_failure(exc)
            await outbox.send(StepResult(tuple(outputs), trio.current_time() - start, error))
