"""Progress of a long load: a bar on a terminal, a few log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time

import attrs

log = logging.getLogger("spark.load")


def _human(n_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n_bytes < 1000 or unit == "GB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    raise AssertionError("unreachable")


_active: list["LoadProgress"] = []  # the loads under way in this process, the latest last


def current() -> "LoadProgress | None":
    """The latest load under way in this process, or None (a server's ``/health`` says it while the
    model loads)."""
    return _active[-1] if _active else None


@attrs.define(eq=False)
class LoadProgress:
    """Reports bytes loaded so far; use as ``with LoadProgress(total, "weights") as p: p.advance(n)``.

    On a TTY stderr it draws a tqdm bar; otherwise (servers, CI, pipes) it logs
    one info line to ``spark.load`` each time another ~10% is done, so logs
    stay short but a stuck load is still visible.

    Args:
      total: bytes expected in all.
      desc: what is loading, e.g. the file name.
      unit: what ``total`` counts: "B" (bytes) or another unit (e.g. "steps"), reported as is.
      enabled: False reports nothing.
    """

    total: int
    desc: str = "weights"
    unit: str = "B"
    enabled: bool = True
    done: int = attrs.field(default=0, init=False)
    _bar: object = attrs.field(default=None, init=False)
    _start: float = attrs.field(default=0.0, init=False)
    _next_log: int = attrs.field(default=1, init=False)  # the next tenth to log

    def __enter__(self) -> "LoadProgress":
        self._start = time.perf_counter()
        _active.append(self)
        if self.enabled and sys.stderr is not None and sys.stderr.isatty():
            import tqdm

            self._bar = tqdm.tqdm(
                total=self.total, desc=self.desc, unit=self.unit, unit_scale=self.unit == "B", file=sys.stderr, leave=False
            )
        return self

    def advance(self, n_bytes: int) -> None:
        """Count ``n_bytes`` more as loaded."""
        self.done += n_bytes
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n_bytes)
            return
        tenths = 10 * self.done // max(self.total, 1)
        if tenths >= self._next_log:
            self._next_log = tenths + 1
            log.info(
                "loading %s: %s / %s (%d%%) in %.1fs",
                self.desc, self._amount(self.done), self._amount(self.total),
                100 * self.done // max(self.total, 1), time.perf_counter() - self._start,
            )

    def _amount(self, n: int) -> str:
        return _human(n) if self.unit == "B" else f"{n} {self.unit}"

    def __exit__(self, *exc_info) -> None:
        if self in _active:
            _active.remove(self)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
