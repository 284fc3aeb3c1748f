"""Speculation's bookkeeping in the pure core (issue 22): a verify chunk grows a decode's pages as far
as the pool allows, and rejected tokens go back (their count and the pages only they held)."""

from __future__ import annotations

from spark.core.page_allocator import PageAllocator
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler, SeqState
from spark.core.speculation import SpecConfig, Speculator


def _decoding(num_pages: int, prompt: int = 30) -> Scheduler:
    """A scheduler whose one sequence has its prompt computed and decodes next."""
    s = Scheduler(PageAllocator(num_pages, 16), make_policy("fifo", Limits(max_prefill_tokens=512)))
    s.add(SeqState("a", prompt, 0.0, prompt_len=prompt))
    s.schedule(0.0)  # the prompt
    return s


def test_truncate_releases_only_the_tail_pages():
    alloc = PageAllocator(10, 4)
    alloc.allocate("a", 8)
    shared = alloc.share("b", alloc.block_table("a"))
    alloc.append("b", 17)  # 5 pages: 2 shared, 3 its own
    assert alloc.truncate("b", 9) == 2
    assert alloc.block_table("b") == shared + alloc.block_table("b")[2:3]
    assert alloc.truncate("b", 1) == 1  # its own third page; the shared first two are still a's
    assert alloc.block_table("b") == shared[:1] and alloc.num_used == 2
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_used == 0


def test_speculate_and_roll_back():
    s = _decoding(num_pages=8)
    (chunk,) = s.schedule(0.0)  # the decode of token 30 (position 30), which samples the 32nd
    seq = s.seq("a")
    assert (chunk.num_tokens, seq.num_computed, seq.num_tokens) == (1, 31, 32)
    table, n = s.speculate("a", 6)
    assert n == 6 and len(table) == 3 and (seq.num_computed, seq.num_tokens) == (37, 38)
    s.rollback("a", 6 + 1 - 2)  # two emitted: one draft token accepted, and the model's own
    assert (seq.num_computed, seq.num_tokens) == (32, 33)
    assert len(s.allocator.block_table("a")) == 2 == s.allocator.pages_for(seq.num_computed)


def test_speculate_never_takes_more_pages_than_are_free():
    s = _decoding(num_pages=3)  # 2 usable pages: 32 tokens
    s.schedule(0.0)
    table, n = s.speculate("a", 8)
    assert n == 1 and len(table) == 2 and s.allocator.num_free == 0


def test_speculator_drafts_and_counts():
    spec = Speculator(SpecConfig(num_tokens=3, max_batch=2))
    spec.start("a", [1, 2, 3, 4, 1, 2])
    assert spec.draft("a", 10) == (3, 4, 1) and spec.draft("a", 2) == (3, 4)
    spec.extend("a", [3, 9])
    assert spec.draft("a", 10) == ()
    assert spec.on(2) and not spec.on(3)
    spec.observe("a", 3, 2)
    spec.observe("a", 0, 1)
    c = spec.counts
    assert (c.drafted, c.accepted, c.steps, c.tokens) == (3, 1, 2, 3)
    spec.forget("a")
    assert not spec.on(1)


def test_draft_length_follows_acceptance():
    """A rejected draft shrinks the next to what was accepted plus one; a draft all taken doubles it."""
    spec = Speculator(SpecConfig(num_tokens=6))
    spec.start("a", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert len(spec.draft("a", 10)) == 6
    spec.observe("a", 6, 1)  # nothing accepted
    assert spec.draft("a", 10) == (3,)
    spec.observe("a", 1, 2)  # all accepted
    assert spec.draft("a", 10) == (3, 4)
    spec.observe("a", 2, 3)
    spec.observe("a", 4, 5)
    assert len(spec.draft("a", 10)) == 6  # capped at num_tokens
