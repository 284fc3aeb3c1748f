"""The cyclic garbage collector, set for a process that serves.

CPython's collector stops the interpreter while it scans; a full (generation 2) pass
walks every tracked object, and a loaded server holds millions of them (tokenizer
tables, templates, modules), most of which live as long as the process. At hundreds
of streams the server allocates tens of thousands of small objects a second, so with
the default thresholds (a young collection every 700 allocations) it collects
constantly, and every few seconds a full pass stalls every stream and the scheduler
behind it. Measured with `benchmarks/http_overhead.py` (256 clients, 30 ms steps, a
2-core box): 1,572 collections in a run, 3.3 s in all, eleven full passes of 144-390 ms;
after `settle()` at start-up, 7 collections, 0.19 s in all, the one full pass while
serving 11 ms (delivered tokens/s 3,580 -> 4,134).
"""

from __future__ import annotations

import gc

# Allocations between young collections: tens of milliseconds of serving, not one.
_YOUNG = 50_000


def settle() -> None:
    """Collect once, exempt every object alive now from later passes (``gc.freeze``), and
    collect the young generation less often. Call it when start-up is done (model loaded),
    in a process that only serves: objects frozen here are never scanned again, so a
    reference cycle among them, should one be dropped later, is never freed."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(_YOUNG, 20, 100)
