"""RateLimiter: per-key request and token buckets over a fake clock (plain floats)."""

from __future__ import annotations

import math

import pytest

from spark.actors.rate_limiter import RateLimiter


def test_disabled_admits_everything():
    limiter = RateLimiter()
    assert not limiter.enabled
    assert all(limiter.check("k", 10**9, 0.0) is None for _ in range(1000))
    assert len(limiter) == 0  # nothing tracked when there is nothing to limit


def test_rps_bucket_allows_a_burst_then_refills():
    limiter = RateLimiter(rps=5)
    assert [limiter.check("k", 1, 0.0) for _ in range(5)] == [None] * 5  # a burst of rps
    wait = limiter.check("k", 1, 0.0)
    assert wait == pytest.approx(0.2)  # one request's worth of refill at 5/s
    assert limiter.check("k", 1, 0.1) == pytest.approx(0.1)  # refusals take nothing
    assert limiter.check("k", 1, 0.2) is None
    assert limiter.check("k", 1, 0.2) == pytest.approx(0.2)
    assert [limiter.check("k", 1, 10.0) for _ in range(6)] == [None] * 5 + [pytest.approx(0.2)]  # capped at the burst


def test_rps_below_one_still_admits_one_request():
    limiter = RateLimiter(rps=0.5)
    assert limiter.check("k", 1, 0.0) is None
    assert limiter.check("k", 1, 0.0) == pytest.approx(2.0)
    assert limiter.check("k", 1, 1.99) == pytest.approx(0.01)
    assert limiter.check("k", 1, 2.0) is None


def test_tpm_bucket_refills_per_minute():
    limiter = RateLimiter(tpm=6000)  # 100 tokens per second
    assert limiter.check("k", 5000, 0.0) is None
    assert limiter.check("k", 1000, 0.0) is None
    assert limiter.check("k", 500, 0.0) == pytest.approx(5.0)  # 500 tokens at 100/s
    assert limiter.check("k", 500, 3.0) == pytest.approx(2.0)
    assert limiter.check("k", 500, 5.0) is None
    assert limiter.check("k", 6000, 65.0) is None  # a full minute refills the whole bucket


def test_a_request_larger_than_tpm_never_fits():
    limiter = RateLimiter(tpm=1000)
    assert math.isinf(limiter.check("k", 1001, 0.0))
    assert limiter.check("k", 1000, 0.0) is None  # and it took nothing


def test_both_buckets_the_longer_wait_wins():
    limiter = RateLimiter(rps=10, tpm=600)  # 10 tokens per second
    assert limiter.check("k", 600, 0.0) is None
    assert limiter.check("k", 50, 0.0) == pytest.approx(5.0)  # requests are fine, tokens are not
    limiter = RateLimiter(rps=1, tpm=60_000)
    assert limiter.check("k", 1, 0.0) is None
    assert limiter.check("k", 1, 0.0) == pytest.approx(1.0)  # tokens are fine, requests are not


def test_keys_are_limited_separately():
    limiter = RateLimiter(rps=1)
    assert limiter.check("a", 1, 0.0) is None
    assert limiter.check("a", 1, 0.0) is not None
    assert limiter.check("b", 1, 0.0) is None


def test_retry_after_is_enough_and_not_too_much():
    limiter = RateLimiter(rps=3, tpm=1200)
    now, admitted = 0.0, 0
    for _ in range(200):
        wait = limiter.check("k", 37, now)
        if wait is None:
            admitted += 1
            continue
        assert 0 < wait <= 60
        assert limiter.check("k", 37, now + wait * 0.9) is not None  # earlier is still too early
        now += wait + 1e-9  # (exactly `wait` can fall short by a rounding error: ~1e-17 s)
        assert limiter.check("k", 37, now) is None  # waiting as told is enough
        admitted += 1
    assert admitted == 200
    assert 1200 / 60 * now >= 37 * 200 - 1200 - 1e-6  # the tpm bucket paced the whole run


def test_the_key_cap_holds_under_a_flood_of_unique_keys():
    limiter = RateLimiter(rps=1, max_keys=1000)
    for i in range(100_000):
        assert limiter.check(f"key-{i}", 1, i * 1e-6) is None
    assert len(limiter) <= 1000
    # the most recent keys are the ones kept: a recent key is still limited
    assert limiter.check("key-99999", 1, 0.1) is not None


def test_a_busy_key_survives_a_flood_of_others():
    limiter = RateLimiter(rps=1, max_keys=10)
    assert limiter.check("busy", 1, 0.0) is None
    for i in range(100):
        limiter.check(f"other-{i}", 1, 0.0)
        if i % 5 == 0:
            assert limiter.check("busy", 1, 0.0) is not None  # refused, but kept as most recently used
    assert limiter.check("busy", 1, 0.0) is not None
