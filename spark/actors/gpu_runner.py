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
from typing import Awaitable, Callable

import trio

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
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Step ``engine`` in a thread of its own: each ``StepWork`` from ``inbox`` is queued for
    it at once, and each ``StepResult`` is put straight into ``outbox``, whose buffer must
    hold every step the scheduler keeps in flight.

    A step that raises fails only the sequences in it. ``capture_next`` (CUDA-graph
    capture, one bucket per call) runs in the thread whenever no step is waiting.
    """
    # The event loop holds the interpreter lock most of the time at hundreds of streams;
    # by default another thread gets it only every 5 ms, which the engine thread would
    # pay a few times per step. A shorter interval hands it over within a millisecond.
    sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL))
    works: queue.SimpleQueue = queue.SimpleQueue()
    thread = threading.Thread(
        target=_step_loop, args=(engine, works, trio.lowlevel.current_trio_token(), outbox, capture_next),
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
        works.put(work)
        while True:
            try:
                works.put(inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break


def _step_loop(engine, works: queue.SimpleQueue, token, outbox: trio.MemorySendChannel, capture_next) -> None:
    capturing = capture_next is not None
    while True:
        try:
            work = works.get_nowait() if capturing else works.get()
        except queue.Empty:
            capturing = capture_one(capture_next)
            continue
        if work is None:
            return
        start = time.perf_counter()
        try:
            outputs, error = apply_work(engine, work), None
        except Exception as exc:
            outputs, error = [], step_failure(exc)
        try:
            token.run_sync_soon(deliver, outbox, StepResult(tuple(outputs), time.perf_counter() - start, error))
        except trio.RunFinishedError:
            return


def deliver(outbox: trio.MemorySendChannel, result: StepResult) -> None:
    """Put a result into the scheduler's channel (called in the event loop from a thread)."""
    try:
        outbox.send_nowait(result)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass  # shutting down


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
