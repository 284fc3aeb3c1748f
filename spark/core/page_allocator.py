"""Pages of the KV cache: who holds which, and how many are left.

Pure Python, no torch: the scheduler asks first (``can_allocate``), then acts
(``allocate`` / ``append``), and gives everything back with ``free``. Pages are
reference-counted: ``share`` gives a new sequence pages others hold (a shared prompt
prefix), and a page returns to the pool when its last holder frees it.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Raised when a caller acts without asking: there are not enough free pages."""


class PageAllocator:
    """A fixed pool of ``num_pages`` pages of ``page_size`` tokens.

    Page 0 is kept back as a scratch page: padded block-table entries and
    skipped slots point there, so a stray write can never land in a live page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_total = num_pages - 1  # usable pages (page 0 is the scratch page)
        self._free: deque[int] = deque(range(1, num_pages))
        self._refcount = [0] * num_pages
        self._tables: dict[object, list[int]] = {}
        self.peak_used = 0

    # -- counters ---------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

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
        return self.pages_missing(seq_id, num_tokens) <= len(self._free)

    # -- act --------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int) -> tuple[int, ...]:
        """Give a new sequence pages for ``num_tokens`` tokens. Returns its block table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        if self.pages_for(num_tokens) > len(self._free):
            raise OutOfPages(f"sequence {seq_id!r} needs {self.pages_for(num_tokens)} pages, {len(self._free)} free")
        self._tables[seq_id] = []
        return self.append(seq_id, num_tokens)

    def append(self, seq_id, num_tokens: int) -> tuple[int, ...]:
        """Grow ``seq_id``'s pages to hold ``num_tokens`` tokens in all. Returns its block table."""
        table = self._tables[seq_id]
        missing = self.pages_for(num_tokens) - len(table)
        if missing > len(self._free):
            raise OutOfPages(f"sequence {seq_id!r} needs {missing} pages, {len(self._free)} free")
        for _ in range(missing):
            page = self._free.popleft()
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

    def holders(self, page: int) -> int:
        """How many sequences hold ``page``."""
        return self._refcount[page]

    def free(self, seq_id) -> int:
        """Release every page of ``seq_id`` (unknown ids are a no-op). Returns pages returned to the pool."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        released = 0
        for page in table:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)
                released += 1
        return released

    def block_table(self, seq_id) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])
