"""Continuous batching: which tokens of which sequences run next, and whose pages they use.

Each step decodes every running sequence once and fills the prefill budget with
(chunks of) waiting prompts; the ``Policy`` (``spark.core.policies``) decides the
decode order and that budget. KV pages come from the ``PageAllocator`` this object
owns: claimed when a prefill starts, grown as tokens come, released on every end.
When a decode cannot get a page, the newest running sequence is preempted (its
pages freed, its tokens recomputed later).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Hashable, Iterable

import attrs

from spark.core.page_allocator import PageAllocator
from spark.core.plan import Chunk

if TYPE_CHECKING:
    from spark.core.policies import Policy


@attrs.define(eq=False)
class SeqState:
    """The scheduler's view of one request."""

    request_id: Hashable
    num_tokens: int  # known tokens: prompt, then + each sampled token
    arrival: float
    num_computed: int = 0  # tokens whose K/V are in the cache
    prompt_len: int = 0
    last_token_time: float | None = None
    started: float | None = None  # when its first prefill chunk was scheduled


class Scheduler:
    def __init__(self, allocator: PageAllocator, policy: "Policy", *, max_batch_size: int = 64):
        self.allocator = allocator
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.waiting: deque[SeqState] = deque()  # admitted, prefill not finished (or preempted)
        self.running: list[SeqState] = []  # decoding
        self.preempted: list[Hashable] = []  # since the last schedule(): their cache must be recomputed
        self._seqs: dict[Hashable, SeqState] = {}

    # -- membership -------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_room(self) -> bool:
        return self.num_active < self.max_batch_size

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._seqs

    def seq(self, request_id: Hashable) -> SeqState:
        return self._seqs[request_id]

    def add(self, seq: SeqState) -> None:
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, request_id: Hashable) -> bool:
        """Drop a request wherever it is and release its pages. Returns whether it was here."""
        self.allocator.free(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        (self.running if seq in self.running else self.waiting).remove(seq)
        return True

    # -- planning ---------------------------------------------------------
    def schedule(self, now: float) -> list[Chunk]:
        """The next step: decodes first (in the policy's order), then prefill chunks."""
        self.preempted = []
        plan: list[Chunk] = []
        planned: set[int] = set()
        for seq in self.policy.decode_order(self.running):
            if seq not in self.running:
                continue  # preempted by an earlier iteration
            table = self._grow_or_preempt(seq, seq.num_tokens, planned)
            if table is not None:
                plan.append(Chunk(seq.request_id, 1, table))
                planned.add(id(seq))
        budget = self.policy.prefill_budget(self.running, now, len(plan))
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
            plan.append(Chunk(seq.request_id, n, table))
            budget -= n
            if n < left:
                break  # a partial chunk used the budget or the pages
        self._count_as_done(plan, now)
        return plan

    def _count_as_done(self, plan: list[Chunk], now: float) -> None:
        """Advance each planned sequence as if its step ran, so the next step can be planned at once.

        A chunk that reaches a sequence's last known token samples one more, and a
        prompt that is fully computed starts decoding. An end (EOS, max_tokens)
        is learnt from the step's result, one step later: that sequence is
        planned once more, and the engine drops it.
        """
        for chunk in plan:
            seq = self._seqs[chunk.seq_id]
            seq.num_computed += chunk.num_tokens
            if seq.num_computed == seq.num_tokens:
                seq.num_tokens += 1
                if seq in self.waiting:
                    self.waiting.remove(seq)
                    self.running.append(seq)
                    if seq.last_token_time is None:
                        seq.last_token_time = now  # its deadlines count from its first token, due now

    def on_step_done(self, planned: Iterable[Chunk], sampled: Iterable[Hashable], now: float, seconds: float) -> None:
        """Account a finished step: its time (for the policy) and when its tokens came."""
        planned = list(planned)
        self.policy.observe_step(sum(c.num_tokens for c in planned), seconds)
        for seq_id in sampled:
            seq = self._seqs.get(seq_id)
            if seq is not None:
                seq.last_token_time = now

    def release_stalled(self) -> tuple[list[Hashable], SeqState | None]:
        """Nothing could be planned: no sequence runs and the head of the queue cannot get pages.

        Partial prefills of the other waiting sequences hold the pages: release them
        (they recompute later). Returns (the sequences released, the head when it can
        still never start: it cannot fit, and must fail).
        """
        if self.running or not self.waiting:
            return [], None
        head = self.waiting[0]
        released = []
        for seq in list(self.waiting)[1:]:
            if self.allocator.has(seq.request_id):
                self.allocator.free(seq.request_id)
                seq.num_computed = 0
                released.append(seq.request_id)
        if self.allocator.can_allocate(head.request_id, head.num_computed + 1):
            return released, None
        return released, head

    # -- helpers ----------------------------------------------------------
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
