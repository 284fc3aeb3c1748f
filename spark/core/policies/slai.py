"""SLAI: SLO-aware prefill budgets.

Every running stream has a time-between-tokens deadline (its last token's time +
``tbt_deadline``). A step's prefill budget is what a cost model of the step time
(fitted online: seconds ~ a + b * tokens) says fits before the tightest deadline, so
long prompts are cut into chunks small enough that running streams never stall; when
pages run out, the streams closest to their deadline decode first.
"""

from __future__ import annotations

from collections import deque


class StepCostModel:
    """Step seconds ~ a + b * tokens, least squares over recent steps."""

    def __init__(self, window: int = 64):
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, tokens: int, seconds: float) -> None:
        self._obs.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b) or None while the data cannot tell them apart."""
        n = len(self._obs)
        if n < 2:
            return None
        mx = sum(t for t, _ in self._obs) / n
        my = sum(s for _, s in self._obs) / n
        sxx = sum((t - mx) ** 2 for t, _ in self._obs)
        if sxx == 0:
            return None
        b = sum((t - mx) * (s - my) for t, s in self._obs) / sxx
        if b <= 0:
            return None
        return max(0.0, my - b * mx), b

    def tokens_within(self, seconds: float) -> int | None:
        fit = self.fit()
        if fit is None:
            return None
        a, b = fit
        return int((seconds - a) / b)


class Slai:
    def __init__(self, limits):
        self.max_prefill_tokens = limits.max_prefill_tokens
        self.tbt_deadline = limits.tbt_deadline
        self.min_prefill_chunk = limits.min_prefill_chunk
        self.cost = StepCostModel()

    def deadline(self, seq) -> float:
        return (seq.last_token_time or seq.arrival) + self.tbt_deadline

    def decode_order(self, running):
        return sorted(running, key=self.deadline)

    def prefill_budget(self, running, now: float, num_decodes: int) -> int:
        if not running:
            return self.max_prefill_tokens
        slack = min(self.deadline(s) for s in running) - now
        fits = self.cost.tokens_within(0.9 * slack)  # keep a margin for the step's own overhead
        if fits is None:
            return self.max_prefill_tokens
        return max(self.min_prefill_chunk, min(self.max_prefill_tokens, fits - num_decodes))

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)
