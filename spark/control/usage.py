"""Token counters per recipe: all-time totals and per-minute buckets of the last day, kept in a JSON file.

The file is rewritten whole (to a temporary name, then renamed) at most every
``flush_interval_s`` and when the server stops, so a crash loses a few seconds
of counts and never the file.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time

log = logging.getLogger("spark.control")

DAY_S = 86400
HOUR_S = 3600
_FIELDS = ("requests", "prompt_tokens", "completion_tokens")


class UsageCounters:
    """``add`` after each request; ``summary`` for the last hour, the last day and all time."""

    def __init__(self, path: str | os.PathLike | None = None, *, flush_interval_s: float = 2.0, clock=time.time):
        self.path = pathlib.Path(path) if path else None
        self._clock, self.flush_interval_s = clock, flush_interval_s
        self._recipes: dict[str, dict] = {}  # id -> {"total": [r, p, c], "minutes": {minute: [r, p, c]}}
        self._flushed_at = 0.0
        self._dirty = False
        if self.path is not None:
            self._recipes = self._read(self.path)

    def add(self, recipe_id: str, prompt_tokens: int, completion_tokens: int) -> None:
        now = self._clock()
        entry = self._recipes.setdefault(recipe_id, {"total": [0, 0, 0], "minutes": {}})
        minute = str(int(now // 60))
        for counts in (entry["total"], entry["minutes"].setdefault(minute, [0, 0, 0])):
            counts[0] += 1
            counts[1] += prompt_tokens
            counts[2] += completion_tokens
        oldest = int(now // 60) - DAY_S // 60
        for m in [m for m in entry["minutes"] if int(m) < oldest]:
            del entry["minutes"][m]
        self._dirty = True
        if now - self._flushed_at >= self.flush_interval_s:
            self.flush()

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per recipe: ``{"hour": {...}, "day": {...}, "total": {...}}`` of requests and tokens."""
        now_minute = int(self._clock() // 60)
        out = {}
        for recipe_id, entry in sorted(self._recipes.items()):
            windows = {}
            for label, span in (("hour", HOUR_S // 60), ("day", DAY_S // 60)):
                sums = [0, 0, 0]
                for m, counts in entry["minutes"].items():
                    if now_minute - int(m) < span:
                        sums = [a + b for a, b in zip(sums, counts)]
                windows[label] = dict(zip(_FIELDS, sums))
            windows["total"] = dict(zip(_FIELDS, entry["total"]))
            out[recipe_id] = windows
        return out

    def flush(self) -> None:
        """Write the counters now (no-op without a path or without news)."""
        self._flushed_at = self._clock()
        if self.path is None or not self._dirty:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": 1, "recipes": self._recipes}, separators=(",", ":")))
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            log.exception("cannot write the usage counters %s", self.path)

    @staticmethod
    def _read(path: pathlib.Path) -> dict:
        try:
            data = json.loads(path.read_text())
            recipes = data["recipes"]
            for entry in recipes.values():
                if len(entry["total"]) != 3 or not isinstance(entry["minutes"], dict):
                    raise ValueError("bad entry")
            return recipes
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning("usage counters in %s are unreadable; starting from zero", path)
            return {}
