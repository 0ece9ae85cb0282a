"""``ratelimit``: token buckets (GCRA) on a fake clock, and the bounded table of keys."""

from __future__ import annotations

import sys

import pytest

from gateway.config import RateLimit
from gateway.pool.ratelimit import Buckets, Rule, rules

# (rps, burst, [(now, allowed, remaining, retry_after)]): one key's requests in time order.
TIMELINES = [
    # A full bucket lets `burst` through at once, then one per 1/rps.
    (
        10.0,
        3,
        [
            (0.0, True, 2, 0.0),
            (0.0, True, 1, 0.0),
            (0.0, True, 0, 0.0),
            (0.0, False, 0, 0.1),
            (0.05, False, 0, 0.05),
            (0.1, True, 0, 0.0),
            (0.1, False, 0, 0.1),
        ],
    ),
    # A quiet spell refills it, never beyond `burst`.
    (
        2.0,
        2,
        [
            (0.0, True, 1, 0.0),
            (0.0, True, 0, 0.0),
            (100.0, True, 1, 0.0),
            (100.0, True, 0, 0.0),
            (100.0, False, 0, 0.5),
            (100.5, True, 0, 0.0),
            (101.5, True, 1, 0.0),
        ],
    ),
    # burst 1: one request per interval exactly, however they cluster.
    (
        1.0,
        1,
        [(0.0, True, 0, 0.0), (0.999, False, 0, 0.001), (1.0, True, 0, 0.0), (1.5, False, 0, 0.5)],
    ),
    # Refused requests spend nothing: a client that keeps knocking is not locked out longer.
    (
        1.0,
        1,
        [(0.0, True, 0, 0.0)]
        + [(0.1 * i, False, 0, 1.0 - 0.1 * i) for i in range(1, 10)]
        + [(1.0, True, 0, 0.0)],
    ),
]


@pytest.mark.parametrize(("rps", "burst", "timeline"), TIMELINES)
def test_bucket_timelines(rps: float, burst: int, timeline: list[tuple]) -> None:
    buckets = Buckets(rps, burst)
    for now, allowed, remaining, retry_after in timeline:
        verdict = buckets.take("k", now)
        assert (verdict.allowed, verdict.remaining) == (allowed, remaining), (now, verdict)
        assert verdict.retry_after == pytest.approx(retry_after, abs=1e-6), (now, verdict)
        assert verdict.limit == burst


def test_reset_says_when_the_bucket_is_full_again() -> None:
    buckets = Buckets(4.0, 4)
    for _ in range(4):
        verdict = buckets.take("k", 10.0)
    assert verdict.reset == pytest.approx(1.0)
    assert buckets.take("k", 10.0).reset == pytest.approx(1.0)  # refused: unchanged
    assert buckets.take("k", 10.5).reset == pytest.approx(0.75)


def test_keys_have_buckets_of_their_own() -> None:
    buckets = Buckets(1.0, 1)
    assert buckets.take("a", 0.0).allowed
    assert not buckets.take("a", 0.0).allowed
    assert buckets.take("b", 0.0).allowed


def test_the_table_is_capped_and_evicts_the_least_recently_used() -> None:
    buckets = Buckets(1.0, 1, max_keys=3)
    for key in "abc":
        buckets.take(key, 0.0)
    buckets.take("a", 0.0)  # refused, but used: "b" is now the least recently used
    buckets.take("d", 0.0)
    assert len(buckets) == 3
    assert buckets.evicted == 1
    assert not buckets.take("a", 0.0).allowed  # kept: still empty
    assert buckets.take("b", 0.0).allowed  # evicted: a full bucket again
    assert repr(buckets) == "<Buckets rps=1 burst=1 keys=3/3 evicted=2>"


def test_a_flood_of_distinct_keys_keeps_the_table_at_its_cap() -> None:
    buckets = Buckets(10.0, 10, max_keys=1000)
    for i in range(100_000):
        buckets.take(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", i * 1e-6)
    assert len(buckets) == 1000
    assert buckets.evicted == 99_000
    assert sys.getsizeof(buckets._tat) < 200_000


def test_a_rule_per_worker_takes_its_share() -> None:
    limit = RateLimit(path_prefix="/api", key="ip", rps=10, burst=8)
    (whole,) = rules([limit])
    (half,) = rules([limit], share=2)
    assert (whole.buckets.rps, whole.buckets.burst) == (10, 8)
    assert (half.buckets.rps, half.buckets.burst) == (5, 4)
    # A share is never an empty bucket.
    assert Rule(RateLimit(rps=1, burst=1), share=4).buckets.burst == 1
    # burst 0: one second's worth.
    assert Rule(RateLimit(rps=2.5)).burst == 3


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="rps"):
        Buckets(0, 1)
    with pytest.raises(ValueError, match="burst"):
        Buckets(1, 0)


@pytest.mark.parametrize(("rps", "burst", "timeline"), TIMELINES)
def test_allow_spends_as_take_does(rps: float, burst: int, timeline: list[tuple]) -> None:
    taken, allowed = Buckets(rps, burst), Buckets(rps, burst)
    for now, *_ in timeline:
        assert allowed.allow("k", now) == taken.take("k", now).allowed
    assert allowed._tat == taken._tat
