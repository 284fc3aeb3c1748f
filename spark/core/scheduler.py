"""Continuous batching: which tokens of which sequences run next, and whose pages they use.

Each step decodes every running sequence once and fills the prefill budget with
(chunks of) waiting prompts; the ``Policy`` (``spark.core.policies``) decides the
decode order and that budget. KV pages come from the ``PageAllocator`` this object
owns: claimed when a prefill starts, grown as tokens come, released on every end.
When a decode cannot get a page, the newest running sequence is preempted (its
pages freed, its tokens recomputed later).

With prefix caching, a prompt's full pages are registered in the allocator as their
chunks are planned, and a sequence that starts (or restarts, after preemption) maps the
longest cached run of its prompt's pages instead of computing them: ``prefix_hits`` tells
the engine where its computing starts. At least one token is always computed, for the logits.
A sequence that ends also registers the full pages its generated tokens filled (the next turn of
a chat re-sends them as its prompt), and pins its prefixes when its request asked (``PrefixPin``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Hashable, Iterable

import attrs

from spark.core.page_allocator import PageAllocator, page_hashes
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
    tbt: float | None = None  # its time-between-tokens target in seconds (None: the server's)
    started: float | None = None  # when its first prefill chunk was scheduled
    prompt_ids: tuple[int, ...] = ()  # for prefix caching (none: nothing to match or register)
    cached_tokens: int = 0  # prompt tokens its first admission found cached
    page_hashes: list[bytes] = attrs.field(factory=list)  # of its prompt's full pages, as far as computed
    registered_pages: int = 0  # of its pages, the first ones registered in the prefix cache
    epoch: int = 0  # bumped whenever it loses its pages: a step planned before cannot register them
    output_ids: list[int] = attrs.field(factory=list)  # sampled tokens, as collected (prefix caching only)
    pins: tuple["PrefixPin", ...] = ()
    reuse_prefix: bool = True  # False: computes its whole prompt, cached or not (it scores every position)


@attrs.frozen
class PrefixPin:
    """Keep a request's prefix cached for ``ttl_s`` seconds after it ends, under ``key`` (which ends it early).

    ``tokens``: the prefix's length; None: all of it, the generated tokens included (a stored Response,
    which the next turn extends).
    """

    key: Hashable
    ttl_s: float
    tokens: int | None = None


class Scheduler:
    def __init__(self, allocator: PageAllocator, policy: "Policy", *, max_batch_size: int = 64,
                 prefix_caching: bool = True):
        self.allocator = allocator
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.prefix_caching = prefix_caching
        self.waiting: deque[SeqState] = deque()  # admitted, prefill not finished (or preempted)
        self.running: list[SeqState] = []  # decoding
        self.preempted: list[Hashable] = []  # since the last schedule(): their cache must be recomputed
        self.prefix_hits: list[tuple[Hashable, int]] = []  # since the last schedule(): (seq, tokens cached)
        self.started_now: list[Hashable] = []  # since the last schedule(): first chunks
        self.prefix_queried = 0  # prompt tokens looked up in the prefix cache, in all
        self.prefix_hit = 0  # of those, found
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

    def finish(self, request_id: Hashable, now: float | None = None) -> bool:
        """Drop a request wherever it is and release its pages. Returns whether it was here.

        ``now``: it ended well (finished, or cancelled): first keep the prefix its pages hold (its
        generated pages registered, its pin applied). None: it failed, its pages hold nothing known.
        """
        seq = self._seqs.pop(request_id, None)
        if seq is not None and now is not None and self.prefix_caching:
            self._keep_prefix(seq, now)
        self.allocator.free(request_id)
        if seq is None:
            return False
        (self.running if seq in self.running else self.waiting).remove(seq)
        return True

    # -- planning ---------------------------------------------------------
    def schedule(self, now: float) -> list[Chunk]:
        """The next step: decodes first (in the policy's order), then prefill chunks."""
        self.preempted, self.prefix_hits, self.started_now = [], [], []
        self.allocator.expire_pins(now)
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
            if (self.prefix_caching and seq.reuse_prefix and seq.num_computed == 0
                    and not self.allocator.has(seq.request_id)):
                self._map_cached_prefix(seq)
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
                self.started_now.append(seq.request_id)
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

    def speculate(self, request_id: Hashable, extra: int) -> tuple[tuple[int, ...], int]:
        """Grow a decode planned by the last ``schedule`` by up to ``extra`` speculated tokens, as far as
        the free pages allow (it never preempts). Returns (its block table, the tokens added)."""
        seq = self._seqs[request_id]
        size = self.allocator.page_size
        held = len(self.allocator.block_table(request_id))
        extra = max(0, min(extra, (held + self.allocator.num_free) * size - seq.num_computed))
        table = self.allocator.append(request_id, seq.num_computed + extra)
        seq.num_computed += extra
        seq.num_tokens += extra  # each speculated position may sample one more
        return table, extra

    def rollback(self, request_id: Hashable, rejected: int) -> None:
        """A collected step rejected the last ``rejected`` speculated tokens of ``request_id``: they
        are neither known nor computed, and the pages that held only them go back to the pool."""
        seq = self._seqs.get(request_id)
        if seq is None or rejected <= 0:
            return
        seq.num_computed -= rejected
        seq.num_tokens -= rejected
        if self.allocator.has(request_id):
            self.allocator.truncate(request_id, seq.num_computed)

    def on_step_done(self, planned: Iterable[Chunk], sampled: Iterable[Hashable], now: float, seconds: float) -> None:
        """Account a finished step: its time (for the policy) and when its tokens came."""
        planned = list(planned)
        rows = sum(1 for c in planned if c.decodes)
        self.policy.observe_step(rows, sum(c.num_tokens for c in planned if not c.decodes), seconds)
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
                seq.num_computed = seq.registered_pages = 0
                seq.epoch += 1
                released.append(seq.request_id)
        if not self.allocator.can_allocate(head.request_id, head.num_computed + 1) and self.allocator.num_pinned:
            self.allocator.drop_pins()  # a pin keeps a prefix for later, never a request from running
        if self.allocator.can_allocate(head.request_id, head.num_computed + 1):
            return released, None
        return released, head

    # -- prefix caching ---------------------------------------------------
    def _map_cached_prefix(self, seq: SeqState) -> None:
        """Map the longest cached run of ``seq``'s prompt pages, leaving at least one token to compute."""
        size = self.allocator.page_size
        full = min(len(seq.prompt_ids), seq.num_tokens - 1) // size
        if full <= 0:
            return
        seq.page_hashes = page_hashes(seq.prompt_ids, size, full_pages=full, start=seq.page_hashes[:full])
        pages = self.allocator.match(seq.page_hashes[:full])
        first_time = seq.started is None
        if first_time:
            self.prefix_queried += full * size
        if not pages:
            return
        self.allocator.share_cached(seq.request_id, pages)
        seq.num_computed = seq.registered_pages = len(pages)
        seq.num_computed *= size
        self.prefix_hits.append((seq.request_id, seq.num_computed))
        if first_time:
            seq.cached_tokens = seq.num_computed
            self.prefix_hit += seq.num_computed

    def register_computed(self, request_id: Hashable, computed: int, epoch: int) -> None:
        """A collected step computed ``request_id``'s first ``computed`` tokens (planned in ``epoch``):
        register the prompt pages they fill. Only a collected step's: a planned chunk may be dropped
        (its sequence ended meanwhile), and a page registered for it would hold no known prefix."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.epoch != epoch or not self.prefix_caching:
            return
        self._register_prompt_pages(seq, computed)

    def _register_prompt_pages(self, seq: SeqState, target: int) -> None:
        """Register the prompt pages filled up to ``target`` tokens."""
        self._register_pages(seq, seq.prompt_ids, target)

    def _register_pages(self, seq: SeqState, tokens, target: int) -> None:
        """Register the full pages of ``tokens`` (the prompt, or prompt + output) filled up to ``target``.
        The hashes ``seq`` holds already are of prompt pages: the first pages of either."""
        size = self.allocator.page_size
        full = min(target, len(tokens)) // size
        if full <= seq.registered_pages:
            return
        seq.page_hashes = page_hashes(tokens, size, full_pages=full, start=seq.page_hashes[:full])
        for i in range(seq.registered_pages, full):
            self.allocator.cache(seq.request_id, i, seq.page_hashes[i])
        seq.registered_pages = full

    def _keep_prefix(self, seq: SeqState, now: float) -> None:
        """Register the full pages of ``seq``'s generated tokens, then pin its prefix if asked.

        With ``k`` tokens collected, the K/V of the first ``prompt_len + k - 1`` tokens are written by
        collected steps (each token is fed by the step after the one that sampled it), so long as the
        sequence never lost its pages (epoch 0): a restarted one's recompute may still be under way.
        """
        if not self.allocator.has(seq.request_id):
            return
        if seq.output_ids and seq.epoch == 0:
            held = len(self.allocator.block_table(seq.request_id)) * self.allocator.page_size
            self._register_pages(seq, list(seq.prompt_ids) + seq.output_ids,
                                 min(seq.prompt_len + len(seq.output_ids) - 1, held))
        for pin in seq.pins:
            pages = seq.registered_pages
            if pin.tokens is not None:
                pages = min(pages, pin.tokens // self.allocator.page_size)
            self.allocator.pin(pin.key, seq.page_hashes[:pages], now + pin.ttl_s)

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
        seq.num_computed = seq.registered_pages = 0
        seq.epoch += 1
        self.waiting.appendleft(seq)
        self.preempted.append(seq.request_id)
