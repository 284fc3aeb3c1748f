"""Prefix caching (issue 20): full prompt pages registered under chained hashes, mapped by later prompts
that start with the same tokens, kept after their holders end and evicted least recently used.

The engine double checks every plan as the real engine would, and more: a sequence that maps pages as
its cached prefix must find exactly its own tokens' K/V in them, and no chunk may write a page a live
sequence holds. So a page registered before its K/V was written, one evicted while held, or a
hash that names the wrong page fails these tests.
"""

from __future__ import annotations

import random

import pytest

from spark.core.page_allocator import PageAllocator, page_hashes
from spark.core.scheduler import PrefixPin
from spark.engine.sampling import SamplingParams
from tests.actors.engine_double import hashed_token
from tests.core.test_scheduler import drive, make

SYSTEM = list(range(100, 140))  # 40 tokens: 10 full pages of 4


def _submit(core, request_id, prompt, max_tokens=6):
    core.submit(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), 0.0)


def _expected(prompts: dict, max_tokens: int) -> dict:
    return {rid: [hashed_token(rid, len(p) + k, 1000) for k in range(max_tokens)] for rid, p in prompts.items()}


# -- the allocator ----------------------------------------------------------------


def test_a_freed_cached_page_stays_mappable_until_a_new_page_is_needed():
    alloc = PageAllocator(1 + 4, 4)
    hashes = page_hashes(list(range(8)), 4, full_pages=2)
    alloc.allocate("a", 8)
    alloc.cache("a", 0, hashes[0])
    alloc.cache("a", 1, hashes[1])
    alloc.free("a")
    assert alloc.num_free == 4 and alloc.num_cached == 2  # cached pages count as free...
    assert len(alloc.match(hashes)) == 2
    table = alloc.share_cached("b", alloc.match(hashes))
    assert alloc.num_free == 2 and alloc.holders(table[0]) == 1
    alloc.free("b")
    alloc.allocate("c", 8)  # the two never-used pages go first
    assert alloc.num_cached == 2 and alloc.evictions == 0
    alloc.allocate("d", 4)  # then the least recently used cached one, forgotten
    assert alloc.evictions == 1 and len(alloc.match(hashes)) == 0  # its first page is gone: no run left


def test_a_held_page_is_never_evicted_and_a_failed_step_forgets_every_registration():
    alloc = PageAllocator(1 + 2, 4)
    h = page_hashes([1, 2, 3, 4], 4, full_pages=1)
    alloc.allocate("a", 4)
    alloc.cache("a", 0, h[0])
    alloc.share_cached("b", alloc.match(h))
    assert not alloc.can_allocate("c", 8)  # one page left: the held cached page is not free
    alloc.forget_cached()
    assert alloc.match(h) == [] and alloc.num_cached == 0
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free == 2


def test_hashes_chain_over_every_token_before():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, full_pages=2)
    b = page_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, full_pages=2)
    assert a[0] != b[0] and a[1] != b[1]  # same second page, other first one: other prefix
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, full_pages=2, start=a[:1]) == a


# -- the scheduler and the core, on the double ---------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
def test_a_shared_system_prompt_is_computed_once(depth):
    core, engine = make("fifo", num_pages=256, page_size=4, max_prefill_tokens=64, depth=depth, prefix_caching=True)
    first = {"first": SYSTEM + [1, 2, 3]}
    _submit(core, "first", first["first"])
    outputs, _ = drive(core)
    later = {f"r{i}": SYSTEM + [10 + i] * (i + 1) for i in range(8)}
    for rid, prompt in later.items():
        _submit(core, rid, prompt)
    before = sum(engine.step_tokens)
    outputs, reasons = drive(core)
    assert outputs == _expected(later, 6) and set(reasons.values()) == {"length"}
    assert engine.prefix_hits == 8 * len(SYSTEM)  # every later request mapped the 10 system pages
    computed = sum(engine.step_tokens) - before
    assert computed == sum(len(p) - len(SYSTEM) for p in later.values()) + 8 * 5  # their own tokens, decodes
    assert core.scheduler.prefix_hit == 8 * len(SYSTEM)
    assert [core.scheduler.allocator.num_used] == [0]


def test_a_prompt_that_diverges_mid_page_maps_only_the_pages_before():
    core, engine = make("fifo", num_pages=64, page_size=4, prefix_caching=True)
    _submit(core, "a", SYSTEM[:10] + [1, 1])
    drive(core)
    _submit(core, "b", SYSTEM[:9] + [2, 2, 2])  # differs at token 9, inside the third page
    outputs, _ = drive(core)
    assert engine.prefix_hits == 8 and outputs["b"] == _expected({"b": SYSTEM[:9] + [2] * 3}, 6)["b"]


