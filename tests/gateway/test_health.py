"""HealthState: a table of probe histories and the transitions they cause."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.health.state import HealthState, Transition
from gateway.pool.upstream import Health

U, H, X = Health.UNKNOWN, Health.HEALTHY, Health.UNHEALTHY


def run(history: str, rise: int = 2, fall: int = 3) -> list[tuple[int, Health, Health]]:
    """Feed ``history`` (``+`` pass, ``-`` fail) at now = 1, 2, ...; the transitions."""
    state = HealthState(rise, fall, now=0.0)
    out = []
    for i, mark in enumerate(history, start=1):
        transition = state.observe(mark == "+", float(i))
        if transition is not None:
            assert transition.at == float(i)
            out.append((i, transition.old, transition.new))
    return out


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ("", []),
        ("+", []),
        ("++", [(2, U, H)]),
        ("+++++", [(2, U, H)]),
        ("--", []),
        ("---", [(3, U, X)]),
        ("------", [(3, U, X)]),
        ("++---", [(2, U, H), (5, H, X)]),
        ("++--+--", [(2, U, H)]),  # a pass resets the failure streak
        ("++--+---", [(2, U, H), (8, H, X)]),
        ("---+-++", [(3, U, X), (7, X, H)]),  # a failure resets the pass streak
        ("---++", [(3, U, X), (5, X, H)]),
        ("++---++---", [(2, U, H), (5, H, X), (7, X, H), (10, H, X)]),
        ("+-+-+-+-+-+-", []),  # flapping never crosses either threshold
        ("--+--+--+", []),
        ("-+", []),
    ],
)
def test_transitions(history, expected):
    assert run(history) == expected


@pytest.mark.parametrize(
    ("history", "rise", "fall", "expected"),
    [
        ("+", 1, 1, [(1, U, H)]),
        ("-", 1, 1, [(1, U, X)]),
        ("+-+-", 1, 1, [(1, U, H), (2, H, X), (3, X, H), (4, H, X)]),
        ("+++-", 3, 1, [(3, U, H), (4, H, X)]),
        ("++", 3, 1, []),
        ("++-+++", 3, 1, [(3, U, X), (6, X, H)]),
        ("-----", 1, 5, [(5, U, X)]),
    ],
)
def test_thresholds(history, rise, fall, expected):
    assert run(history, rise, fall) == expected


def test_counters_and_reasons():
    state = HealthState(2, 2, now=5.0)
    assert (state.health, state.successes, state.failures, state.since) == (U, 0, 0, 5.0)

    assert state.observe(True, 6.0) is None
    assert (state.successes, state.failures) == (1, 0)
    assert state.observe(True, 7.0) == Transition(U, H, 7.0, "probe passed")
    assert state.since == 7.0

    assert state.observe(False, 8.0, "status 500") is None
    assert (state.successes, state.failures, state.last_reason) == (0, 1, "status 500")
    assert state.observe(False, 9.0, "connection refused") == Transition(
        H, X, 9.0, "connection refused"
    )
    assert state.since == 9.0
    assert state.observe(False, 10.0) is None  # already unhealthy: no repeated transition
    assert state.failures == 3
    assert state.observe(True, 11.0) is None
    assert state.observe(True, 12.0, "") == Transition(X, H, 12.0, "probe passed")


def test_default_failure_reason():
    state = HealthState(1, 1, now=0.0)
    transition = state.observe(False, 1.0)
    assert transition is not None
    assert transition.reason == "probe failed"


def test_thresholds_can_change_between_observations():
    state = HealthState(5, 5, now=0.0)
    state.observe(True, 1.0)
    state.healthy_threshold = 2
    transition = state.observe(True, 2.0)
    assert transition is not None
    assert transition.new is H


def test_repr():
    state = HealthState(2, 3, now=1.5)
    state.observe(False, 2.0)
    assert repr(state) == "<HealthState unknown successes=0 failures=1 since=1.5>"


@given(
    st.lists(st.booleans(), max_size=60),
    st.integers(min_value=1, max_value=5),
    st.integers(min_value=1, max_value=5),
)
def test_transitions_follow_exactly_the_streaks(history, rise, fall):
    """A transition happens iff a streak just reached its threshold from the other side."""
    state = HealthState(rise, fall, now=0.0)
    streak_ok = streak_bad = 0
    health = U
    for i, ok in enumerate(history):
        streak_ok, streak_bad = (streak_ok + 1, 0) if ok else (0, streak_bad + 1)
        transition = state.observe(ok, float(i))
        if ok and health is not H and streak_ok >= rise:
            assert transition == Transition(health, H, float(i), "probe passed")
            health = H
        elif not ok and health is not X and streak_bad >= fall:
            assert transition == Transition(health, X, float(i), "probe failed")
            health = X
        else:
            assert transition is None
        assert state.health is health
        assert (state.successes, state.failures) == (streak_ok, streak_bad)
