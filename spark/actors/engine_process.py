"""The engine in a process of its own, so that Python work of the HTTP side never stalls the GPU.

With the engine in a worker thread, every step's host work (building the
batch, reading sampled tokens back) competes for one interpreter lock with
SSE formatting, detokenization and hypercorn; at hundreds of streams the GPU
waits on Python. Here the child process owns the engine and loops over
``StepWork`` messages from a pipe, launching step N+1 before it reads back
step N's tokens; between steps, while nothing waits, it captures CUDA graphs.
The parent holds an ``EngineProcess``: the few engine facts the actors need
(tokenizer, vocabulary, context, page pool) and ``run``, its GPU-runner actor.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from collections import deque
from typing import Any

import attrs
import trio

from spark import gc_tuning
from spark.actors.gpu_runner import capture_one, deliver, hand_over, register_work, step_failure
from spark.actors.messages import StepResult
from spark.engine.page_allocator import PageAllocator

log = logging.getLogger("spark.engine_process")


@attrs.frozen
class _Failure:
    message: str
    load_error: bool = False  # a ModelLoadError: the message is the one line to show


class EngineProcess:
    """A handle on the engine process (``start`` it; ``close`` it)."""

    def __init__(self, process, conn, info: dict[str, Any], tokenizer):
        self._process, self._conn = process, conn
        self.tokenizer = tokenizer
        self.vocab_size: int = info["vocab_size"]
        self.max_model_len: int = info["max_model_len"]
        self.num_pages: int = info["num_pages"]
        self.page_size: int = info["page_size"]

    @classmethod
    def start(cls, model: str | None, *, graphs_max_batch: int = 0, **load_kwargs) -> "EngineProcess":
        """Spawn the process, load ``model`` there (``Engine.load`` kwargs) and wait until it is ready.

        Raises:
            ModelLoadError: the model cannot be read (as ``Engine.load`` would raise).
        """
        from spark.engine.engine import _load_tokenizer
        from spark.engine.errors import ModelLoadError
        from spark.engine.weights import resolve_model

        source = resolve_model(model, dummy_config=load_kwargs.get("dummy_config"))  # fails fast, here
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(child, model, load_kwargs, graphs_max_batch), daemon=True)
        process.start()
        child.close()
        try:
            reply = parent.recv()
        except EOFError:
            reply = _Failure(f"the engine process exited with status {process.join(5) or process.exitcode}")
        if isinstance(reply, _Failure):
            process.join(5)
            if reply.load_error:
                raise ModelLoadError(source.path or model, reply.message)
            raise RuntimeError(f"engine process failed to start: {reply.message}")
        return cls(process, parent, reply, _load_tokenizer(source))

    def new_page_allocator(self) -> PageAllocator:
        return PageAllocator(self.num_pages, self.page_size)

    async def run(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel, *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The GPU-runner actor for this process: each ``StepWork`` goes down the pipe as soon
        as it comes, each ``StepResult`` comes back as soon as the step is done.

        Sending and receiving are independent, so the engine process finds step N+1
        waiting when it finishes step N, whatever this event loop is busy with. A
        thread of its own writes the pipe: handing it a step costs the loop nothing.
        """
        sends: queue.SimpleQueue = queue.SimpleQueue()
        sender = threading.Thread(target=self._send_loop, args=(sends,), name="spark-engine-send", daemon=True)
        sender.start()
        exited = trio.Event()
        receiver = threading.Thread(target=self._recv_loop, args=(trio.lowlevel.current_trio_token(), outbox, exited),
                                    name="spark-engine-recv", daemon=True)
        try:
            async with inbox, outbox, trio.open_nursery() as nursery:
                nursery.start_soon(hand_over, inbox, sends)
                receiver.start()
                task_status.started()
                await exited.wait()
                raise RuntimeError("the engine process exited")
        finally:
            sends.put(None)

    def _send_loop(self, sends: queue.SimpleQueue) -> None:
        while (work := sends.get()) is not None:
            try:
                self._conn.send(work)
            except (OSError, EOFError):
                return  # the process is gone; the receiving side reports it

    def _recv_loop(self, token, outbox: trio.MemorySendChannel, exited: trio.Event) -> None:
        """Put each ``StepResult`` from the pipe straight into ``outbox`` (a thread: no task
        of the event loop stands between the engine and the scheduler); set ``exited`` when
        the process is gone. ``outbox`` holds every step in flight, so it never fills."""
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                token.run_sync_soon(deliver, outbox, reply)
            except trio.RunFinishedError:
                return
        try:
            token.run_sync_soon(exited.set)
        except trio.RunFinishedError:
            pass

    def unload(self) -> None:
        """Free the model (a profile switch): the process and all its memory go."""
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the process; its memory (the GPU's too) is freed with it."""
        try:
            self._conn.send(None)
        except (OSError, EOFError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve(conn, model, load_kwargs, graphs_max_batch) -> None:
    """The engine process: load, report, then step and capture until told to stop."""
    from spark.engine.engine import Engine
    from spark.engine.errors import ModelLoadError

    try:
        engine = Engine.load(model, **load_kwargs)
    except ModelLoadError as exc:
        conn.send(_Failure(exc.problem, load_error=True))
        return
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(_Failure(f"{type(exc).__name__}: {exc}"))
        return
    conn.send({"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
               "num_pages": engine.num_pages, "page_size": engine.page_size})
    gc_tuning.settle()  # this process only steps: no collector pause in the middle of a launch
    capturing = graphs_max_batch > 0 and engine.enable_cuda_graphs(graphs_max_batch)
    # Steps launched, not yet answered: at most two, so the host prepares step N+1
    # (and the next plan is on its way) while the device runs step N.
    inflight: deque[tuple[float, str | None]] = deque()  # (launch time, launch error)
    last_done = time.perf_counter()
    while True:
        if inflight and not conn.poll():  # nothing new to launch: finish the oldest
            last_done = _answer(conn, engine, inflight.popleft(), last_done)
            continue
        if capturing and not inflight and not conn.poll():
            capturing = capture_one(engine.capture_next_graph)
            continue
        try:
            work = conn.recv()
        except EOFError:
            return  # the parent is gone
        if work is None:
            return
        launched = time.perf_counter()
        try:
            register_work(engine, work)
            error = None
        except Exception as exc:
            error = step_failure(exc)
        inflight.append((launched, error))
        while len(inflight) > 1:
            last_done = _answer(conn, engine, inflight.popleft(), last_done)


def _answer(conn, engine, launched: tuple[float, str | None], last_done: float) -> float:
    """Collect the oldest launched step and send its result; returns when it was done."""
    started, error = launched
    outputs = []
    if error is None:
        try:
            outputs = engine.collect()
        except Exception as exc:
            error = step_failure(exc)
    done = time.perf_counter()
    # The device time of a pipelined step: from when it could start (launched, and the
    # one before it done) to its end.
    conn.send(StepResult(tuple(outputs), done - max(started, last_done), error))
    return done
