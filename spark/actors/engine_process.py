"""The engine and its scheduler in a process of their own: the HTTP side only streams.

With the engine in a worker thread of the server, every step's host work competes
for one interpreter lock with SSE formatting, detokenization and hypercorn; and
with only the engine in another process, each plan and each result still waits
for a turn of the server's event loop, shared with hundreds of streams (on an
H200 at 256 streams the engine then stepped 79% of the time). So, as vLLM's
engine core does, the child runs the scheduler actor, the page allocator and the
GPU runner on an event loop of its own, next to the engine; a step's plan never
leaves the process. The server sends requests in and cancellations, and gets
back what the streamer needs: which requests started, their tokens, failures.

    server:  ingress --admissions--> run_core --pipe--> [child: scheduler <-> GPU runner]
             streamer <--StreamOpen/TokenBatch/Failed-- run_core <--pipe--'

The parent holds an ``EngineProcess``: the few engine facts the actors need
(tokenizer, vocabulary, context, page pool) and ``run_core``, the actor that
stands where the scheduler and the runner stand when the engine is in a thread.
What runs in the child is ``spark.actors.engine_core``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from collections import OrderedDict
from typing import Any

import trio

from spark.actors import engine_core as core
from spark.actors.channels import take_waiting
from spark.actors.scheduler import remember_cancel
from spark.actors.messages import StreamOpen, Submission, TokenBatch
from spark.core.page_allocator import PageAllocator

log = logging.getLogger("spark.engine_process")

_JOIN_SECONDS = 30.0  # a session's end waits this long for the child's steps under way


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
        process = ctx.Process(target=core.serve, args=(child, model, load_kwargs, graphs_max_batch), daemon=True)
        process.start()
        child.close()
        try:
            reply = parent.recv()
        except EOFError:
            reply = core.Failure(f"the engine process exited with status {process.join(5) or process.exitcode}")
        if isinstance(reply, core.Failure):
            process.join(5)
            if reply.load_error:
                raise ModelLoadError(source.path or model, reply.message)
            raise RuntimeError(f"engine process failed to start: {reply.message}")
        return cls(process, parent, reply, _load_tokenizer(source))

    def new_page_allocator(self) -> PageAllocator:
        return PageAllocator(self.num_pages, self.page_size)

    async def run_core(self, config, admissions: trio.MemoryReceiveChannel, cancels: trio.MemoryReceiveChannel,
                       to_streamer: trio.MemorySendChannel, metrics, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler and the GPU runner, in the engine process: until cancelled, forward
        ``Submission``s from ``admissions`` and ``Cancel``s, and put what the child's scheduler
        says (``StreamOpen``, ``TokenBatch``, ``Failed``) into ``to_streamer``, whose buffer must
        be unbounded: a thread hands them in, and the engine never waits for the streamer.

        ``admissions`` stays the waiting queue that the ingress bounds: a request moves to the
        child only while fewer than ``config.max_batch_size`` moved there and have not started,
        enough for the child to fill its whole batch without waiting for this event loop.
        """
        link = _CoreLink(config.max_batch_size, admissions, to_streamer, metrics)
        sends: queue.SimpleQueue = queue.SimpleQueue()
        sender = threading.Thread(target=core.send_loop, args=(self._conn, sends), name="spark-engine-send", daemon=True)
        exited = trio.Event()
        receiver = threading.Thread(target=self._recv_loop, args=(trio.lowlevel.current_trio_token(), link, exited),
                                    name="spark-engine-recv", daemon=True)
        sends.put(core.Session(config))
        sender.start()
        receiver.start()
        try:
            async with admissions, cancels, to_streamer, trio.open_nursery() as nursery:
                nursery.start_soon(link.forward_admissions, sends)
                nursery.start_soon(link.forward_cancels, cancels, sends)
                task_status.started()
                await exited.wait()
                raise RuntimeError("the engine process exited")
        finally:
            sends.put(core.EndSession())
            sends.put(None)
            with trio.CancelScope(shield=True):  # the next session may read the pipe only after this one
                await trio.to_thread.run_sync(receiver.join, _JOIN_SECONDS)

    def _recv_loop(self, token, link: "_CoreLink", exited: trio.Event) -> None:
        """Hand each ``core.Out`` from the pipe to ``link`` in the event loop, until the session
        ends; set ``exited`` when the process is gone."""
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(reply, core.SessionEnded):
                return
            try:
                token.run_sync_soon(link.on_output, reply)
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


class _CoreLink:
    """The server's side of a session: the requests handed to the child and not started yet."""

    def __init__(self, window: int, admissions, to_streamer, metrics):
        self._window = window
        self._admissions = admissions
        self._to_streamer = to_streamer
        self._metrics = metrics
        self._moved: dict[str, Submission] = {}  # in the child's queue, not started
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # cancelled before they moved
        self._room = trio.Event()

    async def forward_admissions(self, sends: queue.SimpleQueue) -> None:
        async for sub in self._admissions:
            # Everything else waiting, in one message.
            batch = take_waiting(self._admissions, [sub], limit=self._window - len(self._moved))
            now = trio.current_time()
            admits = []
            for sub in batch:
                if self._cancelled.pop(sub.request.request_id, 1) is None:
                    sub.out.close()
                    continue  # its client left while it was queued here
                self._moved[sub.request.request_id] = sub
                admits.append(core.Admit(sub.request, now - sub.arrival))
            sends.put(admits)
            while len(self._moved) >= self._window:
                self._room = trio.Event()
                await self._room.wait()

    async def forward_cancels(self, cancels: trio.MemoryReceiveChannel, sends: queue.SimpleQueue) -> None:
        async for cancel in cancels:
            batch = take_waiting(cancels, [cancel])
            for c in batch:
                if self._moved.pop(c.request_id, None) is not None:
                    self._room.set()
                else:  # queued here still, or started: the child ignores what it does not know
                    remember_cancel(self._cancelled, c.request_id)
            sends.put(batch)

    def on_output(self, out: core.Out) -> None:
        """What the child's scheduler said, for the streamer (called in the event loop)."""
        now = trio.current_time()
        for msg in out.messages:
            if isinstance(msg, core.Opened):
                sub = self._moved.pop(msg.request_id, None)
                if sub is None:
                    continue  # cancelled after it moved: the child ends it when the cancel arrives
                self._room.set()
                msg = StreamOpen(sub)
            elif isinstance(msg, TokenBatch):
                msg = TokenBatch(msg.outputs, now)  # this clock, as the streamer's latencies are
            try:
                self._to_streamer.send_nowait(msg)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return  # shutting down
        for name, method, value in out.metrics:
            if name == "requests_waiting":  # the child counts its queue; this one is here
                value += self._admissions.statistics().current_buffer_used
            getattr(getattr(self._metrics, name), method)(value)
