"""Per-API-key token buckets: requests per second and tokens per minute.

A plain object that the ingress asks synchronously (trio runs one task at a
time, so no lock is needed): an await per request would buy nothing. Keys are
kept in least-recently-used order and capped, so a flood of unique keys cannot
grow memory without bound; a forgotten key simply starts again with full buckets.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import attrs


@attrs.define
class _Bucket:
    tokens: float
    updated: float


@attrs.define
class _KeyState:
    requests: _Bucket
    budget: _Bucket


class RateLimiter:
    """Args:
        rps: requests per second per key (0: unlimited); bursts of up to ``max(1, rps)``.
        tpm: tokens per minute per key (0: unlimited); a request costs prompt + max new tokens.
        max_keys: keys tracked at most.
    """

    def __init__(self, rps: float = 0.0, tpm: float = 0.0, max_keys: int = 10_000):
        self.rps, self.tpm, self.max_keys = rps, tpm, max_keys
        self._keys: OrderedDict[str, _KeyState] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rps > 0 or self.tpm > 0

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, key: str, tokens: int, now: float) -> float | None:
        """Take one request and ``tokens`` tokens from ``key``'s buckets (nothing when refused).

        One API request is one request here, however many choices (``n``) it asks for;
        its tokens are those of every choice.

        Returns:
            None when admitted; otherwise the seconds after which it would be.
        """
        if not self.enabled:
            return None
        state = self._keys.pop(key, None)
        if state is None:
            state = _KeyState(_Bucket(self._request_capacity, now), _Bucket(self.tpm, now))
        self._keys[key] = state  # most recently used last
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        waits = []
        if self.rps > 0:
            waits.append(_wait(state.requests, 1.0, self._request_capacity, self.rps, now))
        if self.tpm > 0:
            if tokens > self.tpm:
                return math.inf  # never fits; the caller reports a 429 with a long Retry-After
            waits.append(_wait(state.budget, tokens, self.tpm, self.tpm / 60.0, now))
        wait = max(waits)
        if wait > 0:
            return wait
        state.requests.tokens -= 1.0 if self.rps > 0 else 0.0
        state.budget.tokens -= tokens if self.tpm > 0 else 0.0
        return None

    @property
    def _request_capacity(self) -> float:
        return max(1.0, self.rps)


def _wait(bucket: _Bucket, cost: float, capacity: float, rate: float, now: float) -> float:
    """Refill ``bucket`` to ``now``; return how long until it holds ``cost`` (0 if it does)."""
    bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * rate)
    bucket.updated = now
    return max(0.0, (cost - bucket.tokens) / rate)
