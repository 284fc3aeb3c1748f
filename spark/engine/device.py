"""Which device an engine runs on, checked where a user can act on it, its CPU threads, and the host heap."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable

import torch

log = logging.getLogger("spark.engine")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def checked_device(device: str | torch.device) -> torch.device:
    """``device`` as torch's, or a ``ValueError`` a user can act on (torch's would be a bare
    ``AssertionError: Torch not compiled with CUDA enabled`` from deep inside the load)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {str(device)!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) has {why}; use --device cpu")
    return device


def use_cpu_threads(device: str | None, threads: int) -> None:
    """Give torch ``threads`` intra-op threads when this process's engine runs on the CPU (``device``;
    None: the default device)."""
    on_cpu = torch.device(device).type == "cpu" if device else default_device().type == "cpu"
    if on_cpu and torch.get_num_threads() != threads:
        log.info("cpu engine: %d torch threads", threads)
        torch.set_num_threads(threads)


def _busy_ticks(cores: frozenset[int]) -> int:
    """Clock ticks the machine's ``cores`` spent running anything (``/proc/stat``), idle and iowait not."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:  # "cpu" (all of them), "cpu0", "cpu1", ..., then other counters
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name != "cpu" and int(name[3:]) in cores:
                ticks = [int(t) for t in fields[:8]]  # user nice system idle iowait irq softirq steal
                busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


def _own_ticks() -> int:
    """Clock ticks this process (all its threads) has run, in ``/proc/stat``'s unit."""
    t = os.times()
    return round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))


class IdleCoreThreads:
    """Torch's intra-op threads on the CPU, following the cores that other processes leave idle.

    A decode step is a few hundred parallel regions, and each waits for its slowest thread: a thread
    that shares its core with another process waits for the scheduler at every one (8 rows a step took
    330 ms with two threads beside a busy core, 56 ms with one). And one thread leaves half of a
    2-core machine's memory bandwidth unused when the machine is otherwise idle. So ``adjust()``, which
    the engine calls before each step from the thread that runs it, looks at most every ``period_s`` at
    the ticks the usable cores ran outside this process and sets the threads to the cores left: fewer
    at once when others start, more only after ``settle`` quiet looks in a row. A look after the engine
    was idle only starts a new count (others' work while it waited, another server's say, is past).

    Args:
        cores: the CPUs this process may run on (default: its affinity).
        busy_ticks, own_ticks, clock: the readings (``/proc/stat``, ``os.times``), replaceable in tests.
    """

    def __init__(self, cores: frozenset[int] | None = None, *, period_s: float = 0.25, settle: int = 2,
                 busy_ticks: Callable[[frozenset[int]], int] = _busy_ticks,
                 own_ticks: Callable[[], int] = _own_ticks, clock: Callable[[], float] = time.monotonic):
        self.cores = frozenset(cores if cores is not None else os.sched_getaffinity(0))
        self.period_s, self.settle = period_s, settle
        self._busy_ticks, self._own_ticks, self._clock = busy_ticks, own_ticks, clock
        self._hz = os.sysconf("SC_CLK_TCK")
        self._last = (clock(), busy_ticks(self.cores), own_ticks())
        self._quiet = 0  # looks in a row that would allow more threads
        self.threads = max(1, len(self.cores) - 1)

    def adjust(self) -> int:
        """Set torch's threads to the cores others leave (read at most once a period); returns the count."""
        now = self._clock()
        then, busy_then, own_then = self._last
        if now - then < self.period_s:
            return self.threads
        busy, own = self._busy_ticks(self.cores), self._own_ticks()
        self._last = (now, busy, own)
        if now - then > 4 * self.period_s:  # the engine was idle: what others did then is not now
            return self.threads
        others = max(0.0, (busy - busy_then - (own - own_then)) / self._hz / (now - then))  # in cores
        # A quarter of a core of others' work (daemons, a shell) is noise; a third of one already stalls.
        wanted = max(1, min(len(self.cores), len(self.cores) - math.ceil(others - 0.25)))
        if wanted > self.threads:
            self._quiet += 1
            if self._quiet < self.settle:
                return self.threads
        self._quiet = 0
        if wanted != self.threads:
            log.debug("cpu engine: %d torch threads (others used %.2f cores)", wanted, others)
            self.threads = wanted
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads


# -- the host's heap (glibc; elsewhere these do nothing) --------------------------------------------


def _glibc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


def map_large_blocks() -> None:
    """Serve every block of 1 MB or more from its own mapping, returned to the system when freed.

    glibc raises its mapping threshold each time such a block is freed (up to 32 MB), after
    which a load's float32 temporaries and the packing's intermediates come from the heap
    and stay resident once freed: ~130 MB more at the peak of loading SmolLM2, ~20 MB more
    while serving. A fixed threshold stops that; the steps' blocks of that size are few."""
    try:
        _glibc().mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (AttributeError, TypeError):  # not glibc
        pass


def give_back_freed_heap() -> None:
    """Hand the heap that loading freed back to the system: glibc keeps it mapped, and a CPU load
    frees hundreds of MB (dense float32 weights before packing, dequantized GGUF tensors)."""
    try:
        _glibc().malloc_trim(0)
    except (AttributeError, TypeError):  # not glibc
        pass
