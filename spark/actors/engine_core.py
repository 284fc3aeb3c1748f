"""The engine process's side: the scheduler and the GPU runner on an event loop of their own.

``serve`` is the process's body (``EngineProcess.start`` spawns it): it loads the
engine, reports its facts, then serves sessions, one per actor system the server
opens, until told to stop. In a session, ``run_session`` wires what
``spark.actors.system`` wires in a server without an engine process (the
scheduler actor, its page allocator, the GPU runner stepping the engine in a
thread) to the pipe instead of the server's channels: requests and cancellations
come in on it; what the streamer needs (started, tokens, failed) and the
scheduler's metric updates go out on it, in batches, one pipe message per turn.

Also here: the messages of the pipe, in both directions.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from typing import Any

import attrs
import trio

from spark import gc_tuning
from spark.actors import gpu_runner, scheduler
from spark.actors.channels import take_waiting
from spark.actors.messages import Cancel, GenerateRequest, StreamOpen, Submission
from spark.actors.scheduler_policy import SchedulerPolicy

_QUIET_METRICS_SECONDS = 0.25  # metric updates wait at most this long for a message to ride on


@attrs.frozen
class Failure:
    message: str
    load_error: bool = False  # a ModelLoadError: the message is the one line to show


# -- what goes down the pipe ----------------------------------------------------------------------


@attrs.frozen
class Session:
    """Parent -> child: serve requests with these limits and policy until ``EndSession``."""

    config: Any  # the ServeConfig


@attrs.frozen
class EndSession:
    pass


@attrs.frozen
class Admit:
    """Parent -> child: a request leaves the server's queue for the scheduler's."""

    request: GenerateRequest
    waited: float  # seconds since it was accepted: the child's clock is not the parent's


@attrs.frozen
class Opened:
    """Child -> parent: the scheduler took the request; its tokens follow."""

    request_id: str


@attrs.frozen
class Out:
    """Child -> parent: what the scheduler said since the last one, and its metric updates."""

    messages: tuple  # Opened | TokenBatch | Failed, in order
    metrics: tuple[tuple[str, str, float], ...]  # (metric, method, value)


@attrs.frozen
class SessionEnded:
    pass


class MetricsRecorder:
    """Stands in for ``Metrics`` in the child: records each update for the parent to apply."""

    def __init__(self):
        self._gauges: dict[str, float] = {}  # only a gauge's last value matters
        self._events: list[tuple[str, str, float]] = []

    def __getattr__(self, name: str) -> "_Instrument":
        return _Instrument(self, name)

    def take(self) -> tuple[tuple[str, str, float], ...]:
        updates = self._events + [(name, "set", value) for name, value in self._gauges.items()]
        self._gauges, self._events = {}, []
        return tuple(updates)


@attrs.frozen
class _Instrument:
    recorder: MetricsRecorder
    name: str

    def set(self, value: float) -> None:
        self.recorder._gauges[self.name] = value

    def observe(self, value: float) -> None:
        self.recorder._events.append((self.name, "observe", value))

    def inc(self, value: float = 1.0) -> None:
        self.recorder._events.append((self.name, "inc", value))


class _Unread:
    """The ``out`` of a request in the child: its stream lives in the parent."""

    def close(self) -> None:
        pass


_UNREAD = _Unread()


def serve(conn, model, load_kwargs, graphs_max_batch) -> None:
    """The engine process: load, report, then serve sessions until told to stop."""
    from spark.engine.engine import Engine
    from spark.engine.errors import ModelLoadError

    try:
        engine = Engine.load(model, **load_kwargs)
    except ModelLoadError as exc:
        conn.send(Failure(exc.problem, load_error=True))
        return
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(Failure(f"{type(exc).__name__}: {exc}"))
        return
    conn.send({"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
               "num_pages": engine.num_pages, "page_size": engine.page_size})
    gc_tuning.settle()  # this process only schedules and steps: no collector pause in a launch
    capture = engine.capture_next_graph if graphs_max_batch > 0 and engine.enable_cuda_graphs(graphs_max_batch) \
        else None
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the parent is gone
        if not isinstance(message, Session):
            return  # None: stop
        stop = trio.run(run_session, engine, conn, message.config, capture)
        if stop:
            return
        conn.send(SessionEnded())


async def run_session(engine, conn, config, capture) -> bool:
    """One session: the scheduler and the GPU runner around ``engine``, fed from the pipe,
    answering on it. Returns whether the parent asked the process to stop."""
    metrics = MetricsRecorder()
    policy = SchedulerPolicy.from_config(engine.new_page_allocator(), config)
    depth = config.scheduler_depth or scheduler.DEFAULT_DEPTH
    admissions_send, admissions_recv = trio.open_memory_channel(math.inf)  # bounded by the parent's window
    cancels_send, cancels_recv = trio.open_memory_channel(math.inf)
    work_send, work_recv = trio.open_memory_channel(depth)
    results_send, results_recv = trio.open_memory_channel(depth)
    stream_send, stream_recv = trio.open_memory_channel(256)
    sends: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=send_loop, args=(conn, sends), name="spark-core-send", daemon=True)
    sender.start()
    stop_asked = threading.Event()  # the parent closed the process, not just the session
    try:
        async with trio.open_nursery() as nursery:
            on_captured = None if capture is None else gpu_runner.graph_gauges(metrics, engine)
            await nursery.start(functools.partial(gpu_runner.run_in_thread, capture_next=capture,
                                                  on_captured=on_captured),
                                engine, work_recv, results_send)
            await nursery.start(functools.partial(
                scheduler.run, policy, admissions_recv, cancels_recv, work_send, results_recv, stream_send, metrics,
                depth=depth,
            ))
            nursery.start_soon(send_outputs, stream_recv, sends, metrics)
            receiver = threading.Thread(
                target=_recv_loop, args=(conn, trio.lowlevel.current_trio_token(), admissions_send, cancels_send,
                                         nursery.cancel_scope, stop_asked),
                name="spark-core-recv", daemon=True)
            receiver.start()
    finally:
        sends.put(None)
        sender.join()
    return stop_asked.is_set()


async def send_outputs(stream_recv: trio.MemoryReceiveChannel, sends: queue.SimpleQueue,
                        metrics: MetricsRecorder) -> None:
    """Everything the scheduler said since the last turn, as one message down the pipe; and
    metric updates on their own when nothing was said for a while (the pages a cancelled
    request freed, say), so that the server's gauges do not wait for the next request."""
    while True:
        batch = []
        with trio.move_on_after(_QUIET_METRICS_SECONDS):
            try:
                batch.append(await stream_recv.receive())
            except trio.EndOfChannel:
                return
        take_waiting(stream_recv, batch)
        updates = metrics.take()
        if batch or updates:
            messages = tuple(Opened(m.submission.request.request_id) if isinstance(m, StreamOpen) else m
                             for m in batch)
            sends.put(Out(messages, updates))


def _recv_loop(conn, token, admissions: trio.MemorySendChannel, cancels: trio.MemorySendChannel,
               session: trio.CancelScope, stop_asked: threading.Event) -> None:
    """Put what the parent sends into the scheduler's channels, until the session ends."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        if message is None or isinstance(message, EndSession):
            if message is None:
                stop_asked.set()
            try:
                token.run_sync_soon(session.cancel)
            except trio.RunFinishedError:
                pass
            return
        try:
            token.run_sync_soon(_deliver, admissions, cancels, message)
        except trio.RunFinishedError:
            return


def _deliver(admissions: trio.MemorySendChannel, cancels: trio.MemorySendChannel, batch: list) -> None:
    now = trio.current_time()
    for message in batch:
        if isinstance(message, Admit):
            admissions.send_nowait(Submission(message.request, _UNREAD, now - message.waited))
        elif isinstance(message, Cancel):
            cancels.send_nowait(message)


def send_loop(conn, sends: queue.SimpleQueue) -> None:
    """Write each message from ``sends`` to the pipe until None (a thread: a send may block)."""
    while (message := sends.get()) is not None:
        try:
            conn.send(message)
        except (OSError, EOFError):
            return
