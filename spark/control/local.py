"""A spark-engine recipe loaded in this process: the engine, its actor system, the generations it serves.

The HTTP routes hold a ``LocalModel`` as their ``ServedModel`` (``spark.control.served``): it
passes ``submit`` on to the actor system but counts every stream it hands out, so that a
switch can stop admitting, wait for the streams to finish, and past a grace period end the
rest with an error piece the client sees.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Mapping, Sequence

import trio

from spark.actors.ingress import SubmitError
from spark.actors.messages import GenerateRequest, RequestOutput
from spark.actors.system import SparkSystem, open_system
from spark.control.served import GenerationStream, ServedModel
from spark.core.interfaces import LoadedEngine
from spark.engine.tokenizer import Tokenizer
from spark.metrics import Metrics
from spark.recipes.schema import Recipe
from spark.recipes.serving import engine_dtype, recipe_config
from spark.serve_config import ServeConfig

log = logging.getLogger("spark.control")


async def load_engine(config: ServeConfig, *, model: str | None = None, dummy_config=None,
                      dtype=None) -> LoadedEngine:
    """Load ``model`` (by default ``config.model``) in a worker thread, so the event loop keeps running:
    in this process, or in an engine process of its own (``config.uses_engine_process()``).

    Raises:
        ModelLoadError: the model cannot be read.
    """
    from spark.engine.device import checked_device, use_cpu_threads
    from spark.engine.warmup import WarmupShape, load_warm

    if config.device is not None:
        checked_device(config.device)  # here, not in an engine process that would only say it failed
    model = config.model if model is None else model
    kwargs = dict(device=config.device, page_size=config.page_size, kv_cache_bytes=config.kv_cache_bytes,
                  max_model_len=config.max_model_len)
    if config.world_size > 1:  # tensor parallelism: the engine process leads the ranks (spark.engine.ranks)
        kwargs["world_size"] = config.world_size
    kwargs.update({k: v for k, v in (("dummy_config", dummy_config), ("dtype", dtype),
                                     ("weight_format", config.weight_format)) if v is not None})
    if config.kv_cache_dtype != "auto":
        kwargs["kv_dtype"] = config.kv_cache_dtype
    threads = config.resolved_cpu_threads()
    kwargs["adapt_cpu_threads"] = config.cpu_threads is None  # a count the user gave stays
    # Ready means warm: every step shape this server will plan runs once before it answers (GPU).
    warm = WarmupShape(config.max_batch_size, config.max_prefill_tokens) if config.warm_up else None
    if config.uses_engine_process():
        from spark.actors.engine_process import EngineProcess

        load = functools.partial(EngineProcess.start, model, graphs_max_batch=config.max_batch_size,
                                 graphs_verify_rows=config.verify_graph_rows(),
                                 graphs_max_tokens=config.max_batch_size + config.max_prefill_tokens,
                                 cpu_threads=threads, warm=warm, **kwargs)
    else:
        use_cpu_threads(config.device, threads)
        load = functools.partial(load_warm, model, warm, **kwargs)
    return await trio.to_thread.run_sync(load, abandon_on_cancel=True)  # Ctrl-C need not wait for it


class LocalModel(ServedModel):
    """One loaded recipe. ``host`` runs its actor system; ``submit`` is the routes' way in."""

    def __init__(self, recipe: Recipe, config: ServeConfig, engine: LoadedEngine):
        self.recipe, self._config, self.engine = recipe, config, engine
        self.system: SparkSystem | None = None  # while hosted
        self.admitting = True
        self.eviction: str | None = None  # set when the open streams are cut off: the error they end with
        self._streams: set[CountedStream] = set()
        self._idle = trio.Event()
        self._idle.set()
        self._close = trio.Event()
        self.closed = trio.Event()

    @classmethod
    async def load(cls, recipe: Recipe, base: ServeConfig, *, engine: LoadedEngine | None = None) -> LocalModel:
        """Load the recipe's weights in a worker thread (``engine``: already loaded, e.g. by a test).

        Raises:
            ModelLoadError: the weights cannot be read.
        """
        config = recipe_config(base, recipe)
        if engine is None:
            model, dummy = recipe.load_spec()
            engine = await load_engine(config, model=model, dummy_config=dummy, dtype=engine_dtype(recipe))
        return cls(recipe, config, engine)

    async def host(self, on_failure: Callable[[LocalModel, BaseException], None], *,
                   task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open the actor system (its preflight included) and serve until ``close``.

        A failure before ``started`` raises to the starter; after it, ``on_failure`` hears of it.
        """
        started = False
        try:
            async with open_system(self.engine, self.config, served_name=self.recipe.served_name) as system:
                self.system = system
                started = True
                task_status.started()
                await self._close.wait()
        except Exception as exc:
            if not started:
                raise
            log.exception("the actor system of %s failed", self.recipe.id)
            on_failure(self, exc)
        finally:
            self.closed.set()

    async def close(self) -> None:
        """Stop the actor system (open streams should be gone by now: see ``evict``)."""
        self.admitting = False
        self._close.set()
        await self.closed.wait()

    async def release(self) -> None:
        """Drop the engine and give its memory back (the GPU's too). Shielded: it must finish."""
        engine, self.engine, self.system = self.engine, None, None
        if engine is None:  # released already
            return
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(engine.close)  # an engine process exits, its memory with it
        del engine
        gc.collect()  # the model's modules hold reference cycles
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- ServedModel ---------------------------------------------------------------------------
    @property
    def served_name(self) -> str:
        return self.recipe.served_name

    @property
    def config(self) -> ServeConfig:
        return self._config

    @property
    def tokenizer(self) -> Tokenizer:
        return self._hosted().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._hosted().max_model_len

    @property
    def vocab_size(self) -> int:
        return min(self.tokenizer.vocab_size, self.engine.vocab_size)  # ids both sides know

    @property
    def sampling_defaults(self) -> Mapping[str, float]:
        return self.recipe.sampling.defaults()

    @property
    def metrics(self) -> Metrics:
        return self._hosted().metrics

    @property
    def ready(self) -> bool:
        return self.system is not None and self.system.ready and self.admitting

    def new_request_id(self, prefix: str = "req") -> str:
        return self._hosted().new_request_id(prefix)

    def submit(self, request: GenerateRequest) -> CountedStream:
        """``SparkSystem.submit``, counted; refused with 503 once a switch has begun.

        Raises:
            SubmitError: the system refused it, or the model is being unloaded.
        """
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[CountedStream]:
        """``SparkSystem.submit_all`` (the choices of one API request, together), counted."""
        if not self.admitting or self.system is None:
            raise SubmitError(503, "model_switching", f"{self.recipe.served_name} is being unloaded; retry shortly",
                              retry_after=2.0)
        streams = [CountedStream(s, self) for s in self.system.submit_all(list(requests))]
        self._streams.update(streams)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        return streams

    def unpin(self, key: str) -> None:
        if self.system is not None:
            self.system.unpin(key)

    def _hosted(self) -> SparkSystem:
        if self.system is None:
            raise RuntimeError(f"{self.recipe.id} is not hosted (not up yet, or released)")
        return self.system

    # -- draining -----------------------------------------------------------------------------
    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def drained(self) -> None:
        """Return once no stream is open."""
        await self._idle.wait()

    def evict(self, reason: str) -> None:
        """End every open stream with an error piece saying ``reason``; later reads end at once."""
        self.eviction = reason
        for stream in list(self._streams):
            stream.cut_off()

    def kv_pages_used(self) -> float:
        if self.system is None:
            return 0.0
        return self.system.metrics.registry.get_sample_value("spark_kv_pages_used") or 0.0

    def _forget(self, stream: CountedStream) -> None:
        self._streams.discard(stream)
        if not self._streams:
            self._idle.set()


class CountedStream(GenerationStream):
    """A ``RequestStream`` that its model counts while it is open, and can cut off."""

    def __init__(self, inner: GenerationStream, owner: LocalModel):
        self.request_id = inner.request_id
        self._inner, self._owner = inner, owner
        self._waiting: trio.CancelScope | None = None
        self._last = 0  # output tokens so far
        self.finished = False

    async def __aenter__(self) -> CountedStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()  # cancels the request in the actor system if it still runs
        finally:
            self._owner._forget(self)

    def cut_off(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()

    def __aiter__(self) -> CountedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        piece = None
        if self._owner.eviction is None:
            with trio.CancelScope() as self._waiting:  # cut_off() cancels it
                try:
                    piece = await self._inner.__anext__()
                except StopAsyncIteration:
                    self.finished = True
                    raise
                finally:
                    self._waiting = None
        if piece is not None:
            return self._seen(piece)
        self.finished = True  # cut off: the request is cancelled when the reader closes the stream
        return RequestOutput(self.request_id, "", (), finish_reason="error", error=self._owner.eviction,
                             num_output_tokens=self._last)

    def _seen(self, piece: RequestOutput) -> RequestOutput:
        self._last = piece.num_output_tokens or self._last
        if piece.finish_reason is not None:
            self.finished = True
        return piece
