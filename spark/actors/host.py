"""The host of the core: the core's busy loop on one side, the server's channels on the other.

    server (trio):  ingress --admissions--> run_host --transport--> CoreLoop (a thread, or the
                    streamer <--StreamOpen/TokenBatch/Failed-- run_host <----'  engine process)

``CoreLoop`` is synchronous: it takes what the server sent (``Admit`` / ``Cancel``
batches) from a queue without waiting while the core is busy, calls ``Core.step``,
and hands each turn's events and metrics on as one ``Out``. Nothing of trio runs
there, so the next step is never behind a turn of the server's event loop. With the
engine in this process the loop runs in a thread (``ThreadTransport``); with an
engine process it is that process's main loop (``spark.actors.engine_process``).
``run_host`` is the same for both: it forwards requests and cancellations through the
transport and turns the core's events into the streamer's messages.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable, Protocol

import attrs
import trio

from spark.actors.channels import take_waiting
from spark.actors.messages import Admit, Cancel, Out, StreamOpen, Submission, Unpin
from spark.core.core import DEFAULT_DEPTH, Core
from spark.core.events import CoreMetrics, Opened, PrefixHit, TokenBatch
from spark.core.faults import Faults
from spark.core.interfaces import StepEngine
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler
from spark.metrics import Metrics, prefill_class
from spark.serve_config import ServeConfig

log = logging.getLogger("spark.host")

_SWITCH_INTERVAL = 0.0005  # seconds
_MAX_EARLY_CANCELS = 10_000


def new_core(engine: StepEngine, config: ServeConfig, *, clock: Callable[[], float] = time.perf_counter) -> Core:
    """The core a ``ServeConfig`` describes around ``engine``: its policy, limits and depth."""
    limits = Limits(max_prefill_tokens=config.max_prefill_tokens, tbt_deadline=config.tbt_deadline_ms / 1000.0)
    allocator = engine.new_page_allocator()
    allocator.max_pinned = int(allocator.num_total * min(max(config.prefix_pin_share, 0.0), 1.0))
    scheduler = Scheduler(allocator, make_policy(config.scheduler, limits),
                          max_batch_size=config.max_batch_size, prefix_caching=config.prefix_caching)
    grammars = None
    if engine.tokenizer is not None:
        from spark.engine.grammar import XGrammars

        grammars = XGrammars(engine.tokenizer, engine.vocab_size)
    return Core(engine, scheduler, depth=config.scheduler_depth or DEFAULT_DEPTH, clock=clock,
                faults=Faults.parse(config.faults), grammars=grammars, speculation=config.spec_config(),
                step_log=StepTrace(config.step_trace) if config.step_trace else None)


class StepTrace:
    """``Core``'s step_log writing JSON lines to ``path`` (appended, line-buffered: a crash keeps them),
    until closed: its ``CoreLoop`` closes it when the session ends (a profile switch opens another)."""

    def __init__(self, path: str):
        self._out = open(path, "a", buffering=1)

    def __call__(self, record: dict) -> None:
        self._out.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._out.close()

    @property
    def closed(self) -> bool:
        return self._out.closed


# -- the core's side ------------------------------------------------------------------------------


class CoreLoop:
    """Step ``core`` with what arrives in ``inbox`` (lists of ``Admit`` / ``Cancel``; None stops),
    handing each turn's ``Out`` to ``emit``. With nothing to do it captures one more CUDA graph
    (``capture_graphs``), or sleeps until the inbox has something."""

    def __init__(self, core: Core, inbox: queue.SimpleQueue, emit: Callable[[Out], None], *,
                 capture_graphs: bool = False, slow_turn_ms: float | None = None):
        self.core, self.inbox, self.emit = core, inbox, emit
        self.capturing = capture_graphs
        self.slow_turns = SlowTurns(slow_turn_ms / 1000.0) if slow_turn_ms else None

    def run(self) -> None:
        try:
            self._run()
        finally:
            if isinstance(self.core.step_log, StepTrace):
                self.core.step_log.close()

    def _run(self) -> None:
        core = self.core
        while True:
            idle = not core.busy and not self.capturing
            if idle:
                self._emit(())  # gauges current before sleeping (pages a cancel freed, say)
            timer = self.slow_turns.start() if self.slow_turns and not idle else None
            if not self._take(block=idle):
                self._emit(tuple(core.drain()))  # the steps under way end before the engine may go
                return
            if timer:
                timer.lap("take")
            if core.busy:
                events = core.step()
                if timer:
                    timer.lap("step")
                if events:
                    shown = self._emit(tuple(events))
                    if timer:
                        timer.lap("emit")
                        self.slow_turns.check(timer, shown.steps)
            elif self.capturing:
                self.capturing = self._capture_one()
                self._emit(())

    def _take(self, *, block: bool) -> bool:
        """Apply what the server sent; False once it said stop."""
        clock = self.core.clock
        while True:
            try:
                batch = self.inbox.get() if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            if batch is None:
                return False
            block = False
            for message in batch:
                if isinstance(message, Admit):
                    r = message.request
                    self.core.submit(r.request_id, r.prompt_ids, r.params, clock() - message.waited, pins=r.pins,
                                     grammar=r.grammar, speculate=r.speculative, tbt=r.tbt_s,
                                     score_prompt=r.params.prompt_logprobs is not None)
                elif isinstance(message, Unpin):
                    self.core.unpin(message.key)
                else:
                    self.core.cancel(message.request_id)

    def _emit(self, events: tuple) -> CoreMetrics:
        metrics = self.core.metrics()
        progress = self.core.engine.graph_progress()
        if progress[1]:
            metrics = attrs.evolve(metrics, graphs=progress)
        self.emit(Out(events, metrics))
        return metrics

    def _capture_one(self) -> bool:
        """Capture one more CUDA graph; False when all are (or capture failed: decoding stays eager)."""
        try:
            return self.core.engine.capture_next_graph()
        except Exception:
            log.exception("CUDA graph capture failed; decoding stays eager")
            return False


class SlowTurns:
    """Diagnostics (``slow_turn_ms``): each turn of the core loop that took longer than ``threshold_s``,
    logged with where its time went (taking messages, ``Core.step``, handing the events on), how much
    of it this thread ran on a CPU, the steps it collected, and what else happened meanwhile: garbage
    collections, and the CUDA caching allocator's device mallocs and retries (a retry frees the cache
    and waits for the device). One line per slow turn; nothing is measured but two clocks otherwise."""

    def __init__(self, threshold_s: float):
        self.threshold_s = threshold_s
        self._seen = self._counters()
        _log_triton_compiles()

    def start(self) -> "_TurnTimer":
        return _TurnTimer()

    def check(self, timer: "_TurnTimer", steps) -> None:
        wall = time.perf_counter() - timer.t0
        if wall < self.threshold_s:
            return
        now = self._counters()
        grown = {k: now[k] - self._seen.get(k, 0) for k in now}
        self._seen = now
        laps = ", ".join(f"{name} {1000 * s:.1f}" for name, s in timer.laps)
        shapes = " ".join(f"[{1000 * s.seconds:.1f} ms: {s.decode_rows} rows + {s.prefill_tokens} tok]"
                          for s in steps)
        log.warning("slow turn %.1f ms (%s; cpu %.1f ms) steps %s; since the last slow turn: %s",
                    1000 * wall, laps, 1000 * (time.thread_time() - timer.cpu0), shapes or "none",
                    ", ".join(f"{k} +{v}" for k, v in grown.items()))

    @staticmethod
    def _counters() -> dict[str, int]:
        import gc

        out = {"gc": sum(g["collections"] for g in gc.get_stats())}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stats = torch.cuda.memory_stats()
            out["cuda_mallocs"] = stats.get("num_device_alloc", 0)
            out["cuda_alloc_retries"] = stats.get("num_alloc_retries", 0)
        return out


def _log_triton_compiles() -> None:
    """From now on (the engine is warm), log each kernel specialization Triton compiles: a compile
    while serving is a stall that warm-up should have taken, and its argument types and constants
    say which shape brought it."""
    try:
        from triton import knobs
    except ImportError:
        return

    def hook(*, key, fn, compile, **_):
        constants = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v
                     for k, v in compile.get("constants", {}).items()}
        log.warning("Triton compiles while serving: %s constants %s key %s", getattr(fn, "name", fn), constants,
                    str(key)[:2000])
        return False  # compile it all the same

    knobs.runtime.jit_cache_hook = hook


class _TurnTimer:
    def __init__(self):
        self.t0 = self._last = time.perf_counter()
        self.cpu0 = time.thread_time()
        self.laps: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self._last))
        self._last = now


def shorten_switch_interval() -> None:
    """The event loop holds the interpreter lock most of the time at hundreds of streams; by
    default another thread gets it only every 5 ms, which the core's thread would pay a few
    times per step. A shorter interval hands it over within a millisecond."""
    sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL))


# -- the server's side ----------------------------------------------------------------------------


class Transport(Protocol):
    """How ``run_host`` reaches a core loop. ``deliver`` and ``exited`` may be called from any thread."""

    def open(self, config: ServeConfig, deliver: Callable[[Out], None], exited: Callable[[], None]) -> None:
        """Start a session: a core built from ``config``, its ``Out``s to ``deliver``."""

    def send(self, batch: list) -> None:
        """``Admit`` / ``Cancel`` messages for the core, in order (never blocks)."""

    def close(self) -> None:
        """End the session (blocking): the core's steps under way finish first."""


