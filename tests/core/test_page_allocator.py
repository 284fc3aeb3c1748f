"""PageAllocator: ask (can_allocate) then act (allocate / append), free, counters. Pure Python, no torch."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from spark.core.page_allocator import OutOfPages, PageAllocator


def test_importing_it_needs_no_torch():
    code = "import sys, spark.core.page_allocator; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_append_free_and_counters():
    a = PageAllocator(num_pages=9, page_size=4)  # 8 usable: page 0 is scratch
    assert (a.num_total, a.num_free, a.num_used, a.usage, a.peak_used) == (8, 8, 0, 0.0, 0)
    assert a.pages_for(0) == 0 and a.pages_for(1) == 1 and a.pages_for(4) == 1 and a.pages_for(5) == 2

    assert a.can_allocate("x", 10)
    x = a.allocate("x", 10)  # 3 pages
    assert len(x) == 3 and a.block_table("x") == x and a.has("x")
    assert (a.num_used, a.num_free, a.usage, a.peak_used) == (3, 5, 3 / 8, 3)

    assert a.append("x", 12) == x  # still fits in 3 pages
    x2 = a.append("x", 13)
    assert x2[:3] == x and len(x2) == 4
    assert a.pages_missing("x", 20) == 1 and a.pages_missing("x", 2) == 0

    y = a.allocate("y", 16)
    assert a.num_free == 0 and a.usage == 1.0 and a.peak_used == 8
    assert not a.can_allocate("z", 1) and a.can_allocate("y", 16) and not a.can_allocate("y", 17)
    assert not set(x2) & set(y)

    assert a.free("x") == 4
    assert (a.num_used, a.num_free, a.peak_used) == (4, 4, 8)  # the peak stays
    assert not a.has("x")
    with pytest.raises(KeyError):
        a.block_table("x")


def test_page_zero_is_never_handed_out():
    a = PageAllocator(num_pages=5, page_size=1)
    pages = [p for i in range(4) for p in a.allocate(i, 1)]
    assert sorted(pages) == [1, 2, 3, 4]
    assert not a.can_allocate("one more", 1)


def test_acting_without_asking_raises_out_of_pages():
    a = PageAllocator(num_pages=4, page_size=2)  # 3 usable
    x = a.allocate("x", 4)
    with pytest.raises(OutOfPages):
        a.append("x", 7)  # needs 2 more, 1 free
    assert a.block_table("x") == x and a.num_free == 1
    with pytest.raises(OutOfPages):
        a.allocate("y", 3)
    assert a.num_free == 1


def test_a_failed_allocate_leaves_no_trace():
    a = PageAllocator(num_pages=2, page_size=2)  # 1 usable
    with pytest.raises(OutOfPages):
        a.allocate("y", 3)
    assert not a.has("y")  # so the scheduler can ask again later and allocate then


def test_allocating_a_held_sequence_again_is_refused():
    a = PageAllocator(num_pages=4, page_size=2)
    a.allocate("x", 1)
    with pytest.raises(ValueError, match="already holds"):
        a.allocate("x", 1)


def test_free_of_an_unknown_id_is_a_no_op():
    a = PageAllocator(num_pages=4, page_size=2)
    a.allocate("x", 3)
    assert a.free("nobody") == 0
    assert a.free("x") == 2 and a.free("x") == 0
    assert a.num_free == 3


def test_freed_pages_are_reused():
    a = PageAllocator(num_pages=3, page_size=8)  # 2 usable
    first = a.allocate("x", 16)
    a.free("x")
    assert sorted(a.allocate("y", 16)) == sorted(first)


def test_bad_sizes():
    with pytest.raises(ValueError):
        PageAllocator(num_pages=1, page_size=16)
    with pytest.raises(ValueError):
        PageAllocator(num_pages=4, page_size=0)


def test_random_operations_keep_every_page_in_at_most_one_table():
    rng = random.Random(0)
    num_pages, page_size = 33, 3
    a = PageAllocator(num_pages, page_size)
    lengths: dict[int, int] = {}  # our own model of who holds how many tokens
    peak = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.35 or not lengths:
            sid, n = step, rng.randint(1, 20)
            if a.can_allocate(sid, n):
                assert len(a.allocate(sid, n)) == a.pages_for(n)
                lengths[sid] = n
            else:
                assert a.pages_for(n) > a.num_free
                with pytest.raises(OutOfPages):
                    a.allocate(sid, n)
                a.free(sid)  # the failed allocate left an empty table; free drops it
        elif op < 0.8:
            sid = rng.choice(list(lengths))
            n = lengths[sid] + rng.randint(1, 8)
            if a.can_allocate(sid, n):
                table = a.append(sid, n)
                assert len(table) == a.pages_for(n)
                lengths[sid] = n
            else:
                with pytest.raises(OutOfPages):
                    a.append(sid, n)
        else:
            sid = rng.choice(list(lengths))
            assert a.free(sid) == a.pages_for(lengths.pop(sid))
        held = [p for sid in lengths for p in a.block_table(sid)]
        assert len(held) == len(set(held)), "a page is in two tables"
        assert 0 not in held and all(1 <= p < num_pages for p in held)
        assert a.num_used == len(held) and a.num_free == a.num_total - len(held)
        peak = max(peak, len(held))
        assert a.peak_used == peak
    assert peak == a.num_total  # the test did run the pool dry
    for sid in list(lengths):
        a.free(sid)
    assert a.num_free == a.num_total and a.usage == 0.0


def test_shared_pages_return_to_the_pool_with_their_last_holder():
    alloc = PageAllocator(num_pages=9, page_size=4)
    prefix = alloc.allocate("a", 8)  # 2 pages
    assert alloc.share("b", prefix) == prefix and alloc.num_used == 2
    assert [alloc.holders(p) for p in prefix] == [2, 2]
    grown = alloc.append("b", 12)  # b grows past the shared prefix with a page of its own
    assert grown[:2] == prefix and alloc.num_used == 3
    assert alloc.free("a") == 0 and alloc.num_used == 3  # b still holds the prefix
    assert alloc.free("b") == 3 and alloc.num_used == 0


def test_only_held_pages_can_be_shared():
    alloc = PageAllocator(num_pages=9, page_size=4)
    with pytest.raises(ValueError, match="only pages"):
        alloc.share("b", (3,))
    alloc.allocate("a", 4)
    with pytest.raises(ValueError, match="already holds"):
        alloc.share("a", alloc.block_table("a"))


def test_the_last_freed_pages_are_given_out_first():
    # A CPU engine's KV memory is committed as pages are first written: handing out every page in
    # turn grew a server's resident memory for minutes, to the whole pool.
    alloc = PageAllocator(1 + 64, 4)
    touched = set()
    for i in range(100):
        touched.update(alloc.allocate(i, 8))
        alloc.free(i)
    assert len(touched) == 2


def test_past_warm_pages_cached_pages_are_evicted_before_a_never_used_page_is_touched():
    # Every distinct text's full pages stay cached once freed: without a limit a CPU server's KV memory
    # grew with each new text until the whole pool was resident.
    alloc = PageAllocator(1 + 64, 4, warm_pages=6)
    touched = set()
    for i in range(50):
        touched.update(alloc.allocate(i, 8))  # 2 pages each
        for index in range(2):
            alloc.cache(i, index, b"%d-%d" % (i, index))
        alloc.free(i)
    assert len(touched) == 6 and alloc.evictions == 50 * 2 - 6
    # Live sequences still get every page they ask for, never-used ones included.
    tables = [alloc.allocate(f"live{j}", 16) for j in range(16)]
    assert len({p for t in tables for p in t}) == 64 and alloc.num_free == 0
