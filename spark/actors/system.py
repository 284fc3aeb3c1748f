"""The wiring: every actor and channel of Spark, top to bottom.

    HTTP handler --submit()--> ingress --admissions--> host ==transport==> core loop
                                                        |  <==Out========'  (a thread, or the
                      handler/streamer --cancels--------'                    engine process)
                                                        '--stream--> streamer --pieces--> handler

The core (``spark.core.Core``: scheduler, pages, engine) runs in a busy loop of its
own, beside the engine: in a thread when the engine is in this process, or as the
engine process's main loop. ``spark.actors.host.run_host`` is this side of either.

Use:

    async with open_system(engine, config) as system:
        stream = system.submit(GenerateRequest(...))      # raises SubmitError at once when refused
        async with stream:                                 # leaving early cancels the request
            async for piece in stream:                     # RequestOutput pieces; the last has finish_reason
                ...
"""

from __future__ import annotations

import itertools
import logging
import math
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from spark.actors import streamer
from spark.actors.admission import AdmissionLimits, TtftPredictor
from spark.actors.engine_process import EngineProcess
from spark.actors.host import ThreadTransport, Transport, run_host
from spark.actors.ingress import Ingress, RequestStream, SubmitError
from spark.actors.messages import GenerateRequest
from spark.actors.rate_limiter import RateLimiter
from spark.core.core import DEFAULT_DEPTH
from spark.core.interfaces import LoadedEngine, StepEngine
from spark.engine.sampling import SamplingParams
from spark.metrics import Metrics, ThroughputLog
from spark.serve_config import ServeConfig

__all__ = ["SparkSystem", "SubmitError", "open_system"]

log = logging.getLogger("spark.system")


class SparkSystem:
    """What the HTTP layer holds: ``submit``, the tokenizer, names, limits, health and metrics."""

    def __init__(self, ingress: Ingress, *, engine: LoadedEngine, config: ServeConfig, metrics: Metrics,
                 served_name: str):
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

    def submit_all(self, requests: list[GenerateRequest]) -> list[RequestStream]:
        """The ``n`` choices of one API request: queued, rate-limited and refused together."""
        return self._ingress.submit_all(requests)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def unpin(self, key: str) -> None:
        """End the prefix pin under ``key`` (a request's ``pin``) in the core; best effort, never waits."""
        self._ingress.unpin(key)

    async def preflight(self) -> None:
        """One real request through every actor and one engine step; raises if it fails."""
        prompt = (self.tokenizer.bos_token_id or 0,) if self.tokenizer else (0,)
        request = GenerateRequest(self.new_request_id("preflight"), prompt, SamplingParams(temperature=0.0, max_tokens=1))
        async with self.submit(request) as stream:
            async for piece in stream:
                if piece.finish_reason == "error":
                    raise RuntimeError(f"preflight failed: {piece.error}")
        self.ready = True


THROUGHPUT_LOG_S = 10.0  # how often a busy server logs its throughput (INFO)


async def _log_throughput(metrics: Metrics, every_s: float) -> None:
    throughput = ThroughputLog(metrics, trio.current_time())
    while True:
        await trio.sleep(every_s)
        line = throughput.line(trio.current_time())
        if line is not None and log.isEnabledFor(logging.INFO):
            log.info("throughput: %s", line)


@asynccontextmanager
async def open_system(
    engine: EngineProcess | StepEngine,
    config: ServeConfig,
    *,
    served_name: str | None = None,
) -> AsyncIterator[SparkSystem]:
    """Start the actors around ``engine``; stop them when the block ends.

    Args:
        engine: an ``EngineProcess`` (its core runs there), or an engine of this process
            (``spark.engine.Engine``, or a test's double): its core runs in a thread.
        config: limits and policies (``ServeConfig``).
    """
    metrics = Metrics(TtftPredictor(AdmissionLimits(config.scheduler, config.max_prefill_tokens,
                                                    config.tbt_deadline_ms / 1000.0, ttft_bound_s=config.ttft_bound_s,
                                                    depth=config.scheduler_depth or DEFAULT_DEPTH)))
    transport: Transport = engine.transport() if isinstance(engine, EngineProcess) else ThreadTransport(engine)
    admissions_send, admissions_recv = trio.open_memory_channel(config.max_waiting)
    cancels_send, cancels_recv = trio.open_memory_channel(1024)
    # The core's events come in from a thread, which may not wait: unbounded.
    stream_send, stream_recv = trio.open_memory_channel(math.inf)
    num_pages = engine.num_pages - 1  # page 0 is the allocator's scratch page

    async with trio.open_nursery() as nursery:
        await nursery.start(run_host, transport, config, admissions_recv, cancels_recv, stream_send, metrics)
        await nursery.start(streamer.run, engine.tokenizer, stream_recv, cancels_send.clone(), metrics)
        ingress = Ingress(
            admissions_send,
            cancels_send,
            max_model_len=engine.max_model_len,
            max_tokens_in_cache=num_pages * engine.page_size,
            vocab_size=engine.vocab_size,
            rate_limiter=RateLimiter(config.rate_limit_rps, config.rate_limit_tpm, config.rate_limit_max_keys),
            metrics=metrics,
        )
        system = SparkSystem(
            ingress, engine=engine, config=config, metrics=metrics,
            served_name=served_name or config.resolved_served_name(),
        )
        await system.preflight()
        nursery.start_soon(_log_throughput, metrics, THROUGHPUT_LOG_S)
        log.info("actors up: policy=%s max_batch=%d pages=%d depth=%s core=%s", config.scheduler,
                 config.max_batch_size, num_pages, config.scheduler_depth or "default",
                 "process" if isinstance(engine, EngineProcess) else "thread")
        try:
            yield system
        finally:
            nursery.cancel_scope.cancel()