class ThreadTransport:
    """The core loop in a thread of this process, over ``engine``."""

    def __init__(self, engine: StepEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def open(self, config: ServeConfig, deliver: Callable[[Out], None], exited: Callable[[], None]) -> None:
        shorten_switch_interval()
        capture = self.engine.enable_cuda_graphs(config.max_batch_size, config.verify_graph_rows(),
                                                 config.max_batch_size + config.max_prefill_tokens)
        loop = CoreLoop(new_core(self.engine, config), self._inbox, deliver, capture_graphs=capture,
                        slow_turn_ms=config.slow_turn_ms)

        def body() -> None:
            try:
                loop.run()
            except BaseException:
                log.exception("the core loop failed")
                exited()

        self._thread = threading.Thread(target=body, name="spark-core", daemon=True)
        self._thread.start()

    def send(self, batch: list) -> None:
        self._inbox.put(batch)

    def close(self) -> None:
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join()


async def run_host(
    transport: Transport,
    config: ServeConfig,
    admissions: trio.MemoryReceiveChannel,
    cancels: trio.MemoryReceiveChannel,
    to_streamer: trio.MemorySendChannel,
    metrics: Metrics,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Until cancelled: forward ``Submission``s from ``admissions`` and ``Cancel``s to the core,
    and put what it says (``StreamOpen``, ``TokenBatch``, ``Failed``) into ``to_streamer``, whose
    buffer must be unbounded: a thread hands them in, and the core never waits for the streamer.

    ``admissions`` stays the waiting queue that the ingress bounds: a request moves to the core
    only while the core's batch has room for it (``config.max_batch_size`` requests moved and
    not ended), so ``max_waiting`` is the queue's bound whichever host runs the core.
    """
    link = _Link(config.max_batch_size, admissions, to_streamer, metrics)
    token = trio.lowlevel.current_trio_token()
    gone = trio.Event()

    def deliver(out: Out) -> None:
        try:
            token.run_sync_soon(link.on_output, out)
        except trio.RunFinishedError:
            pass

    def exited() -> None:
        try:
            token.run_sync_soon(gone.set)
        except trio.RunFinishedError:
            pass

    transport.open(config, deliver, exited)
    try:
        async with admissions, cancels, to_streamer, trio.open_nursery() as nursery:
            nursery.start_soon(link.forward_admissions, transport.send)
            nursery.start_soon(link.forward_cancels, cancels, transport.send)
            task_status.started()
            await gone.wait()
            raise RuntimeError("the engine's core loop exited")
    finally:
        with trio.CancelScope(shield=True):  # the next session may use the engine only after this one
            await trio.to_thread.run_sync(transport.close)


def remember_cancel(cancelled: OrderedDict, request_id: str) -> None:
    """Note a cancel for a request that may still come through the queue: it is dropped then.
    Only the newest ``_MAX_EARLY_CANCELS`` are kept (most name requests that ended already)."""
    cancelled[request_id] = None
    while len(cancelled) > _MAX_EARLY_CANCELS:
        cancelled.popitem(last=False)


class _Link:
    """The server's side of a session: the requests handed to the core, started or not."""

    def __init__(self, window: int, admissions, to_streamer, metrics: Metrics):
        self._window = window
        self._admissions = admissions
        self._to_streamer = to_streamer
        self._metrics = metrics
        self._moved: dict[str, Submission] = {}  # in the core's queue, not started
        self._running: set[str] = set()  # started, not ended
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # cancelled before they moved
        self._room = trio.Event()

    def _free_slots(self) -> int:
        return self._window - len(self._moved) - len(self._running)

    def _ended(self, request_id: str) -> None:
        if request_id in self._running:
            self._running.discard(request_id)
            self._room.set()

    async def forward_admissions(self, send: Callable[[list], None]) -> None:
        while True:
            while self._free_slots() <= 0:
                self._room = trio.Event()
                await self._room.wait()
            try:
                sub = await self._admissions.receive()
            except trio.EndOfChannel:
                return
            # Everything else waiting that fits, in one message.
            batch = take_waiting(self._admissions, [sub], limit=self._free_slots())
            now = trio.current_time()
            admits = []
            for sub in batch:
                if self._cancelled.pop(sub.request.request_id, 1) is None:
                    sub.out.close()
                    continue  # its client left while it was queued here
                self._moved[sub.request.request_id] = sub
                admits.append(Admit(sub.request, now - sub.arrival))
            send(admits)

    async def forward_cancels(self, cancels: trio.MemoryReceiveChannel, send: Callable[[list], None]) -> None:
        async for cancel in cancels:
            batch: list[Cancel | Unpin] = take_waiting(cancels, [cancel])
            for c in batch:
                if isinstance(c, Unpin):
                    continue  # for the core alone
                if self._moved.pop(c.request_id, None) is not None:
                    self._room.set()
                elif c.request_id in self._running:
                    self._ended(c.request_id)
                else:  # queued here still (or ended): the core ignores what it does not know
                    remember_cancel(self._cancelled, c.request_id)
            send(batch)

    def on_output(self, out: Out) -> None:
        """What the core said, for the streamer (called in the event loop)."""
        now = trio.current_time()
        for event in out.events:
            if isinstance(event, Opened):
                sub = self._moved.pop(event.request_id, None)
                if sub is None:
                    continue  # cancelled after it moved: the core ends it when the cancel arrives
                self._running.add(event.request_id)
                event = StreamOpen(sub)
            elif isinstance(event, TokenBatch):
                for token in event.outputs:
                    if token.finish_reason is not None:
                        self._ended(token.seq_id)
                event = TokenBatch(event.outputs, now)  # this clock, as the streamer's latencies are
            elif isinstance(event, PrefixHit):
                if event.request_id not in self._running:
                    continue
            else:
                self._ended(event.request_id)
            try:
                self._to_streamer.send_nowait(event)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return  # shutting down
        record_core_metrics(self._metrics, out.metrics, queued_here=self._admissions.statistics().current_buffer_used)


def record_core_metrics(metrics: Metrics, core: CoreMetrics, *, queued_here: int) -> None:
    """Set the server's metrics from a core's snapshot (its queue plus the ``queued_here``)."""
    metrics.kv_pages_used.set(core.kv_pages_used)
    metrics.kv_pages_total.set(core.kv_pages_total)
    metrics.requests_running.set(core.requests_running)
    metrics.requests_waiting.set(core.requests_waiting + queued_here)
    metrics.prefix_cached_pages.set(core.prefix_cached_pages)
    metrics.prefix_queried_tokens.inc(core.prefix_queried_tokens)
    metrics.prefix_hit_tokens.inc(core.prefix_hit_tokens)
    metrics.prefix_evictions.inc(core.prefix_evictions)
    metrics.prefix_pinned_pages.set(core.prefix_pinned_pages)
    if core.speculation:
        drafted, accepted, steps, emitted = core.speculation
        metrics.spec_drafted_tokens.inc(drafted)
        metrics.spec_accepted_tokens.inc(accepted)
        metrics.spec_steps.inc(steps)
        metrics.spec_emitted_tokens.inc(emitted)
    now = trio.current_time()
    for seconds in core.queue_times:
        metrics.queue_time.observe(seconds)
        metrics.queue_waits.started(seconds, now)
    metrics.ttft.observe_core(core.requests_running, core.steps)
    for step in core.steps:
        metrics.step_seconds.observe(step.seconds)
        metrics.step_decode_rows.observe(step.decode_rows)
        metrics.step_prefill_tokens.observe(step.prefill_tokens)
        metrics.step_seconds_by_prefill.labels(prefill_class(step.prefill_tokens)).observe(step.seconds)
    if core.graphs is not None:
        metrics.decode_graphs_captured.set(core.graphs[0])
        metrics.decode_graphs_planned.set(core.graphs[1])

