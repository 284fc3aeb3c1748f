"""Deadline-aware admission: predict a request's time to first token, and refuse it when too late.

A server that queues every request silently turns overload into minutes of waiting that the client
cannot see coming. ``TtftPredictor`` predicts, at submission, when a new request's first token would
come: first the steps already planned (the core launches ``depth`` steps ahead, so a request
arriving now waits on average for the rest of the running step and the one queued behind it, as
long as the latest steps took), then the prompt tokens queued ahead of it (submitted, no first
token yet) plus its own, prefilled a step's budget at a time beside the streams that run, each
step as long as the step time model (``core/step_model.py``, learnt from the core's step shapes) says. With ``ttft_bound_s`` set, the
ingress refuses a request predicted past the bound (429, Anthropic's 529 ``overloaded_error``) with a
``Retry-After`` of the time until the queue ahead of it would fit the bound, instead of queueing it.
The prediction of every admitted request is kept, and set against its measured TTFT in the metrics
(``spark_ttft_prediction_error_ratio``).

Not modelled: a batch already full (a queued request then also waits for a stream to end), and
prefix-cache hits (a cached prompt costs fewer steps than predicted).
"""

from __future__ import annotations

import math
from collections import deque

import attrs

from spark.core.policies.slai import prefill_within
from spark.core.step_model import StepTimeModel


@attrs.frozen
class AdmissionLimits:
    """What the prediction is made from (``ServeConfig`` names them)."""

    policy: str = "slai"  # "slai": the prefill budget keeps the streams' deadline; else a fixed budget
    max_prefill_tokens: int = 512
    tbt_deadline: float = 0.2
    min_prefill_chunk: int = 16
    ttft_bound_s: float | None = None  # refuse a request predicted to wait longer; None: admit all
    depth: int = 2  # steps the core launches ahead (``Core.depth``)


class TtftPredictor:
    def __init__(self, limits: AdmissionLimits = AdmissionLimits()):
        self.limits = limits
        self.step_time = StepTimeModel()
        self.running = 0
        self._queued: dict[str, int] = {}  # submitted, no first token yet -> prompt tokens
        self._predicted: dict[str, float] = {}  # -> its predicted TTFT, while it waits
        self._recent: deque[float] = deque(maxlen=16)  # the latest steps' seconds

    def observe_core(self, running: int, steps) -> None:
        """A core snapshot: the streams running, and the steps (``StepShape``) since the last one."""
        self.running = running
        for step in steps:
            self.step_time.observe(step.decode_rows, step.prefill_tokens, step.seconds)
            self._recent.append(step.seconds)

    def in_flight(self) -> float:
        """Seconds until the steps planned before a request arriving now are done: the rest of the
        running one (half, on average) and the ``depth - 1`` queued behind it; none when idle."""
        if not (self.running or self._queued) or not self._recent:
            return 0.0
        return (self.limits.depth - 0.5) * sum(self._recent) / len(self._recent)

    def predict(self, prompt_tokens: int) -> float | None:
        """Seconds from now to the first token of a request of ``prompt_tokens``; None before the model
        has seen enough steps to tell."""
        fit = self.step_time.fit()
        if fit is None:
            return None
        limits = self.limits
        budget = limits.max_prefill_tokens
        if limits.policy == "slai" and self.running:
            budget = prefill_within(fit, limits.tbt_deadline, self.running, budget, limits.min_prefill_chunk,
                                    self.step_time.overrun())  # what SLAI keeps back, kept back here too
        ahead = sum(self._queued.values()) + prompt_tokens
        steps = math.ceil(ahead / budget)
        return self.in_flight() + steps * fit.seconds(self.running, min(budget, ahead))

    def refusal(self, prompt_tokens: int) -> tuple[float, float] | None:
        """(predicted TTFT, seconds to retry after) when the bound refuses this request, else None."""
        bound = self.limits.ttft_bound_s
        if bound is None:
            return None
        predicted = self.predict(prompt_tokens)
        if predicted is None or predicted <= bound:
            return None
        # The queue ahead drains at about the rate it is predicted to: retry once it would fit the bound.
        return predicted, max(1.0, math.ceil(predicted - bound))

    def admitted(self, request_id: str, prompt_tokens: int) -> float | None:
        """The request was queued; returns its predicted TTFT (None: no prediction yet)."""
        predicted = self.predict(prompt_tokens)
        self._queued[request_id] = prompt_tokens
        if predicted is not None:
            self._predicted[request_id] = predicted
        return predicted

    def first_token(self, request_id: str, ttft: float) -> float | None:
        """The request's first token came ``ttft`` seconds after it arrived; returns the prediction's
        relative error (None when none was made)."""
        self._queued.pop(request_id, None)
        predicted = self._predicted.pop(request_id, None)
        if predicted is None or ttft <= 0:
            return None
        return abs(predicted - ttft) / ttft

    def ended(self, request_id: str) -> None:
        """The request ended (or was cancelled) before its first token, or after: forget it."""
        self._queued.pop(request_id, None)
        self._predicted.pop(request_id, None)
