"""The engine and its core in a process of their own: the HTTP side only streams.

With the engine in a thread of the server, every step's host work competes for one
interpreter lock with SSE formatting, detokenization and hypercorn. So, as vLLM's
engine core does, the child runs the core loop (``spark.actors.host.CoreLoop``: the
scheduler, the page allocator and the engine) as its main loop; a step's plan never
leaves the process. The server sends requests in and cancellations, and gets back
what the streamer needs: which requests started, their tokens, failures, metrics.

    server:  run_host --ProcessTransport--pipe--> [child: CoreLoop over the Engine]
             streamer <--StreamOpen/TokenBatch/Failed-- run_host <--Out--pipe--'

The parent holds an ``EngineProcess``: the engine facts admission needs (tokenizer,
vocabulary, context, page pool), ``transport()`` for ``run_host``, and ``close``.
``serve`` is the child's body: load, report, then serve one session per actor
system the server opens, until told to stop.

With ``world_size`` > 1 the child is rank 0 of a tensor-parallel group: ``start`` spawns
ranks 1..N-1 beside it (``spark.engine.ranks``; under torchrun they exist already), the
child's engine is their ``Leader``, and closing the child closes them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from typing import Callable

from spark import gc_tuning
from spark.actors.host import CoreLoop, new_core
from spark.actors.messages import EndSession, EngineFacts, LoadFailure, Out, Session, SessionEnded
from spark.serve_config import ServeConfig

log = logging.getLogger("spark.engine_process")

_JOIN_SECONDS = 30.0  # a session's end waits this long for the child's steps under way


class EngineProcess:
    """A handle on the engine process (``start`` it; ``close`` it): a ``LoadedEngine``."""

    def __init__(self, process, conn, facts: EngineFacts, tokenizer, followers=None):
        self._process, self._conn = process, conn
        self._followers = followers  # ranks.Followers this process spawned, if any
        self.tokenizer = tokenizer
        self.vocab_size = facts.vocab_size
        self.max_model_len = facts.max_model_len
        self.num_pages = facts.num_pages
        self.page_size = facts.page_size

    @classmethod
    def start(cls, model: str | None, *, graphs_max_batch: int = 0, graphs_verify_rows: int = 0,
              graphs_max_tokens: int | None = None,
              cpu_threads: int | None = None, warm=None, world_size: int = 1, **load_kwargs) -> "EngineProcess":
        """Spawn the process, load ``model`` there (``Engine.load`` kwargs) and wait until it is ready.

        Args:
          graphs_max_batch, graphs_verify_rows, graphs_max_tokens: the CUDA graphs to capture
            (``Engine.enable_cuda_graphs``; a max batch of 0: none).
          cpu_threads: torch's intra-op threads there, when it runs on the CPU; None: torch's default.
          warm: the ``warmup.WarmupShape`` to warm the engine for before it reports ready (None: not warmed).
          world_size: tensor-parallel ranks; the others are spawned here unless torchrun started them.

        Raises:
            ModelLoadError: the model cannot be read (as ``Engine.load`` would raise).
            ValueError: the model does not split over ``world_size`` ranks.
        """
        from spark.engine.tokenizer import Tokenizer
        from spark.engine.errors import ModelLoadError
        from spark.engine.weights import resolve_model

        source = resolve_model(model, dummy_config=load_kwargs.get("dummy_config"))  # fails fast, here
        source.config.shard(world_size)  # and so does a model the ranks cannot split
        followers, rank_env = None, {}
        if world_size > 1:
            from spark.engine import ranks

            load_kwargs = {**load_kwargs, "world_size": world_size}
            if not ranks.started_by_torchrun():  # else the child joins torchrun's group, rendezvous inherited
                followers = ranks.start_followers(world_size, load_kwargs.get("device"), cpu_threads=cpu_threads)
                rank_env = followers.env
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        parent, child = ctx.Pipe()
        process = ctx.Process(target=serve, args=(child, model, load_kwargs,
                                                  (graphs_max_batch, graphs_verify_rows, graphs_max_tokens),
                                                  cpu_threads, warm, rank_env), daemon=True)
        process.start()
        child.close()
        try:
            reply = parent.recv()
        except EOFError:
            reply = LoadFailure(f"the engine process exited with status {process.join(5) or process.exitcode}")
        if isinstance(reply, LoadFailure):
            process.join(5)
            if followers is not None:
                followers.stop(timeout=5.0)
            if reply.load_error:
                raise ModelLoadError(source.path or model, reply.message)
            raise RuntimeError(f"engine process failed to start: {reply.message}")
        return cls(process, parent, reply, Tokenizer.for_source(source), followers)

    def transport(self) -> "ProcessTransport":
        return ProcessTransport(self._conn)

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
        if self._followers is not None:  # the child closed them on its way out
            self._followers.stop(timeout)


class ProcessTransport:
    """A session with the engine process's core loop, over the pipe (threads read and write it:
    a send may block, and a receive always does)."""

    def __init__(self, conn):
        self._conn = conn
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._receiver: threading.Thread | None = None

    def open(self, config: ServeConfig, deliver: Callable[[Out], None], exited: Callable[[], None]) -> None:
        self._sends.put(Session(config))
        threading.Thread(target=send_loop, args=(self._conn, self._sends), name="spark-engine-send",
                         daemon=True).start()
        self._receiver = threading.Thread(target=self._receive, args=(deliver, exited), name="spark-engine-recv",
                                          daemon=True)
        self._receiver.start()

    def send(self, batch: list) -> None:
        self._sends.put(batch)

    def close(self) -> None:
        self._sends.put(EndSession())
        self._sends.put(None)
        if self._receiver is not None:  # the next session may read the pipe only after this one
            self._receiver.join(_JOIN_SECONDS)

    def _receive(self, deliver: Callable[[Out], None], exited: Callable[[], None]) -> None:
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                exited()  # the process is gone
                return
            if isinstance(reply, SessionEnded):
                return
            deliver(reply)


def send_loop(conn, sends: queue.SimpleQueue) -> None:
    """Write each message from ``sends`` to the pipe until None."""
    while (message := sends.get()) is not None:
        try:
            conn.send(message)
        except (OSError, EOFError):
            return


# -- the child --------------------------------------------------------------------------------------


def serve(conn, model, load_kwargs, graphs, cpu_threads=None, warm=None, rank_env=None) -> None:
    """The engine process: load, report, then serve sessions until told to stop.

    ``graphs``: (max batch, verify rows, max step tokens) of the CUDA graphs to capture; a max batch of 0: none.

    ``rank_env``: the tensor-parallel rendezvous (``MASTER_ADDR``, ``MASTER_PORT``) this rank 0 joins."""
    import os

    from spark.engine.device import use_cpu_threads
    from spark.engine.errors import ModelLoadError
    from spark.engine.warmup import load_warm

    os.environ.update(rank_env or {})
    if cpu_threads is not None:
        use_cpu_threads(load_kwargs.get("device"), cpu_threads)
    try:
        engine = load_warm(model, warm, **load_kwargs)
    except ModelLoadError as exc:
        conn.send(LoadFailure(exc.problem, load_error=True))
        return
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(LoadFailure(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(EngineFacts(engine.vocab_size, engine.max_model_len, engine.num_pages, engine.page_size))
    gc_tuning.settle()  # this process only schedules and steps: no collector pause in a launch
    capture = graphs[0] > 0 and engine.enable_cuda_graphs(*graphs)
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return  # the parent is gone
            if not isinstance(message, Session):
                return  # None: stop
            stop, capture = run_session(engine, conn, message.config, capture)
            if stop:
                return
            conn.send(SessionEnded())
    finally:
        engine.close()  # a tensor-parallel leader closes its followers with it


def run_session(engine, conn, config: ServeConfig, capture: bool) -> tuple[bool, bool]:
    """One session: the core loop over ``engine`` in this thread, fed from the pipe by a reader
    thread, answering on it through a writer thread. Returns (whether the parent asked the
    process to stop, whether graphs are still left to capture)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    sends: queue.SimpleQueue = queue.SimpleQueue()
    stop_asked = threading.Event()  # the parent closed the process, not just the session
    sender = threading.Thread(target=send_loop, args=(conn, sends), name="spark-core-send", daemon=True)
    receiver = threading.Thread(target=_receive, args=(conn, inbox, stop_asked), name="spark-core-recv",
                                daemon=True)
    sender.start()
    receiver.start()
    loop = CoreLoop(new_core(engine, config), inbox, sends.put, capture_graphs=capture,
                    slow_turn_ms=config.slow_turn_ms)
    try:
        loop.run()
    finally:
        sends.put(None)
        sender.join()
    receiver.join()
    return stop_asked.is_set(), loop.capturing


def _receive(conn, inbox: queue.SimpleQueue, stop_asked: threading.Event) -> None:
    """Put each batch the parent sends into ``inbox``, until the session ends (then None)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        if message is None or isinstance(message, EndSession):
            if message is None:
                stop_asked.set()
            inbox.put(None)
            return
        inbox.put(message)
