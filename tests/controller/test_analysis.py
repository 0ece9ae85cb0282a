"""The analysis of a canary's window of counts (``controller.planning.analysis``): table tests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.planning.analysis import Counts, Traffic, judge, quantile
from controller.spec import AnalysisConfig

BOUNDS = (0.01, 0.05, 0.1, 0.5, 1.0)


def traffic(at: float, **revisions: tuple[int, int, tuple[int, ...]] | tuple) -> Traffic:
    return Traffic(
        at,
        BOUNDS,
        tuple((int(k[1:]), Counts(*v)) for k, v in sorted(revisions.items())),
    )


CONFIG = AnalysisConfig(max_error_rate=0.01, min_requests=100, max_latency_ratio=2.0)
EMPTY = (0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("new", "old", "outcome", "reason"),
    [
        (
            (412, 31, (412, 0, 0, 0, 0, 0)),
            (1000, 0, (1000, 0, 0, 0, 0, 0)),
            "fail",
            "analysis: error rate 7.5% > 1% over 412 requests at weight 25",
        ),
        (
            (99, 50, (99, 0, 0, 0, 0, 0)),
            (1000, 0, (1000, 0, 0, 0, 0, 0)),
            "wait",
            "analysis: not enough data yet (99 of 100 requests)",
        ),
        (
            (200, 2, (200, 0, 0, 0, 0, 0)),
            (1000, 0, (1000, 0, 0, 0, 0, 0)),
            "pass",
            "analysis: error rate 1% <= 1%, p99 1.00x the stable revision's over 200 "
            "requests at weight 25",
        ),
        (
            (200, 0, (0, 0, 200, 0, 0, 0)),
            (1000, 0, (1000, 0, 0, 0, 0, 0)),
            "fail",
            "analysis: p99 latency 100 ms is 10.05x the stable revision's 10 ms > 2x over "
            "200 requests at weight 25",
        ),
    ],
)
def test_a_window_is_judged(
    new: tuple[int, int, tuple[int, ...]],
    old: tuple[int, int, tuple[int, ...]],
    outcome: str,
    reason: str,
) -> None:
    since = traffic(10.0, r1=(5000, 3, (5000, *EMPTY[1:])), r2=(7, 7, (7, *EMPTY[1:])))
    base1, base2 = since.of(1), since.of(2)
    now = traffic(
        20.0,
        r1=(base1.requests + old[0], base1.errors + old[1],
            tuple(a + b for a, b in zip(base1.latency, old[2], strict=True))),
        r2=(base2.requests + new[0], base2.errors + new[1],
            tuple(a + b for a, b in zip(base2.latency, new[2], strict=True))),
    )  # fmt: skip
    verdict = judge(CONFIG, since, now, 2, 1, 25)
    assert verdict.outcome == outcome
    assert verdict.reason == reason


def test_a_revision_never_seen_is_not_enough_data() -> None:
    verdict = judge(CONFIG, Traffic(), traffic(1.0, r1=(500, 0, (500, *EMPTY[1:]))), 2, 1, 5)
    assert verdict.outcome == "wait"
    assert verdict.requests == 0


def test_quantile_interpolates_within_its_bucket() -> None:
    assert quantile((0, 0, 0, 0, 0, 0), BOUNDS, 0.99) is None
    assert quantile((100, 0, 0, 0, 0, 0), BOUNDS, 0.5) == pytest.approx(0.005)
    assert quantile((0, 100, 0, 0, 0, 0), BOUNDS, 0.99) == pytest.approx(0.0496)
    assert quantile((0, 0, 0, 0, 0, 100), BOUNDS, 0.99) == 1.0  # beyond the last bound


@given(
    requests=st.integers(0, 10_000),
    errors=st.integers(0, 10_000),
    minimum=st.integers(1, 1000),
    limit=st.floats(0, 1),
)
def test_not_enough_data_is_never_a_pass(
    requests: int, errors: int, minimum: int, limit: float
) -> None:
    errors = min(errors, requests)
    config = AnalysisConfig(max_error_rate=limit, min_requests=minimum)
    now = traffic(1.0, r2=(requests, errors, (requests, *EMPTY[1:])))
    verdict = judge(config, Traffic(), now, 2, None, 10)
    if requests < minimum:
        assert verdict.outcome == "wait"
    elif errors / requests > limit:
        assert verdict.outcome == "fail"
    else:
        assert verdict.outcome == "pass"


def _plus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


TTFT = AnalysisConfig(max_error_rate=0.01, min_requests=100, max_ttft_ratio=1.5)


@pytest.mark.parametrize(
    ("new_ttft", "old_ttft", "outcome", "reason", "ratio"),
    [
        (
            (0, 0, 200, 0, 0, 0),  # p99 in (0.05, 0.1]: 99.5 ms
            (0, 1000, 0, 0, 0, 0),  # p99 in (0.01, 0.05]: 49.6 ms
            "fail",
            "analysis: p99 time to first token 100 ms is 2.01x the stable revision's 50 ms "
            "> 1.5x over 200 requests at weight 25",
            0.0995 / 0.0496,
        ),
        (
            (0, 200, 0, 0, 0, 0),
            (0, 1000, 0, 0, 0, 0),
            "pass",
            "analysis: error rate 0% <= 1%, p99 time to first token 1.00x the stable "
            "revision's over 200 requests at weight 25",
            1.0,
        ),
        (
            (),  # the new revision streamed nothing: not judged on it
            (0, 1000, 0, 0, 0, 0),
            "pass",
            "analysis: error rate 0% <= 1% over 200 requests at weight 25",
            None,
        ),
    ],
)
def test_a_canary_is_judged_on_its_time_to_first_token(
    new_ttft: tuple[int, ...],
    old_ttft: tuple[int, ...],
    outcome: str,
    reason: str,
    ratio: float | None,
) -> None:
    """The window's p99 TTFT of each revision, from running totals: the counts before it
    (10 slow streams of the stable, 5 of the canary) are taken off."""
    since = traffic(
        10.0,
        r1=(5000, 0, (5000, *EMPTY[1:]), (0, 0, 0, 0, 10, 0)),
        r2=(7, 0, (7, *EMPTY[1:]), (0, 0, 0, 0, 5, 0) if new_ttft else ()),
    )
    now = traffic(
        20.0,
        r1=(6000, 0, (6000, *EMPTY[1:]), _plus((0, 0, 0, 0, 10, 0), old_ttft)),
        r2=(207, 0, (207, *EMPTY[1:]), _plus((0, 0, 0, 0, 5, 0), new_ttft) if new_ttft else ()),
    )
    verdict = judge(TTFT, since, now, 2, 1, 25)
    assert (verdict.outcome, verdict.reason) == (outcome, reason)
    if ratio is None:
        assert verdict.ttft_ratio is None
    else:
        assert verdict.ttft_ratio == pytest.approx(ratio)
