"""Continuous batching as a pure object: which tokens of which sequences run next.

No trio, no torch: the scheduler actor drives it, tests build it in one line.
Each step decodes every running sequence once and fills the prefill budget
with (chunks of) waiting prompts. Two policies:

- ``fifo``: a fixed prefill budget of ``max_prefill_tokens`` per step, in arrival order.
- ``slai``: SLO-aware. Every running stream has a time-between-tokens deadline
  (its last token's time + ``tbt_deadline``). The prefill budget of a step is
  what a cost model of the step time (fitted online: seconds ~ a + b * tokens)
  says fits before the tightest deadline, so long prompts are cut into chunks
  small enough that running streams never stall; when the batch is full, the
  streams closest to their deadline go first.

The KV pages come from a ``PageAllocator`` this object owns for the actor:
claimed when a prefill starts, grown as tokens come, released on every end.
When a decode cannot get a page, the newest running sequence is preempted
(its pages freed, its tokens recomputed later).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import attrs

from spark.core.page_allocator import PageAllocator


@attrs.define(eq=False)
class SeqState:
    """The scheduler's view of one request."""

    request_id: str
    num_tokens: int  # known tokens: prompt, then + each sampled token
    arrival: float
    num_computed: int = 0  # tokens whose K/V are in the cache
    prompt_len: int = 0
    last_token_time: float | None = None
    started: float | None = None  # when its first prefill chunk was scheduled


@attrs.frozen
class Scheduled:
    seq: SeqState
    num_tokens: int
    block_table: tuple[int, ...]


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


