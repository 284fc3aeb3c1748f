"""FIFO: a fixed prefill budget per step, running sequences decode in arrival order."""

from __future__ import annotations


class Fifo:
    last_plan = None  # nothing of its budget to report to the step log: it is fixed

    def __init__(self, limits):
        self.max_prefill_tokens = limits.max_prefill_tokens

    def decode_order(self, running):
        return list(running)

    def prefill_budget(self, running, now: float, num_decodes: int) -> int:
        return self.max_prefill_tokens

    def observe_step(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        pass
