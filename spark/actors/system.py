"""The wiring: every actor and channel of Spark, top to bottom.

    HTTP handler --submit()--> ingress --admissions--> scheduler --work--> GPU runner
                                                        ^   |  <--results--'
                      handler/streamer --cancels--------'   '--stream--> streamer --pieces--> handler

With an engine process (``EngineProcess.run_core``), the scheduler and the GPU runner
run there, next to the engine, on an event loop of their own; here its ``run_core``
stands in their place between the admissions, the cancels and the stream.

Use:

    async with open_system(engine, config) as system:
        stream = system.submit(GenerateRequest(...))      # raises SubmitError at once when refused
        async with stream:                                 # leaving early cancels the request
            async for piece in stream:                     # RequestOutput pieces; the last has finish_reason
                ...
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from spark.actors import gpu_runner, scheduler, streamer
from spark.actors.ingress import Ingress, RequestStream, SubmitError
from spark.actors.messages import GenerateRequest
from spark.actors.rate_limiter import RateLimiter
from spark.actors.scheduler_policy import SchedulerPolicy
from spark.engine.sampling import SamplingParams
from spark.metrics import Metrics
from spark.serve_config import ServeConfig

__all__ = ["SparkSystem", "SubmitError", "open_system"]

log = logging.getLogger("spark.system")


class SparkSystem:
    """What the HTTP layer holds: ``submit``, the tokenizer, names, limits, health and metrics."""

    def __init__(self, ingress: Ingress, *, engine, config: ServeConfig, metrics: Metrics, served_name: str):
        self._ingress = ingress
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.config = config
        self.metrics = metrics
        self.served_name = served_name
        self.ready = False
        self._ids = itertools.count()

    def submit(self, request: GenerateRequest) -> RequestStream:
        return self._ingress.submit(request)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def preflight(self) -> None:
        """One real request through every actor and one engine step; raises if it fails."""
        prompt = (self.tokenizer.bos_token_id or 0,) if self.tokenizer else (0,)
        request = GenerateRequest(self.new_request_id("preflight"), prompt, SamplingParams(temperature=0.0, max_tokens=1))
        async with self.submit(request) as stream:
            async for piece in stream:
                if piece.finish_reason == "error":
                    raise RuntimeError(f"preflight failed: {piece.error}")
        self.ready = True


@asynccontextmanager
async def open_system(
    engine,
    config: ServeConfig,
    *,
    execute: gpu_runner.Executor | None = None,
    served_name: str | None = None,
) -> AsyncIterator[SparkSystem]:
    """Start the actors around ``engine``; stop them when the block ends.

    Args:
        engine: a loaded ``spark.engine.Engine`` (or a double with its verbs).
        config: limits and policies (``ServeConfig``).
        execute: how a step runs; by default in a worker thread. Simulations pass
            one that advances a mock clock instead.
    """
    metrics = Metrics()
    allocator = engine.new_page_allocator()
    run_core = getattr(engine, "run_core", None)  # an EngineProcess schedules and steps in its process
    admissions_send, admissions_recv = trio.open_memory_channel(config.max_waiting)
    cancels_send, cancels_recv = trio.open_memory_channel(1024)
    # An engine process's results come in from a thread, which may not wait: unbounded.
    stream_send, stream_recv = trio.open_memory_channel(math.inf if run_core is not None else 256)

    async with trio.open_nursery() as nursery:
        if run_core is not None:
            await nursery.start(run_core, config, admissions_recv, cancels_recv, stream_send, metrics)
        else:
            depth = config.scheduler_depth or scheduler.DEFAULT_DEPTH
            work_send, work_recv = trio.open_memory_channel(depth)  # a turn of the scheduler may plan every step ahead
            # Room for every step in flight: the engine's thread hands results in without waiting.
            results_send, results_recv = trio.open_memory_channel(depth)
            if execute is not None:
                await nursery.start(gpu_runner.run, execute, work_recv, results_send)
            else:
                can_capture = getattr(engine, "enable_cuda_graphs", None)  # engine doubles have no GPU path
                capture = engine.capture_next_graph if can_capture and can_capture(config.max_batch_size) else None
                on_captured = None if capture is None else gpu_runner.graph_gauges(metrics, engine)
                await nursery.start(
                    functools.partial(gpu_runner.run_in_thread, capture_next=capture, on_captured=on_captured),
                    engine, work_recv, results_send,
                )
            await nursery.start(functools.partial(
                scheduler.run, SchedulerPolicy.from_config(allocator, config), admissions_recv, cancels_recv,
                work_send, results_recv, stream_send, metrics, depth=depth,
            ))
        await nursery.start(streamer.run, engine.tokenizer, stream_recv, cancels_send.clone(), metrics)
        ingress = Ingress(
            admissions_send,
            cancels_send,
            max_model_len=engine.max_model_len,
            max_tokens_in_cache=allocator.num_total * allocator.page_size,
            vocab_size=engine.vocab_size,
            rate_limiter=RateLimiter(config.rate_limit_rps, config.rate_limit_tpm, config.rate_limit_max_keys),
            metrics=metrics,
        )
        system = SparkSystem(
            ingress, engine=engine, config=config, metrics=metrics,
            served_name=served_name or config.resolved_served_name(),
        )
        await system.preflight()
        log.info("actors up: policy=%s max_batch=%d pages=%d depth=%s engine=%s", config.scheduler,
                 config.max_batch_size, allocator.num_total, config.scheduler_depth or scheduler.DEFAULT_DEPTH,
                 "process" if run_core is not None else "thread")
        try:
            yield system
        finally:
            nursery.cancel_scope.cancel()