class SchedulerPolicy:
    def __init__(
        self,
        allocator: PageAllocator,
        *,
        policy: str = "slai",
        max_batch_size: int = 64,
        max_prefill_tokens: int = 512,
        tbt_deadline: float = 0.2,
        min_prefill_chunk: int = 16,
    ):
        if policy not in ("fifo", "slai"):
            raise ValueError(f"unknown scheduling policy {policy!r} (fifo, slai)")
        self.allocator = allocator
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.tbt_deadline = tbt_deadline
        self.min_prefill_chunk = min_prefill_chunk
        self.cost = StepCostModel()
        self.waiting: deque[SeqState] = deque()  # admitted, prefill not finished (or preempted)
        self.running: list[SeqState] = []  # decoding
        self.preempted: list[str] = []  # since the last schedule(): their cache must be recomputed

    @classmethod
    def from_config(cls, allocator: PageAllocator, config) -> "SchedulerPolicy":
        """The policy a ``ServeConfig`` names, with its batch, prefill and deadline limits."""
        return cls(allocator, policy=config.scheduler, max_batch_size=config.max_batch_size,
                   max_prefill_tokens=config.max_prefill_tokens, tbt_deadline=config.tbt_deadline_ms / 1000.0)

    # -- membership -------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_room(self) -> bool:
        return self.num_active < self.max_batch_size

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def finish(self, request_id: str) -> bool:
        """Drop a request wherever it is and release its pages. Returns whether it was here."""
        self.allocator.free(request_id)
        for queue in (self.waiting, self.running):
            for s in queue:
                if s.request_id == request_id:
                    queue.remove(s)
                    return True
        return False

    # -- planning ---------------------------------------------------------
    def schedule(self, now: float) -> list[Scheduled]:
        """The next step: decodes first (closest deadline first under slai), then prefill chunks."""
        self.preempted = []
        plan: list[Scheduled] = []
        decodes = sorted(self.running, key=self._deadline) if self.policy == "slai" else list(self.running)
        planned: set[int] = set()
        for seq in decodes:
            if seq not in self.running:
                continue  # preempted by an earlier iteration
            table = self._grow_or_preempt(seq, seq.num_tokens, planned)
            if table is not None:
                plan.append(Scheduled(seq, 1, table))
                planned.add(id(seq))
        budget = self._prefill_budget(now, len(plan))
        for seq in list(self.waiting):
            if budget <= 0:
                break
            left = seq.num_tokens - seq.num_computed
            n = min(left, budget)
            target = seq.num_computed + n
            if not self.allocator.can_allocate(seq.request_id, target):
                n = self._tokens_that_fit(seq)
                if n <= 0:
                    break  # keep arrival order: later prompts wait behind this one
                target = seq.num_computed + n
            table = self._claim(seq, target)
            if seq.started is None:
                seq.started = now
            plan.append(Scheduled(seq, n, table))
            budget -= n
            if n < left:
                break  # a partial chunk used the budget or the pages
        self._count_as_done(plan, now)
        return plan

    def _count_as_done(self, plan: list[Scheduled], now: float) -> None:
        """Advance each planned sequence as if its step ran, so the next step can be planned at once.

        A chunk that reaches a sequence's last known token samples one more, and a
        prompt that is fully computed starts decoding. An end (EOS, max_tokens)
        is learnt from the step's result, one step later: that sequence is
        planned once more, and the engine drops it.
        """
        for p in plan:
            seq = p.seq
            seq.num_computed += p.num_tokens
            if seq.num_computed == seq.num_tokens:
                seq.num_tokens += 1
                if seq in self.waiting:
                    self.waiting.remove(seq)
                    self.running.append(seq)
                    if seq.last_token_time is None:
                        seq.last_token_time = now  # its deadlines count from its first token, due now

    def on_step_done(self, planned: Iterable[Scheduled], sampled: Iterable[str], now: float, seconds: float) -> None:
        """Account a finished step: its time (for the cost model) and when its tokens came."""
        planned = list(planned)
        self.cost.observe(sum(p.num_tokens for p in planned), seconds)
        sampled = set(sampled)
        for p in planned:
            if p.seq.request_id in sampled:
                p.seq.last_token_time = now

    # -- helpers ----------------------------------------------------------
    def _deadline(self, seq: SeqState) -> float:
        return (seq.last_token_time or seq.arrival) + self.tbt_deadline

    def _prefill_budget(self, now: float, num_decodes: int) -> int:
        if self.policy == "fifo" or not self.running:
            return self.max_prefill_tokens
        slack = min(self._deadline(s) for s in self.running) - now
        fits = self.cost.tokens_within(0.9 * slack)  # keep a margin for the step's own overhead
        if fits is None:
            return self.max_prefill_tokens
        return max(self.min_prefill_chunk, min(self.max_prefill_tokens, fits - num_decodes))

    def _tokens_that_fit(self, seq: SeqState) -> int:
        """Prompt tokens of ``seq`` that the free pages can hold now."""
        held = len(self.allocator.block_table(seq.request_id)) if self.allocator.has(seq.request_id) else 0
        capacity = (held + self.allocator.num_free) * self.allocator.page_size
        return min(seq.num_tokens, capacity) - seq.num_computed

    def _claim(self, seq: SeqState, num_tokens: int) -> tuple[int, ...]:
        if self.allocator.has(seq.request_id):
            return self.allocator.append(seq.request_id, num_tokens)
        return self.allocator.allocate(seq.request_id, num_tokens)

    def _grow_or_preempt(self, seq: SeqState, num_tokens: int, planned: set[int]) -> tuple[int, ...] | None:
        """Pages for a decode, preempting the newest running sequences not yet planned if need be."""
        while not self.allocator.can_allocate(seq.request_id, num_tokens):
            others = (s for s in self.running if s is not seq and id(s) not in planned)
            victim = max(others, key=lambda s: s.arrival, default=None)
            if victim is None:
                victim = seq
            self._preempt(victim)
            if victim is seq:
                return None
        return self._claim(seq, num_tokens)

    def _preempt(self, seq: SeqState) -> None:
        self.allocator.free(seq.request_id)
        self.running.remove(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.preempted.append(seq.request_id)
