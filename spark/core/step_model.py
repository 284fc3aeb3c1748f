"""How long an engine step takes, learnt online from the steps that ran.

A step's time grows with its decode rows (each reads its context's K/V and adds a row to every
matmul) and with its prefill tokens (compute), on top of a fixed part (the weights read once,
launches, the host). ``StepTimeModel`` fits ``seconds ~ base + per_row * rows + per_token * tokens``
by least squares over the latest steps; while the steps cannot tell the two slopes apart (decodes
alone), a prompt token is priced as a decode row. SLAI reads it to size a step's
prefill so that running streams keep their time between tokens (``policies/slai.py``), less the
overrun that the latest steps with prompt tokens showed beyond the fit; the ingress
reads it to predict a new request's time to first token (``actors/admission.py``).
"""

from __future__ import annotations

from collections import deque

import attrs


@attrs.frozen
class StepTime:
    """``seconds = base + per_row * decode_rows + per_token * prefill_tokens``."""

    base: float
    per_row: float
    per_token: float

    def seconds(self, decode_rows: int, prefill_tokens: int) -> float:
        return self.base + self.per_row * decode_rows + self.per_token * prefill_tokens

    def tokens_within(self, seconds: float, decode_rows: int) -> int:
        """The most prefill tokens a step beside ``decode_rows`` decodes may hold to end within ``seconds``."""
        room = seconds - self.base - self.per_row * decode_rows
        return int(room / self.per_token) if self.per_token > 0 else 1 << 30


class StepTimeModel:
    """Least squares over the latest ``window`` steps (see the module's docstring).

    The sums the fit needs are kept as steps come and go, so that a fit costs the same whatever the
    window: SLAI asks for one every step."""

    _RESUM = 4096  # steps between exact recomputations of the sums (float drift of adding and removing)

    def __init__(self, window: int = 256, ridge: float = 1e-6, overrun_quantile: float = 0.9):
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        # How much longer than the fit said the latest steps with prompt tokens took: a line cannot
        # follow every step (padding to a graph's bucket, attention over long contexts, the host), and
        # SLAI's deadlines are missed exactly where it under-predicts.
        self._overruns: deque[float] = deque(maxlen=window // 2)
        self._overrun_quantile = overrun_quantile
        self._overrun: float | None = 0.0
        self._ridge = ridge
        self._sums = [0.0] * 8  # r, t, s, rr, tt, rt, rs, ts
        self._since_resum = 0
        self._fit: StepTime | None = None
        self._stale = False

    def __len__(self) -> int:
        return len(self._steps)

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        if seconds <= 0 or not (decode_rows or prefill_tokens):
            return
        fit = self.fit() if prefill_tokens else None
        if fit is not None:  # judged by the fit that planned it, before the step joins the fit
            self._overruns.append(seconds - fit.seconds(decode_rows, prefill_tokens))
            self._overrun = None
        if len(self._steps) == self._steps.maxlen:
            self._add(*self._steps[0], sign=-1.0)
        step = (decode_rows, prefill_tokens, seconds)
        self._steps.append(step)
        self._add(*step, sign=1.0)
        self._since_resum += 1
        if self._since_resum >= self._RESUM:
            self._sums, self._since_resum = [0.0] * 8, 0
            for old in self._steps:
                self._add(*old, sign=1.0)
        self._stale = True

    def _add(self, r: int, t: int, s: float, *, sign: float) -> None:
        for i, v in enumerate((r, t, s, r * r, t * t, r * t, r * s, t * s)):
            self._sums[i] += sign * v

    def overrun(self) -> float:
        """Seconds that a step with prompt tokens took beyond the fit, at the ``overrun_quantile`` of the
        latest such steps (never below 0): what a deadline needs on top of the fit's prediction."""
        if self._overrun is None:
            ordered = sorted(self._overruns)
            self._overrun = max(0.0, ordered[min(len(ordered) - 1, int(self._overrun_quantile * len(ordered)))])
        return self._overrun

    def fit(self) -> StepTime | None:
        """The fitted model, or None before 3 steps or while every step computed as many tokens."""
        if self._stale:
            self._fit, self._stale = self._solve(), False
        return self._fit

    def _solve(self) -> StepTime | None:
        n = len(self._steps)
        if n < 3:
            return None
        r, t, s, rr, tt, rt, rs, ts = self._sums
        mr, mt, ms = r / n, t / n, s / n
        # Centred second moments; a tiny negative from rounding is a zero.
        srr, stt = max(0.0, rr - n * mr * mr), max(0.0, tt - n * mt * mt)
        srt, srs, sts = rt - n * mr * mt, rs - n * mr * ms, ts - n * mt * ms
        if srr > 1e-9 and stt > 1e-9:  # normal equations of the two slopes (the base is the intercept)
            a, d = srr * (1 + self._ridge), stt * (1 + self._ridge)
            det = a * d - srt * srt
            if det > 0:
                per_row, per_token = (srs * d - sts * srt) / det, (sts * a - srs * srt) / det
                if per_token > 0 and per_row >= 0:
                    return StepTime(max(0.0, ms - per_row * mr - per_token * mt), per_row, per_token)
        # The steps cannot tell rows from tokens yet (decodes alone, say): one slope for every token a
        # step computes, a decode row's or a prompt's, as if a prompt token cost what a decode does.
        sxx = srr + 2 * srt + stt
        if sxx <= 1e-9 or srs + sts <= 0:
            return None
        slope = (srs + sts) / sxx
        return StepTime(max(0.0, ms - slope * (mr + mt)), slope, slope)
