"""The activity log: one JSON line per generation request, rotated by size and age.

A line holds the time, recipe, model name, a short hash of the API key (never the
key, never a header), prompt and completion tokens, latency and status. The log is
two files: the live one and ``<path>.1``. The live file rotates when it passes half
the byte budget or half the age budget, so the two together hold at most about
``max_bytes`` and nothing much older than ``max_age_s``. ``rollup`` sums the last hour
and day per client, recipe and endpoint (``GET /api/inference/activity``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import time
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from spark.actors.messages import RequestOutput

log = logging.getLogger("spark.control")


def key_id(key: str | None) -> str | None:
    """A short, stable id of an API key for logs and counters; the key cannot be read back from it."""
    if not key:
        return None
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


@attrs.define(eq=False)
class Tally:
    """What one HTTP request used, gathered while it runs; ``record`` is its activity line."""

    endpoint: str
    key_id: str | None = None
    model: str | None = None  # the name the request asked for
    recipe: str | None = None  # the recipe that answered
    served_model: str | None = None
    stream: bool = False
    started: float = attrs.field(factory=time.monotonic)
    time: float = attrs.field(factory=time.time)
    error: str | None = None  # why a generation ended badly (e.g. cut off by a switch)
    _prompts: set = attrs.field(factory=set)  # distinct prompts: n copies of one count once
    prompt_tokens: int = 0
    _outputs: dict = attrs.field(factory=dict)  # generation id -> tokens so far
    _usage: tuple[int, int] | None = None  # reported by an upstream server

    def add_prompt(self, prompt_ids) -> None:
        key = hash(tuple(prompt_ids))
        if key not in self._prompts:
            self._prompts.add(key)
            self.prompt_tokens += len(prompt_ids)

    def observe(self, generation_id: str, output_tokens: int) -> None:
        self._outputs[generation_id] = max(output_tokens, self._outputs.get(generation_id, 0))

    def count(self, piece: RequestOutput) -> None:
        """A piece of one of the request's generations: its tokens so far, and why it failed if it did."""
        self.observe(piece.request_id, piece.num_output_tokens)
        if piece.finish_reason == "error" and piece.error:
            self.error = piece.error

    def set_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._usage = (int(prompt_tokens), int(completion_tokens))

    @property
    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens."""
        if self._usage is not None:
            return self._usage
        return self.prompt_tokens, sum(self._outputs.values())

    def record(self, status: int, *, outcome: str = "ok") -> dict:
        prompt, completion = self.tokens
        return {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)), "ts": round(self.time, 3),
            "endpoint": self.endpoint, "recipe": self.recipe, "model": self.model, "served_model": self.served_model,
            "key_id": self.key_id, "prompt_tokens": prompt, "completion_tokens": completion,
            "latency_s": round(time.monotonic() - self.started, 4), "status": status, "stream": self.stream,
            "outcome": outcome if self.error is None else "error", "error": self.error,
        }


class ActivityLog:
    """Append-only JSON lines at ``path`` (and ``path.1``), rotated by size and age."""

    def __init__(self, path: str | os.PathLike, *, max_bytes: int = 50 << 20, max_age_s: float = 7 * 86400.0,
                 clock=time.time):
        self.path = pathlib.Path(path)
        self.rotated = self.path.with_name(self.path.name + ".1")
        self.max_bytes, self.max_age_s, self._clock = max_bytes, max_age_s, clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._born = self._first_time(self.path)  # time of the live file's first line

    def append(self, record: dict) -> None:
        """Write one line (rotating first when due); an I/O error is logged, never raised to a request."""
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        try:
            now = self._clock()
            self._rotate_if_due(now, len(line.encode()))
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            if self._born is None:
                self._born = now
        except OSError:
            log.exception("cannot write the activity log %s", self.path)

    def tail(self, n: int = 50) -> list[dict]:
        """The last ``n`` records, oldest first."""
        lines: list[str] = []
        for path in (self.path, self.rotated):
            if len(lines) >= n:
                break
            try:
                lines = path.read_text(encoding="utf-8").splitlines()[-(n - len(lines)):] + lines
            except FileNotFoundError:
                continue
        out = []
        for line in lines[-n:]:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash
        return out

    def rollup(self, windows: tuple[tuple[str, float], ...] = (("hour", 3600.0), ("day", 86400.0))) -> dict:
        """The activity of the last hour and day (``windows``): requests, errors and tokens, in all and per
        client (the key's id), recipe and endpoint. Reads the log; call it off the event loop."""
        now = self._clock()
        out = {label: _tally_row(by=True) for label, _ in windows}
        longest = max(span for _, span in windows)
        for path in (self.rotated, self.path):
            try:
                if now - path.stat().st_mtime > longest:
                    continue  # nothing in it is recent enough
                f = open(path, encoding="utf-8")
            except FileNotFoundError:
                continue
            with f:
                for line in f:
                    try:
                        record = json.loads(line)
                        age = now - float(record["ts"])
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut by a crash
                    for label, span in windows:
                        if age < span:
                            _count(out[label], record)
        return out

    def _rotate_if_due(self, now: float, incoming: int) -> None:
        if self.rotated.exists() and now - self.rotated.stat().st_mtime > self.max_age_s:
            self.rotated.unlink()  # everything in it is past the age budget
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        too_big = size > 0 and size + incoming > self.max_bytes // 2
        too_old = self._born is not None and now - self._born > self.max_age_s / 2
        if too_big or too_old:
            os.replace(self.path, self.rotated)
            self._born = None

    @staticmethod
    def _first_time(path: pathlib.Path) -> float | None:
        try:
            with open(path, encoding="utf-8") as f:
                return float(json.loads(f.readline())["ts"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _tally_row(*, by: bool = False) -> dict:
    row = {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0}
    return {**row, "clients": {}, "recipes": {}, "endpoints": {}} if by else row


def _count(window: dict, record: dict) -> None:
    failed = int(record.get("status", 200) >= 400 or record.get("outcome", "ok") not in ("ok", "disconnected"))
    rows = [window]
    for group, key in (("clients", record.get("key_id") or "anonymous"), ("recipes", record.get("recipe") or "-"),
                       ("endpoints", record.get("endpoint") or "-")):
        rows.append(window[group].setdefault(str(key), _tally_row()))
    for row in rows:
        row["requests"] += 1
        row["errors"] += failed
        row["prompt_tokens"] += int(record.get("prompt_tokens") or 0)
        row["completion_tokens"] += int(record.get("completion_tokens") or 0)