def test_a_whole_cached_prompt_still_computes_its_last_token():
    core, engine = make("fifo", num_pages=64, page_size=4, prefix_caching=True)
    prompt = SYSTEM[:8]  # two full pages
    _submit(core, "a", prompt)
    drive(core)
    _submit(core, "b", prompt)
    outputs, _ = drive(core)
    assert engine.prefix_hits == 4  # the first page; the second holds the token whose logits sample
    assert outputs["b"] == _expected({"b": prompt}, 6)["b"]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_six_turn_chat_maps_every_earlier_turn_and_its_answer(depth):
    """Each turn re-sends the last answer: its full pages were registered when it ended (all but its
    last token, whose K/V no step computed), so the next turn maps them too."""
    core, engine = make("fifo", num_pages=256, page_size=4, depth=depth, prefix_caching=True)
    history = list(SYSTEM)
    hits, expected = [], [0]
    for turn in range(6):
        history += [50 + turn] * 5  # the user's message
        before = engine.prefix_hits
        _submit(core, f"t{turn}", list(history))
        outputs, _ = drive(core)
        hits.append(engine.prefix_hits - before)
        expected.append((len(history) + 6 - 1) // 4 * 4)  # prompt + answer, less the answer's last token
        history += outputs[f"t{turn}"]  # the answer, sent back with the next turn
    assert hits == expected[:6]  # the double checked that each mapped page holds these very tokens


def test_a_cancelled_request_keeps_the_pages_it_generated():
    core, engine = make("fifo", num_pages=256, page_size=4, depth=2, prefix_caching=True)
    prompt = SYSTEM[:10]
    _submit(core, "a", prompt, max_tokens=100)
    outputs, _ = drive(core, until=lambda: "a" in core.scheduler and core.scheduler.seq("a").output_ids[10:])
    core.cancel("a")
    drive(core)
    collected = core.scheduler.prefix_hit  # (nothing mapped yet)
    _submit(core, "b", prompt + outputs["a"][:8] + [7])
    drive(core)
    assert collected == 0 and engine.prefix_hits == 16  # 18 known tokens: 4 full pages


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_under_a_tiny_pool_eviction_never_touches_a_live_page(depth):
    """Shared and distinct prompts through a pool that holds a few of them: sequences are preempted,
    cached pages evicted and reused. The double refuses any plan that maps a page whose K/V are not its
    tokens or writes a page a live sequence holds; every request ends as it would without the cache."""
    rng = random.Random(depth)
    prefixes = [list(range(200 * k, 200 * k + 24)) for k in range(3)]
    prompts = {}
    for i in range(40):
        head = rng.choice(prefixes)[: rng.choice((8, 13, 24))]
        prompts[f"r{i}"] = head + [rng.randrange(1, 1000) for _ in range(rng.randint(0, 9))] or [1]
    results = {}
    for caching in (False, True):
        core, engine = make("fifo", num_pages=1 + 24, page_size=4, max_batch_size=6, max_prefill_tokens=32,
                            depth=depth, prefix_caching=caching)
        core.scheduler.allocator.max_pinned = 6
        for i, (rid, prompt) in enumerate(prompts.items()):  # every third pins its prefix for a while
            pins = [PrefixPin(rid, 0.05 * (i % 5))] if i % 3 == 0 else []
            core.submit(rid, prompt, SamplingParams(temperature=0.0, max_tokens=10), 0.0, pins=pins)
        outputs, reasons = drive(core)
        results[caching] = (outputs, reasons, engine.prefix_hits, core.scheduler.allocator.evictions)
        assert core.scheduler.allocator.num_used == 0 and engine.sequences == {}
    (plain, plain_reasons, _, _), (cached, cached_reasons, hits, evictions) = results[False], results[True]
    assert cached == plain == _expected(prompts, 10) and cached_reasons == plain_reasons
    assert hits > 0 and evictions > 0  # the cache was used, and under pressure


def test_a_request_cancelled_before_its_prefill_ran_registers_nothing():
    """A planned chunk is dropped when its sequence ends before the step runs: its pages hold nothing."""
    core, engine = make("fifo", num_pages=64, page_size=4, depth=2, prefix_caching=True)
    _submit(core, "gone", SYSTEM[:16])
    core.step()  # planned and launched ahead...
    core.cancel("gone")  # ...and cancelled before its result is collected
    drive(core)
    _submit(core, "next", SYSTEM[:16] + [5])
    outputs, _ = drive(core)  # the double refuses a mapping of pages that hold other tokens
    assert outputs["next"] == _expected({"next": SYSTEM[:16] + [5]}, 6)["next"]


# -- pins -----------------------------------------------------------------------------


def _cached(alloc, rid, tokens):
    hashes = page_hashes(tokens, alloc.page_size, full_pages=len(tokens) // alloc.page_size)
    alloc.allocate(rid, len(tokens))
    for i, h in enumerate(hashes):
        alloc.cache(rid, i, h)
    return hashes


def test_a_pinned_page_outlives_eviction_until_its_time_or_its_unpin():
    alloc = PageAllocator(1 + 6, 4, max_pinned=3)
    kept = _cached(alloc, "a", list(range(8)))
    other = _cached(alloc, "b", list(range(50, 58)))
    assert alloc.pin("resp_1", kept, until=10.0) == 2
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free == 4 and alloc.num_pinned == 2 and alloc.num_used == 0  # kept: neither free nor used
    alloc.allocate("c", 16)  # takes the two never-used pages and evicts b's two, never a's
    assert alloc.match(other) == [] and len(alloc.match(kept)) == 2
    alloc.free("c")
    alloc.expire_pins(9.9)
    assert alloc.num_pinned == 2
    alloc.expire_pins(10.0)
    assert alloc.num_pinned == 0 and alloc.num_free == 6 and len(alloc.match(kept)) == 2  # evictable again
    assert alloc.pin("resp_1", kept, until=20.0) == 2
    alloc.unpin("resp_1")
    alloc.unpin("never")  # unknown keys: no-op
    assert alloc.num_pinned == 0 and alloc.num_free == 6


def test_pins_never_exceed_their_share_the_soonest_ending_gives_way():
    alloc = PageAllocator(1 + 8, 4, max_pinned=3)
    one = _cached(alloc, "a", list(range(8)))
    two = _cached(alloc, "b", list(range(100, 108)))
    assert alloc.pin("one", one, until=5.0) == 2
    assert alloc.pin("two", two, until=9.0) == 2  # 4 > 3: "one" ends early
    assert alloc.num_pinned == 2 and "one" not in alloc._pins
    long = _cached(alloc, "c", list(range(200, 216)))
    assert alloc.pin("long", long, until=1.0) == 3  # alone too long: its first three pages
    assert alloc.num_pinned == 3


def test_a_pinned_prefix_survives_a_flood_and_a_pin_never_keeps_a_request_out():
    core, engine = make("fifo", num_pages=1 + 16, page_size=4, max_batch_size=1, prefix_caching=True)
    core.scheduler.allocator.max_pinned = 8
    stored = SYSTEM[:20]
    core.submit("resp", stored, SamplingParams(temperature=0.0, max_tokens=4), 0.0, pins=[PrefixPin("resp", 300.0)])
    outputs, _ = drive(core)
    assert core.scheduler.allocator.num_pinned == 5  # 20 prompt + 3 computed answer tokens: 5 full pages
    for i in range(6):  # a flood of other prompts cycles every unpinned page
        _submit(core, f"flood{i}", [600 + 50 * i + k for k in range(30)], max_tokens=2)
        drive(core)
    assert core.scheduler.allocator.evictions > 0
    before = engine.prefix_hits
    _submit(core, "next", stored + outputs["resp"] + [5])
    drive(core)
    assert engine.prefix_hits - before == 20  # the pinned pages, all of them
    _submit(core, "huge", list(range(300, 300 + 60)), max_tokens=2)  # needs 16 pages: the pins must go
    out, reasons = drive(core)
    assert reasons["huge"] == "length" and core.scheduler.allocator.num_pinned == 0


def test_a_pin_ends_with_its_ttl_on_the_core_clock_or_when_unpinned():
    core, _ = make("fifo", num_pages=64, page_size=4, prefix_caching=True)
    core.submit("r1", SYSTEM[:16], SamplingParams(temperature=0.0, max_tokens=2), 0.0, pins=[PrefixPin("r1", 5.0)])
    core.submit("r2", SYSTEM[:16], SamplingParams(temperature=0.0, max_tokens=2), 0.0,
                pins=[PrefixPin("r2", 600.0, tokens=8)])
    drive(core)
    alloc = core.scheduler.allocator
    assert alloc.num_pinned == 4 and alloc._pins["r2"][1] == alloc._pins["r1"][1][:2]
    core.clock.advance(6.0)
    _submit(core, "tick", [1, 2, 3])
    drive(core)
    assert set(alloc._pins) == {"r2"} and alloc.num_pinned == 2
    core.unpin("r2")
    assert alloc.num_pinned == 0
