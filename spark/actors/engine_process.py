"""The engine in a process of its own, so that Python work of the HTTP side never stalls the GPU.

With the engine in a worker thread, every step's host work (building the
batch, reading sampled tokens back) competes for one interpreter lock with
SSE formatting, detokenization and hypercorn; at hundreds of streams the GPU
waits on Python. Here the child process owns the engine and loops over
``StepWork`` messages from a pipe; between steps, while nothing waits, it
captures CUDA graphs. The parent holds an ``EngineProcess``: the few engine
facts the actors need (tokenizer, vocabulary, context, page pool) and an
``execute`` for the GPU-runner actor.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from typing import Any

import attrs
import trio

from spark.actors.messages import StepWork
from spark.engine.engine import TokenOutput
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
        self._lock = trio.Lock()

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

    async def execute(self, work: StepWork) -> list[TokenOutput]:
        """Run one step in the engine process (the GPU runner's executor)."""
        async with self._lock:
            reply = await trio.to_thread.run_sync(self._roundtrip, work)
        if isinstance(reply, _Failure):
            raise RuntimeError(reply.message)
        return reply

    def _roundtrip(self, work: StepWork):
        self._conn.send(work)
        return self._conn.recv()

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
    from spark.actors.gpu_runner import apply_work
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
    capturing = graphs_max_batch > 0 and engine.enable_cuda_graphs(graphs_max_batch)
    while True:
        if capturing and not conn.poll():
            try:
                capturing = engine.capture_next_graph()
            except Exception:
                log.exception("CUDA graph capture failed; decoding stays eager")
                capturing = False
            continue
        try:
            work = conn.recv()
        except EOFError:
            return  # the parent is gone
        if work is None:
            return
        try:
            conn.send(apply_work(engine, work))
        except Exception as exc:
            log.exception("engine step failed")
            conn.send(_Failure(f"engine step failed: {type(exc).__name__}: {exc}"))
