"""Scheduling policies: what differs between FIFO and SLAI, behind one small protocol.

The ``Scheduler`` (``spark.core.scheduler``) does what every policy shares: queues,
pages, preemption, counting a planned step as done. A policy answers two questions
per step: in which order running sequences decode (it matters only when pages run
out), and how many prompt tokens the step may prefill. To add one: a module here
with a class that has ``decode_order``, ``prefill_budget`` and ``observe_step``, and
one line in ``POLICIES``.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import attrs

from spark.core.policies.fifo import Fifo
from spark.core.policies.slai import Slai
from spark.core.scheduler import SeqState


@attrs.frozen
class Limits:
    """What a policy is built from (``ServeConfig`` names them)."""

    max_prefill_tokens: int = 512  # prompt tokens per step, at most
    tbt_deadline: float = 0.2  # seconds between two tokens of a stream (SLAI's target, unless a request sets its own)
    min_prefill_chunk: int = 16  # SLAI never cuts a prompt chunk below this


class Policy(Protocol):
    last_plan: dict | None  # what the latest ``prefill_budget`` was made from, for the core's step log (or None)

    def decode_order(self, running: Sequence[SeqState]) -> list[SeqState]:
        """The running sequences in the order they get decode pages (the last may be preempted)."""

    def prefill_budget(self, running: Sequence[SeqState], now: float, num_decodes: int) -> int:
        """Prompt tokens this step may compute besides its ``num_decodes`` decodes."""

    def observe_step(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """A step of ``decode_rows`` decodes (verifications included) and ``prefill_tokens`` took ``seconds``."""


POLICIES: dict[str, type] = {"fifo": Fifo, "slai": Slai}


def make_policy(name: str, limits: Limits = Limits()) -> Policy:
    """The policy registered as ``name``, built from ``limits``.

    Raises:
        ValueError: no policy has that name.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} ({', '.join(POLICIES)})") from None
    return cls(limits)
