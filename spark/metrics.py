"""Prometheus metrics of one actor system, in a registry of its own (tests run several)."""

from __future__ import annotations

import collections
import statistics

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from spark.actors.admission import TtftPredictor

# Fine around 20-100 ms, where time-between-token targets (SLAI's) and their misses lie.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5,
                    10, 30, 60)

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.2, 0.5, 1)
_ROW_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512)
_PREFILL_BUCKETS = (0, 128, 512, 1024, 2048, 4096, 8192, 16384)
# A step's prompt tokens as a label of its time: which kind of step misses a time-between-tokens
# target (the largest class is past the piecewise CUDA graphs' biggest bucket, 2048 tokens).
_PREFILL_CLASSES = ((0, "0"), (128, "1-128"), (512, "129-512"), (2048, "513-2048"))


def prefill_class(tokens: int) -> str:
    """The ``prefill`` label of a step that computed ``tokens`` prompt tokens."""
    return next((name for bound, name in _PREFILL_CLASSES if tokens <= bound), ">2048")


class QueueWaits:
    """How long the latest requests waited in the queue: what a refused one is told to wait (``Retry-After``).

    A request refused because the queue is full would wait about as long as the ones that just left
    it; when none left it lately, at least as long as it has been since the last one did.
    """

    def __init__(self, remembered: int = 16) -> None:
        self._waits: collections.deque[float] = collections.deque(maxlen=remembered)
        self._last_start: float | None = None

    def started(self, waited_s: float, now: float) -> None:
        self._waits.append(waited_s)
        self._last_start = now

    def expected_wait(self, now: float) -> float:
        """Seconds until a place in the queue is likely to serve, 1 at least."""
        recent = statistics.median(self._waits) if self._waits else 0.0
        stalled = now - self._last_start if self._last_start is not None else 0.0
        return max(1.0, recent, stalled)


class Metrics:
    def __init__(self, ttft: TtftPredictor | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_waits = QueueWaits()  # not exported: the ingress's Retry-After
        self.ttft = ttft or TtftPredictor()  # not exported: the ingress's admission
        self.ttft_predicted = Histogram(
            "spark_ttft_predicted_seconds", "Time to first token predicted at admission", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.ttft_prediction_error = Histogram(
            "spark_ttft_prediction_error_ratio", "|predicted - measured| / measured time to first token",
            buckets=(0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1, 2, 5), registry=r)
        self.refused_overloaded = Counter(
            "spark_requests_refused_overloaded", "Requests refused: their predicted TTFT passed the bound", registry=r)
        self.time_to_first_token = Histogram(
            "spark_time_to_first_token_seconds", "Arrival to first generated token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "spark_inter_token_latency_seconds", "Gap between consecutive tokens of a stream", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e_request_latency = Histogram(
            "spark_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "spark_queue_time_seconds", "Arrival to the start of prefill", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.requests_running = Gauge("spark_requests_running", "Sequences being computed", registry=r)
        self.requests_waiting = Gauge("spark_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_pages_used = Gauge("spark_kv_pages_used", "KV cache pages held by sequences", registry=r)
        self.kv_pages_total = Gauge("spark_kv_pages_total", "KV cache pages in the pool", registry=r)
        # The engine captures its decode graphs in the background once serving: until these
        # two meet, some batch sizes still decode eagerly (slower).
        self.decode_graphs_captured = Gauge(
            "spark_decode_graphs_captured", "Decode batch sizes whose CUDA graph is captured", registry=r)
        self.decode_graphs_planned = Gauge(
            "spark_decode_graphs_planned", "Decode batch sizes the engine captures CUDA graphs for", registry=r)
        self.prefix_cached_pages = Gauge(
            "spark_prefix_cache_pages", "KV pages holding a known prompt prefix, held or evictable", registry=r)
        self.prefix_queried_tokens = Counter(
            "spark_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hit_tokens = Counter(
            "spark_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not computed)", registry=r)
        self.prefix_pinned_pages = Gauge(
            "spark_prefix_cache_pinned_pages", "KV pages a pin keeps cached (stored Responses, cache_control)",
            registry=r)
        self.prefix_evictions = Counter(
            "spark_prefix_cache_evictions", "Cached pages given out again for other tokens", registry=r)
        # Speculative decoding: acceptance rate = accepted / drafted; tokens per step of a speculating
        # sequence = emitted / steps (1 without speculation).
        self.spec_drafted_tokens = Counter(
            "spark_spec_drafted_tokens", "Tokens drafted for speculative decoding", registry=r)
        self.spec_accepted_tokens = Counter(
            "spark_spec_accepted_tokens", "Drafted tokens accepted (emitted)", registry=r)
        self.spec_steps = Counter(
            "spark_spec_steps", "Decode steps of speculating sequences (with a draft or not)", registry=r)
        self.spec_emitted_tokens = Counter(
            "spark_spec_emitted_tokens", "Tokens those steps emitted", registry=r)
        self.prompt_tokens = Counter("spark_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("spark_generation_tokens", "Tokens generated", registry=r)
        # What each engine step held and took: the shape of the batches explains throughput.
        self.step_seconds = Histogram(
            "spark_step_seconds", "Time between consecutive engine step results", buckets=_STEP_BUCKETS, registry=r
        )
        self.step_decode_rows = Histogram(
            "spark_step_decode_rows", "Sequences decoding one token in a step", buckets=_ROW_BUCKETS, registry=r
        )
        self.step_prefill_tokens = Histogram(
            "spark_step_prefill_tokens", "Prompt tokens computed in a step", buckets=_PREFILL_BUCKETS, registry=r
        )
        self.step_seconds_by_prefill = Histogram(
            "spark_step_seconds_by_prefill", "Step time by the prompt tokens the step computed", ["prefill"],
            buckets=_STEP_BUCKETS, registry=r
        )


class ThroughputLog:
    """vLLM's periodic line, from the counters: tokens per second since the last line, and the queue.

    ``line(now)`` is None while nothing runs, waits or moved, so an idle server logs nothing."""

    def __init__(self, metrics: Metrics, now: float) -> None:
        self._metrics = metrics
        self._last = (now, *self._totals())

    def _totals(self) -> tuple[float, float]:
        get = self._metrics.registry.get_sample_value
        return get("spark_prompt_tokens_total") or 0.0, get("spark_generation_tokens_total") or 0.0

    def line(self, now: float) -> str | None:
        get = self._metrics.registry.get_sample_value
        then, prompt_then, generated_then = self._last
        prompt, generated = self._totals()
        self._last = (now, prompt, generated)
        running, waiting = get("spark_requests_running") or 0, get("spark_requests_waiting") or 0
        if prompt == prompt_then and generated == generated_then and not running and not waiting:
            return None
        seconds = max(now - then, 1e-9)
        used, total = get("spark_kv_pages_used") or 0, get("spark_kv_pages_total") or 0
        return (f"prompt {(prompt - prompt_then) / seconds:.1f} tok/s, generation {(generated - generated_then) / seconds:.1f} "
                f"tok/s, running {running:.0f}, waiting {waiting:.0f}, KV pages {used:.0f}/{total:.0f} "
                f"({100 * used / max(total, 1):.0f}%)")
