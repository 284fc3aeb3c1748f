"""SLAI: SLO-aware prefill budgets.

Every running stream has a time-between-tokens deadline: its last token's time plus its target
(the request's own, else the server's ``tbt_deadline``). A step's prefill budget is what the step
time model (``core/step_model.py``: seconds ~ base + per_row * decode rows + per_token * prefill
tokens, learnt online) says fits beside the step's decodes before the tightest deadline, so long
prompts are cut into chunks small enough that running streams never stall, and never below
``min_prefill_chunk``, so that prompts still move. What the model under-predicted lately (its
overrun on steps with prompt tokens, ``StepTimeModel.overrun``) is kept back from the slack. When
pages run out, the streams closest to their deadline decode first.

A target in milliseconds holds on one card and not on the next: with ``tbt_decode_factor`` the
server's target is at most that many times the step the running batch would take with no prefill
(``server_target``), so that a prompt's chunks stretch a stream's steps by a bounded share on any
GPU. A request's own ``tbt_ms`` still wins.
"""

from __future__ import annotations

import attrs

from spark.core.step_model import StepTimeModel

MARGIN = 0.9  # of the slack a step may use: the rest is the step's own host overhead and noise


def server_target(fit, running: int, tbt_deadline: float, tbt_decode_factor: float | None) -> float:
    """The server's time-between-tokens target beside ``running`` streams: ``tbt_deadline``, or less
    when ``tbt_decode_factor`` times the decode-only step that ``fit`` (``StepTime``, or None) predicts
    for them is shorter."""
    if tbt_decode_factor is None or fit is None or not running:
        return tbt_deadline
    return min(tbt_deadline, tbt_decode_factor * fit.seconds(running, 0))


def prefill_within(fit, slack: float, decode_rows: int, max_prefill_tokens: int, min_prefill_chunk: int,
                   overrun: float = 0.0) -> int:
    """The prompt tokens a step beside ``decode_rows`` decodes may take to end within ``slack`` seconds,
    as the step time ``fit`` (``StepTime``) says, ``overrun`` seconds kept back for its error: never below
    ``min_prefill_chunk``, so prompts move."""
    fits = fit.tokens_within(MARGIN * slack - overrun, decode_rows)
    return max(min_prefill_chunk, min(max_prefill_tokens, fits))


class Slai:
    def __init__(self, limits):
        self.max_prefill_tokens = limits.max_prefill_tokens
        self.tbt_deadline = limits.tbt_deadline
        self.tbt_decode_factor = limits.tbt_decode_factor
        self._target = limits.tbt_deadline  # the server's, for the running batch (``server_target``)
        self.min_prefill_chunk = limits.min_prefill_chunk
        self.step_time = StepTimeModel()
        self.last_plan: dict | None = None  # the latest budget's inputs, for the core's step_log

    def deadline(self, seq) -> float:
        target = seq.tbt if seq.tbt is not None else self._target
        return (seq.last_token_time or seq.arrival) + target

    def decode_order(self, running):
        # (planning a step starts here: the server's target for this batch holds for the whole step)
        self._target = server_target(self.step_time.fit(), len(running), self.tbt_deadline, self.tbt_decode_factor)
        return sorted(running, key=self.deadline)

    def prefill_budget(self, running, now: float, num_decodes: int) -> int:
        fit, self.last_plan = self.step_time.fit(), None
        if not running or fit is None:
            return self.max_prefill_tokens
        slack = min(self.deadline(s) for s in running) - now
        overrun = self.step_time.overrun()
        budget = prefill_within(fit, slack, num_decodes, self.max_prefill_tokens, self.min_prefill_chunk, overrun)
        self.last_plan = {"slack": slack, "overrun": overrun, "budget": budget, "fit": attrs.astuple(fit),
                          "target": self._target}
        return budget

    def observe_step(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        self.step_time.observe(decode_rows, prefill_tokens, seconds)
