"""The activity log (rotation by size and by age, no secrets) and the usage counters (windows, restarts)."""

from __future__ import annotations

import json
import os
import time

from spark.control.activity import ActivityLog, Tally, key_id
from spark.control.usage import UsageCounters


class Clock:
    """Starts at the real time: the log compares it with files' modification times."""

    def __init__(self):
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def _record(i: int, t: float) -> dict:
    tally = Tally(endpoint="/v1/chat/completions", key_id=key_id("sk-secret"), model="m", recipe="r")
    tally.time = t
    tally.add_prompt([1, 2, 3])
    tally.add_prompt([1, 2, 3])  # a second choice of the same prompt counts once
    tally.observe("a", i)
    return tally.record(200)


def test_key_id_is_short_stable_and_not_the_key():
    assert key_id("sk-secret") == key_id("sk-secret") != key_id("sk-secreT")
    assert "secret" not in key_id("sk-secret") and len(key_id("sk-secret")) == 14
    assert key_id(None) is None and key_id("") is None


def test_tally_counts_distinct_prompts_and_the_last_token_count_per_generation():
    tally = Tally(endpoint="/v1/completions")
    tally.add_prompt([5, 6])
    tally.add_prompt([5, 6])
    tally.add_prompt([7])
    for n in (1, 2, 3):
        tally.observe("g0", n)
    tally.observe("g1", 4)
    assert tally.tokens == (3, 7)
    tally.set_usage(10, 20)  # an upstream's report wins
    assert tally.record(200)["prompt_tokens"] == 10 and tally.record(200)["completion_tokens"] == 20


def test_log_rotates_by_size(tmp_path):
    clock = Clock()
    log = ActivityLog(tmp_path / "activity.jsonl", max_bytes=4000, clock=clock)
    for i in range(100):
        log.append(_record(i, clock.t))
    live, old = tmp_path / "activity.jsonl", tmp_path / "activity.jsonl.1"
    assert old.exists() and live.stat().st_size <= 2000 and old.stat().st_size <= 2000
    tail = log.tail(5)
    assert [r["completion_tokens"] for r in tail] == [95, 96, 97, 98, 99]
    lines = log.tail(1000)
    assert lines[-1]["completion_tokens"] == 99 and len(lines) < 100  # the oldest are gone
    text = live.read_text() + old.read_text()
    assert "sk-secret" not in text and key_id("sk-secret") in text


def test_log_rotates_by_age_and_drops_what_is_too_old(tmp_path):
    clock = Clock()
    day = 86400.0
    log = ActivityLog(tmp_path / "a.jsonl", max_bytes=1 << 20, max_age_s=2 * day, clock=clock)
    log.append(_record(0, clock.t))
    clock.t += 0.5 * day
    log.append(_record(1, clock.t))
    assert not (tmp_path / "a.jsonl.1").exists()
    clock.t += 0.6 * day  # the live file's first line is now past half the age budget
    log.append(_record(2, clock.t))
    assert [r["completion_tokens"] for r in json_lines(tmp_path / "a.jsonl.1")] == [0, 1]
    assert [r["completion_tokens"] for r in json_lines(tmp_path / "a.jsonl")] == [2]
    reopened = ActivityLog(tmp_path / "a.jsonl", max_age_s=2 * day, clock=clock)  # the age survives a restart
    os.utime(tmp_path / "a.jsonl.1", (clock.t - 3 * day,) * 2)
    clock.t += 1.1 * day
    reopened.append(_record(3, clock.t))
    assert [r["completion_tokens"] for r in reopened.tail(10)] == [2, 3]


def json_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_usage_windows_and_restart(tmp_path):
    clock = Clock()
    path = tmp_path / "usage.json"
    usage = UsageCounters(path, clock=clock, flush_interval_s=3600)
    usage.add("a", 10, 100)
    clock.t += 7200  # two hours later
    usage.add("a", 1, 2)
    usage.add("b", 5, 6)
    s = usage.summary()
    assert s["a"]["hour"] == {"requests": 1, "prompt_tokens": 1, "completion_tokens": 2}
    assert s["a"]["day"] == s["a"]["total"] == {"requests": 2, "prompt_tokens": 11, "completion_tokens": 102}
    usage.flush()
    clock.t += 86400  # a day later, after a restart: the total survives, the windows are empty
    again = UsageCounters(path, clock=clock)
    s = again.summary()
    assert s["a"]["total"]["completion_tokens"] == 102 and s["a"]["day"]["requests"] == 0
    assert s["b"]["total"] == {"requests": 1, "prompt_tokens": 5, "completion_tokens": 6}
    path.write_text("{not json")
    assert UsageCounters(path).summary() == {}  # unreadable: start from zero, never fail the server
