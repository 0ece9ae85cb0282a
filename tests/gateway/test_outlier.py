"""OutlierState and may_eject: streaks, ejection times, shares, lifting."""

from __future__ import annotations

import pytest

from gateway.config import OutlierConfig
from gateway.pool.outlier import Ejection, OutlierState, may_eject

CONFIG = OutlierConfig(
    consecutive_connect_failures=3,
    consecutive_5xx=2,
    base_ejection_time=10,
    max_ejection_time=35,
)


def feed(state: OutlierState, outcomes: str, now: float = 0.0) -> list[Ejection | None]:
    """``c`` connect failure, ``5`` 5xx, ``o`` ok."""
    names = {"c": "connect_failure", "5": "5xx", "o": "ok"}
    return [state.record(names[c], now) for c in outcomes]


@pytest.mark.parametrize(
    ("outcomes", "ejects_at"),
    [
        ("cc", None),
        ("ccc", 2),
        ("ccoc", None),  # an ok resets the connect streak
        ("cc5c", 3),  # a 5xx does not reset the connect streak
        ("5", None),
        ("55", 1),
        ("5o5", None),
        ("5c5", 2),
        ("ococo", None),
        ("occoccc", 6),
    ],
)
def test_thresholds(outcomes, ejects_at):
    proposals = feed(OutlierState(CONFIG), outcomes)
    hits = [i for i, p in enumerate(proposals) if p is not None]
    assert hits == ([] if ejects_at is None else [ejects_at])


def test_reasons():
    state = OutlierState(CONFIG)
    *_, connect = feed(state, "ccc")
    assert connect is not None
    assert connect.reason == "3 connect failures in a row"
    state = OutlierState(CONFIG)
    *_, errors = feed(state, "55")
    assert errors is not None
    assert errors.reason == "2 5xx responses in a row"


def test_refused_proposal_keeps_counting_and_proposes_again():
    """The pool may refuse (max_ejection_percent); the next failure proposes again."""
    state = OutlierState(CONFIG)
    assert feed(state, "ccc")[-1] is not None
    assert state.ejected_until is None
    again = state.record("connect_failure", 1.0)
    assert again == Ejection(11.0, "4 connect failures in a row")


@pytest.mark.parametrize(
    ("n", "duration"),
    [(1, 10.0), (2, 20.0), (3, 30.0), (4, 35.0), (5, 35.0), (10, 35.0)],
)
def test_ejection_time_grows_and_is_capped(n, duration):
    state = OutlierState(CONFIG)
    now = 0.0
    for _ in range(n):
        proposed_at = now
        ejection = feed(state, "ccc", now)[-1]
        assert ejection is not None
        state.eject(ejection)
        assert state.ejected_until == ejection.until
        now = ejection.until
        assert state.probe_passed(now)
    assert state.ejections == n
    assert ejection is not None
    assert ejection.until - proposed_at == duration


def test_failures_while_ejected_are_ignored_and_streaks_reset_on_eject():
    state = OutlierState(CONFIG)
    state.record("5xx", 0.0)
    ejection = feed(state, "ccc")[-1]
    assert ejection is not None
    state.eject(ejection)
    assert (state.connect_failures, state.errors_5xx) == (0, 0)
    assert feed(state, "ccccc555", now=1.0) == [None] * 8
    assert (state.connect_failures, state.errors_5xx) == (0, 0)


@pytest.mark.parametrize(
    ("now", "lifted"),
    [(0.0, False), (9.999, False), (10.0, True), (50.0, True)],
)
def test_probe_lifts_only_after_expiry(now, lifted):
    state = OutlierState(CONFIG)
    ejection = feed(state, "ccc")[-1]
    assert ejection is not None
    state.eject(ejection)
    assert state.probe_passed(now) is lifted
    assert (state.ejected_until is None) is lifted


def test_probe_without_ejection_lifts_nothing():
    state = OutlierState(CONFIG)
    assert state.probe_passed(100.0) is False


def test_after_lift_a_new_streak_ejects_again_for_longer():
    state = OutlierState(CONFIG)
    first = feed(state, "ccc", 0.0)[-1]
    assert first is not None
    state.eject(first)
    assert state.probe_passed(10.0)
    assert feed(state, "cc", 10.0) == [None, None]
    second = state.record("connect_failure", 10.0)
    assert second == Ejection(30.0, "3 connect failures in a row")


def test_repr():
    state = OutlierState(CONFIG)
    state.record("5xx", 0.0)
    assert repr(state) == ("<OutlierState connect_failures=0 5xx=1 ejections=0 ejected_until=None>")


@pytest.mark.parametrize(
    ("ejected", "total", "percent", "allowed"),
    [
        (0, 1, 50, True),  # one may always go...
        (0, 2, 50, True),
        (1, 2, 50, False),
        (0, 4, 50, True),
        (1, 4, 50, True),
        (2, 4, 50, False),
        (1, 4, 49, False),
        (2, 10, 30, True),
        (3, 10, 30, False),
        (0, 3, 10, True),  # ...even when 10 % of 3 is less than one
        (1, 3, 10, False),
        (0, 5, 0, False),  # ...unless the share is 0
        (4, 5, 100, True),
        (5, 5, 100, False),
        (0, 0, 50, False),
    ],
)
def test_may_eject(ejected, total, percent, allowed):
    assert may_eject(ejected, total, percent) is allowed
