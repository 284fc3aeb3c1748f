"""SLAI: SLO-aware prefill budgets.

Every running stream has a time-between-tokens deadline: its last token's time plus its target
(the request's own, else the server's ``tbt_deadline``). A step's prefill budget is what the step
time model (``core/step_model.py``: seconds ~ base + per_row * decode rows + per_token * prefill
tokens, learnt online) says fits beside the step's decodes before the tightest deadline, so long
prompts are cut into chunks small enough that running streams never stall, and never below
``min_prefill_chunk``, so that prompts still move. What the model under-predicted lately (its
overrun on steps with prompt tokens, ``StepTimeModel.overrun``) is kept back from the slack. When
pages run out, the streams closest to their deadline decode first.
"""

from __future__ import annotations

import attrs

from spark.core.step_model import StepTimeModel

MARGIN = 0.9  # of the slack a step may use: the rest is the step's own host overhead and noise


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
        self.min_prefill_chunk = limits.min_prefill_chunk
        self.step_time = StepTimeModel()
        self.last_plan: dict | None = None  # the latest budget's inputs, for the core's step_log

    def deadline(self, seq) -> float:
        target = seq.tbt if seq.tbt is not None else self.tbt_deadline
        return (seq.last_token_time or seq.arrival) + target

    def decode_order(self, running):
        return sorted(running, key=self.deadline)

    def prefill_budget(self, running, now: float, num_decodes: int) -> int:
        fit, self.last_plan = self.step_time.fit(), None
        if not running or fit is None:
            return self.max_prefill_tokens
        slack = min(self.deadline(s) for s in running) - now
        overrun = self.step_time.overrun()
        budget = prefill_within(fit, slack, num_decodes, self.max_prefill_tokens, self.min_prefill_chunk, overrun)
        self.last_plan = {"slack": slack, "overrun": overrun, "budget": budget, "fit": attrs.astuple(fit)}
        return budget

    def observe_step(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        self.step_time.observe(decode_rows, prefill_tokens, seconds)
