"""Pages of the KV cache: who holds which, which full pages hold a known prefix, and how many are left.

Pure Python, no torch: the scheduler asks first (``can_allocate``), then acts
(``allocate`` / ``append``), and gives everything back with ``free``. Pages are
reference-counted: ``share`` gives a new sequence pages others hold (a shared prompt
prefix), and a page returns to the pool when its last holder frees it.

Prefix caching: a full page whose tokens are known is registered under the hash of its
tokens chained over the hashes of the pages before it (``cache``); a later sequence that
starts with the same tokens maps those pages (``match`` then ``share_cached``) instead of
computing them. A registered page whose last holder frees it stays cached, evictable: it
counts as free, and is given out again (its content forgotten) least recently used first,
only when no never-used page is left, or when ``warm_pages`` pages have been used already: a pool
whose memory is committed as it is first written (a CPU engine's) then stays at that many pages
while cached ones can make room, instead of growing with every distinct text served until the
whole pool is resident. A page some sequence holds is never evicted.

Pins: ``pin`` keeps a sequence's cached pages out of eviction until a deadline, under a key
(a stored Response's id, an Anthropic ``cache_control`` breakpoint) that ``unpin`` ends early.
A pinned page no sequence holds is neither free nor used; the pages pinned at once never
exceed ``max_pinned`` (the pins that end soonest give way to a new one).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfPages(RuntimeError):
    """Raised when a caller acts without asking: there are not enough free pages."""


class PageAllocator:
    """A fixed pool of ``num_pages`` pages of ``page_size`` tokens.

    Page 0 is kept back as a scratch page: padded block-table entries and
    skipped slots point there, so a stray write can never land in a live page.
    """

    def __init__(self, num_pages: int, page_size: int, *, max_pinned: int | None = None,
                 warm_pages: int | None = None):
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_total = num_pages - 1  # usable pages (page 0 is the scratch page)
        # Never used, or their content forgotten; the last freed is given out first, so that a pool
        # whose memory is committed as it is first written (a CPU engine's) grows only as far as the
        # most pages held at once, not to every page in turn.
        self._free: deque[int] = deque(range(num_pages - 1, 0, -1))
        # Pages 1..used_up have been given out at least once; the never-used ones lie below the freed
        # ones in ``_free``, the next of them being ``used_up + 1``.
        self._used_up = 0
        self.warm_pages = self.num_total if warm_pages is None else max(1, warm_pages)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none: least recent first
        self._refcount = [0] * num_pages
        self._tables: dict[object, list[int]] = {}
        self._page_of: dict[bytes, int] = {}  # prefix hash -> the page holding it
        self._hash_of: dict[int, bytes] = {}
        self.peak_used = 0
        self.evictions = 0  # cached pages given out again
        self.max_pinned = self.num_total // 2 if max_pinned is None else max(0, min(max_pinned, self.num_total))
        self._pins: dict[object, tuple[float, list[int]]] = {}  # key -> (until, its pages)
        self._pin_count: dict[int, int] = {}  # page -> pins that cover it
        self._kept: set[int] = set()  # pinned pages no sequence holds: neither used nor free
        self._next_expiry = float("inf")

    # -- counters ---------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds."""
        return self.num_total - self.num_free - len(self._kept)

    @property
    def num_cached(self) -> int:
        """Pages registered under a prefix hash (held or evictable)."""
        return len(self._hash_of)

    @property
    def num_pinned(self) -> int:
        """Distinct pages some pin covers (held or not)."""
        return len(self._pin_count)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_total

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    # -- ask --------------------------------------------------------------
    def has(self, seq_id) -> bool:
        return seq_id in self._tables

    def pages_missing(self, seq_id, num_tokens: int) -> int:
        """How many more pages ``seq_id`` needs to hold ``num_tokens`` tokens in all."""
        held = len(self._tables.get(seq_id, ()))
        return max(0, self.pages_for(num_tokens) - held)

    def can_allocate(self, seq_id, num_tokens: int) -> bool:
        """Whether ``seq_id`` (new or not) can grow to ``num_tokens`` tokens now."""
        return self.pages_missing(seq_id, num_tokens) <= self.num_free

    # -- act --------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int) -> tuple[int, ...]:
        """Give a new sequence pages for ``num_tokens`` tokens. Returns its block table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        if self.pages_for(num_tokens) > self.num_free:
            raise OutOfPages(f"sequence {seq_id!r} needs {self.pages_for(num_tokens)} pages, {self.num_free} free")
        self._tables[seq_id] = []
        return self.append(seq_id, num_tokens)

    def append(self, seq_id, num_tokens: int) -> tuple[int, ...]:
        """Grow ``seq_id``'s pages to hold ``num_tokens`` tokens in all. Returns its block table."""
        table = self._tables[seq_id]
        missing = self.pages_for(num_tokens) - len(table)
        if missing > self.num_free:
            raise OutOfPages(f"sequence {seq_id!r} needs {missing} pages, {self.num_free} free")
        for _ in range(missing):
            page = self._take()
            self._refcount[page] = 1
            table.append(page)
        self.peak_used = max(self.peak_used, self.num_used)
        return tuple(table)

    def share(self, seq_id, pages) -> tuple[int, ...]:
        """Give a new sequence ``pages`` that others hold already (a shared prefix): each page
        counts one more holder and returns to the pool only when the last one frees it.
        Grow it with ``append``. Returns its block table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        pages = list(pages)
        if any(self._refcount[p] < 1 for p in pages):
            raise ValueError("only pages some sequence holds can be shared")
        for page in pages:
            self._refcount[page] += 1
        self._tables[seq_id] = pages
        return tuple(pages)

    # -- prefix caching ---------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of ``hashes``, from the first, that is cached."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def share_cached(self, seq_id, pages: Sequence[int]) -> tuple[int, ...]:
        """Give a new sequence the cached ``pages`` (from ``match``), held or evictable. Returns its table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        for page in pages:
            if page not in self._hash_of:
                raise ValueError(f"page {page} is not cached")
            if self._refcount[page] == 0:
                if page in self._kept:
                    self._kept.discard(page)
                else:
                    del self._evictable[page]
            self._refcount[page] += 1
        self._tables[seq_id] = list(pages)
        return tuple(pages)

    def cache(self, seq_id, index: int, prefix_hash: bytes) -> None:
        """Register page ``index`` of ``seq_id``'s table as holding the prefix ``prefix_hash`` (its
        tokens are all known and their K/V computed, or being computed, by a step already launched).
        A prefix cached already keeps its page."""
        page = self._tables[seq_id][index]
        if prefix_hash in self._page_of or page in self._hash_of:
            return
        self._page_of[prefix_hash] = page
        self._hash_of[page] = prefix_hash

    def forget_cached(self) -> None:
        """Drop every prefix registration (a step failed: the K/V it was to write cannot be trusted)."""
        self.drop_pins()
        self._page_of.clear()
        self._hash_of.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()

    # -- pins ---------------------------------------------------------------
    def pin(self, key, hashes: Sequence[bytes], until: float) -> int:
        """Pin the cached pages of the longest run of ``hashes`` (as ``match``) until ``until`` (a pin
        under ``key`` already is replaced). Returns the pages pinned."""
        self.unpin(key)
        pages = self.match(hashes)
        new = sum(1 for p in pages if p not in self._pin_count)
        while self._pins and self.num_pinned + new > self.max_pinned:
            self.unpin(min(self._pins, key=lambda k: self._pins[k][0]))  # the one ending soonest
            new = sum(1 for p in pages if p not in self._pin_count)
        while pages and self.num_pinned + new > self.max_pinned:  # alone it is too long: its first pages
            if pages.pop() not in self._pin_count:
                new -= 1
        if not pages:
            return 0
        for page in pages:
            self._pin_count[page] = self._pin_count.get(page, 0) + 1
            if self._refcount[page] == 0:
                self._evictable.pop(page, None)
                self._kept.add(page)
        self._pins[key] = (until, pages)
        self._next_expiry = min(self._next_expiry, until)
        return len(pages)

    def unpin(self, key) -> None:
        """End the pin under ``key`` (unknown keys are a no-op): its pages no one holds become evictable."""
        entry = self._pins.pop(key, None)
        if entry is None:
            return
        for page in entry[1]:
            left = self._pin_count[page] - 1
            if left:
                self._pin_count[page] = left
                continue
            del self._pin_count[page]
            if page in self._kept:
                self._kept.discard(page)
                self._evictable[page] = None  # as if just freed: the most recently used

    def expire_pins(self, now: float) -> None:
        """End the pins whose time is up."""
        if now < self._next_expiry:
            return
        for key in [k for k, (until, _) in self._pins.items() if until <= now]:
            self.unpin(key)
        self._next_expiry = min((until for until, _ in self._pins.values()), default=float("inf"))

    def drop_pins(self) -> None:
        """End every pin (a request could not start otherwise, or the cache is forgotten)."""
        for key in list(self._pins):
            self.unpin(key)
        self._next_expiry = float("inf")

    def _take(self) -> int:
        """A page for a new holder: a freed one, else a never-used one (while fewer than ``warm_pages``
        have been used, or no cached page is left), else the least recently used cached one."""
        if self._free and (self._free[-1] <= self._used_up or self._used_up < self.warm_pages
                           or not self._evictable):
            page = self._free.pop()  # the most recently freed: a host's memory stays as small as it was
            self._used_up = max(self._used_up, page)
            return page
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        self.evictions += 1
        return page

    def holders(self, page: int) -> int:
        """How many sequences hold ``page``."""
        return self._refcount[page]

    def free(self, seq_id) -> int:
        """Release every page of ``seq_id`` (unknown ids are a no-op). Returns pages returned to the pool."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        return sum(self._release(page) for page in table)

    def _release(self, page: int) -> int:
        """One holder less for ``page``; 1 when it left every holder (and went back to the pool)."""
        self._refcount[page] -= 1
        if self._refcount[page]:
            return 0
        if page in self._pin_count:
            self._kept.add(page)  # kept by its pin; evictable when the pin ends
        elif page in self._hash_of:
            self._evictable[page] = None  # the most recently used
        else:
            self._free.append(page)
        return 1

    def truncate(self, seq_id, num_tokens: int) -> int:
        """Shrink ``seq_id``'s pages to those ``num_tokens`` tokens need (speculated tokens rejected:
        the pages past them hold nothing kept). Returns the pages released."""
        table = self._tables[seq_id]
        keep = self.pages_for(num_tokens)
        released = 0
        while len(table) > keep:
            released += self._release(table.pop())
        return released

    def block_table(self, seq_id) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])


def page_hashes(token_ids: Sequence[int], page_size: int, *, full_pages: int, start: Sequence[bytes] = ()
                ) -> list[bytes]:
    """The chained hashes of the first ``full_pages`` pages of ``token_ids``: each covers its page's
    tokens and, through the hash before it, every token before them. ``start``: hashes known already
    (of the first pages), extended rather than recomputed."""
    hashes = list(start)
    previous = hashes[-1] if hashes else b""
    for i in range(len(hashes), full_pages):
        tokens = array("q", token_ids[i * page_size:(i + 1) * page_size])
        previous = hashlib.blake2b(previous + tokens.tobytes(), digest_size=16).digest()
        hashes.append(previous)
    return hashes
