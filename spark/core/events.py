"""What the core says after a step: requests opened, tokens sampled, requests failed; and its metrics.

Plain frozen values, so that they cross a thread or a pipe as they are.
"""

from __future__ import annotations

from typing import Hashable

import attrs

from spark.core.plan import TokenOutput


@attrs.frozen
class Opened:
    """The core took the request from its queue: its tokens follow."""

    request_id: Hashable


@attrs.frozen
class PrefixHit:
    """The request's first prefill started past ``cached_tokens`` prompt tokens found in the prefix cache."""

    request_id: Hashable
    cached_tokens: int


@attrs.frozen
class TokenBatch:
    """The tokens one step sampled, and when (the clock of whoever reads them)."""

    outputs: tuple[TokenOutput, ...]
    time: float


@attrs.frozen
class Failed:
    """A request ended by the server (its step failed, or the KV pool is full)."""

    request_id: Hashable
    error: str
    reason: str = "error"  # the finish_reason the client sees: "error" or "length"


Event = Opened | PrefixHit | TokenBatch | Failed


@attrs.frozen
class StepShape:
    """One step as the metrics see it."""

    seconds: float
    decode_rows: int  # sequences that decoded one token
    prefill_tokens: int  # prompt tokens computed


@attrs.frozen
class CoreMetrics:
    """The core's gauges now, and what it observed since the last snapshot."""

    kv_pages_used: int
    kv_pages_total: int
    requests_running: int
    requests_waiting: int  # queued in the core (the host adds its own queue)
    queue_times: tuple[float, ...] = ()  # arrival -> first prefill chunk, per request started
    steps: tuple[StepShape, ...] = ()
    graphs: tuple[int, int] | None = None  # (decode graphs captured, planned), set by a host that captures
    prefix_cached_pages: int = 0  # pages holding a known prefix, held or evictable
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, since the last snapshot
    prefix_hit_tokens: int = 0  # of those, found cached
    prefix_evictions: int = 0  # cached pages given out again, since the last snapshot
    prefix_pinned_pages: int = 0  # pages a pin keeps cached (stored Responses, cache_control)
    # speculation since the last snapshot: (tokens drafted, of those accepted, decodes of speculating
    # sequences, tokens those emitted); () when no request speculates
    speculation: tuple[int, ...] = ()
