"""The GPU-runner actor: drives the synchronous engine off the event loop.

Each ``StepWork`` runs in a worker thread, so HTTP, SSE and detokenization
keep going while the GPU (or the CPU) computes. Only this actor touches the
engine, so the engine needs no locks.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from spark.actors.messages import StepResult, StepWork
from spark.engine.engine import TokenOutput

log = logging.getLogger("spark.gpu_runner")

Executor = Callable[[StepWork], Awaitable[list[TokenOutput]]]


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


def thread_executor(engine) -> Executor:
    async def execute(work: StepWork) -> list[TokenOutput]:
        return await trio.to_thread.run_sync(apply_work, engine, work)

    return execute


async def run(
    execute: Executor,
    inbox: trio.MemoryReceiveChannel,
    outbox: trio.MemorySendChannel,
    *,
    capture_next: Callable[[], bool] | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run each ``StepWork`` from ``inbox`` and answer a ``StepResult`` on ``outbox``.

    A step that raises fails only the sequences in it: the error goes back to
    the scheduler, and the runner keeps serving. ``capture_next`` (the engine's
    CUDA-graph capture, one bucket per call) runs whenever no step is waiting,
    so serving starts at once and graphs take over as they become ready.
    """
    capturing = capture_next is not None
    async with inbox, outbox:
        task_status.started()
        while True:
            if capturing:
                try:
                    work = inbox.receive_nowait()
                except trio.WouldBlock:
                    capturing = await _capture_one(capture_next)
                    continue
                except trio.EndOfChannel:
                    return
            else:
                try:
                    work = await inbox.receive()
                except trio.EndOfChannel:
                    return
            start = trio.current_time()
            try:
                outputs = await execute(work)
                error = None
            except Exception as exc:  # the engine's failure is the requests' failure, not the server's
                log.exception("engine step failed")
                outputs, error = [], f"engine step failed: {type(exc).__name__}: {exc}"
            await outbox.send(StepResult(tuple(outputs), trio.current_time() - start, error))


async def _capture_one(capture_next: Callable[[], bool]) -> bool:
    """Capture one more graph off the event loop; False when done (or capture failed: stay eager)."""
    try:
        return await trio.to_thread.run_sync(capture_next)
    except Exception:
        log.exception("CUDA graph capture failed; decoding stays eager")
        return False
