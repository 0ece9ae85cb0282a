"""The planner's rules, one group each, on hand-built observed states at literal instants.

The generated histories in ``test_planner_properties.py`` check the same rules over many
states; these tables pin the exact actions of the cases the rules are written for.
"""

from __future__ import annotations

from typing import Any

import pytest

from controller.planning.actions import (
    AbandonRollout,
    Action,
    BeginRollout,
    CompleteRollout,
    Drain,
    FailReplica,
    FailRollout,
    Forget,
    KeepFailed,
    PauseRollout,
    Rescale,
    ResumeRollout,
    SetDegraded,
    Start,
    Stop,
    Undrain,
    WakeAt,
)
from controller.planning.autoscaler import Memory, Sample
from controller.planning.model import (
    Backoff,
    Intent,
    Observed,
    Replica,
    ReplicaState,
    Rollout,
    RolloutKind,
    RolloutStatus,
)
from controller.planning.planner import Desired, backoff_delay, fmt_seconds, plan
from controller.scaling import Autoscaling
from controller.spec import RolloutStrategy

S = ReplicaState
NO_CAPACITY = "no capacity: 1 of 1 slots in use"
NO_BACKOFF = Backoff()

# -- building blocks -----------------------------------------------------------------------


def ready(rid: str, rev: int, *, created: float = 0.0, at: float | None = None) -> Replica:
    """Ready since ``at`` (by default since it was created)."""
    since = created if at is None else at
    return Replica(rid, rev, S.READY, created, since, ready_since=since, address=f"h:{rid}")


def starting(rid: str, rev: int, *, created: float = 0.0) -> Replica:
    return Replica(rid, rev, S.STARTING, created, created, address=f"h:{rid}")


def requested(rid: str, rev: int, *, created: float = 0.0) -> Replica:
    return Replica(rid, rev, S.REQUESTED, created, created)


def unhealthy(rid: str, rev: int, *, since: float) -> Replica:
    return Replica(rid, rev, S.UNHEALTHY, 0.0, since, ready_since=0.0, address=f"h:{rid}")


def draining(
    rid: str,
    rev: int,
    *,
    drained: bool = False,
    since: float = 0.0,
    placed: bool = True,
    failure: str = "",
) -> Replica:
    """Draining since ``since``; ``placed``: the backend gave it an address."""
    address = f"h:{rid}" if placed else None
    return Replica(rid, rev, S.DRAINING, 0.0, since, 0.0, address, drained, failure, healthy=True)


def gone(rid: str, rev: int, state: S = S.STOPPED, failure: str = "") -> Replica:
    return Replica(rid, rev, state, 0.0, 0.0, failure=failure)


def rollout(
    from_rev: int | None,
    to_rev: int,
    *,
    started: float = 0.0,
    failures: int = 0,
    status: RolloutStatus = RolloutStatus.PROGRESSING,
    kind: RolloutKind = "rollout",
    reason: str = "",
) -> Rollout:
    return Rollout(7, from_rev, to_rev, kind, status, started, failures, reason)


def observed(
    *replicas: Replica,
    rollout: Rollout | None = None,
    serving: int | None = 1,
    backoff: Backoff = NO_BACKOFF,
    degraded: str | None = None,
) -> Observed:
    target = rollout.to_revision if rollout is not None else serving
    return Observed(replicas, serving, rollout, backoff, degraded, target)


def desired(
    rev: int,
    replicas: int = 1,
    *,
    paused: bool = False,
    deleting: bool = False,
    intent: Intent = "apply",
    static: bool = False,
    **strategy: object,
) -> Desired:
    return Desired(rev, replicas, RolloutStrategy(**strategy), paused, deleting, intent, static)


def decisions(actions: list[Action]) -> list[Action]:
    """The actions that change something (no WakeAt, no SetDegraded)."""
    return [a for a in actions if not isinstance(a, (WakeAt, SetDegraded))]


def wake(actions: list[Action]) -> float | None:
    at = [a.at for a in actions if isinstance(a, WakeAt)]
    assert len(at) <= 1
    return at[0] if at else None


def degraded(actions: list[Action]) -> list[str | None]:
    return [a.reason for a in actions if isinstance(a, SetDegraded)]


def replaced(rid: str, rev: int = 2) -> Drain:
    return Drain(rid, f"replaced by revision {rev}")


# -- first start ---------------------------------------------------------------------------


def test_a_new_service_starts_its_desired_replicas_at_once():
    actions = plan(observed(rollout=rollout(None, 1), serving=None), desired(1, 3), now=0.0)
    assert actions == [
        Start(1),
        Start(1),
        Start(1),
        SetDegraded("0 of 3 replicas ready"),
        WakeAt(1800.0),  # the progress deadline
    ]


def test_a_new_service_starts_nothing_more_while_its_replicas_start():
    o = observed(
        requested("a", 1, created=0.0),
        starting("b", 1, created=0.0),
        starting("c", 1, created=10.0),
        rollout=rollout(None, 1),
        serving=None,
        degraded="0 of 3 replicas ready",
    )
    assert plan(o, desired(1, 3), now=20.0) == [WakeAt(600.0)]  # a's start timeout


def test_a_new_service_completes_when_all_its_replicas_are_available():
    o = observed(ready("a", 1), ready("b", 1), rollout=rollout(None, 1), serving=None, degraded="x")
    assert decisions(plan(o, desired(1, 2), now=1.0)) == [CompleteRollout(7)]
    assert degraded(plan(o, desired(1, 2), now=1.0)) == [None]


# -- the rolling update, step by step (max_surge 1, max_unavailable 0, min_ready 5 s) --------

ROLL = rollout(1, 2, started=100.0)


def test_rolling_update_starts_one_new_replica_and_keeps_the_old():
    o = observed(ready("a", 1), rollout=ROLL)
    assert plan(o, desired(2, min_ready=5), now=100.0) == [Start(2), WakeAt(1900.0)]


@pytest.mark.parametrize(
    "new",
    [
        requested("x", 2, created=100.0),
        starting("x", 2, created=100.0),
        unhealthy("x", 2, since=110.0),
        ready("x", 2, created=100.0, at=118.0),  # ready, not yet for min_ready
    ],
    ids=["requested", "starting", "unhealthy", "within-min-ready"],
)
def test_rolling_update_drains_no_old_replica_before_a_new_one_is_available(new):
    o = observed(ready("a", 1), new, rollout=ROLL)
    assert decisions(plan(o, desired(2, min_ready=5), now=120.0)) == []


def test_rolling_update_wakes_when_the_new_replica_has_been_ready_for_min_ready():
    o = observed(ready("a", 1), ready("x", 2, created=100.0, at=120.0), rollout=ROLL)
    actions = plan(o, desired(2, min_ready=5), now=122.0)
    assert actions == [WakeAt(125.0)]
    assert plan(o, desired(2, min_ready=5), now=124.999) == [WakeAt(125.0)]
    assert plan(o, desired(2, min_ready=5), now=125.0) == [replaced("a"), WakeAt(1900.0)]


D2 = desired(2, 2, min_ready=5)
X = ready("x", 2, created=100.0, at=120.0)


def test_rolling_update_drains_one_old_replica_the_oldest():
    o = observed(ready("a", 1, created=0.0), ready("b", 1, created=1.0), X, rollout=ROLL)
    assert decisions(plan(o, D2, now=130.0)) == [replaced("a")]


@pytest.mark.parametrize(
    "a",
    [draining("a", 1), Replica("a", 1, S.STOPPING, 0.0, 0.0)],
    ids=["draining", "stopping"],
)
def test_rolling_update_waits_while_the_old_replica_leaves(a):
    o = observed(a, ready("b", 1, created=1.0), X, rollout=ROLL)
    assert decisions(plan(o, D2, now=130.0)) == []  # no Stop yet, no Start: a holds its slot


def test_rolling_update_stops_the_old_replica_only_after_its_drain():
    o = observed(draining("a", 1, drained=True), ready("b", 1, created=1.0), X, rollout=ROLL)
    assert decisions(plan(o, D2, now=140.0)) == [Stop("a")]  # and still no Start


def test_rolling_update_starts_the_next_new_replica_once_the_slot_is_free():
    o = observed(gone("a", 1), ready("b", 1, created=1.0), X, rollout=ROLL)
    assert decisions(plan(o, D2, now=150.0)) == [Start(2)]


def test_rolling_update_drains_the_last_old_replica_then_completes():
    y = ready("y", 2, created=150.0, at=160.0)
    o = observed(gone("a", 1), ready("b", 1, created=1.0), X, y, rollout=ROLL)
    assert decisions(plan(o, D2, now=164.0)) == []  # y within min_ready
    assert decisions(plan(o, D2, now=165.0)) == [replaced("b")]
    o = observed(gone("a", 1), draining("b", 1), X, y, rollout=ROLL)
    assert decisions(plan(o, D2, now=166.0)) == [CompleteRollout(7)]


def test_max_surge_2_starts_two_new_replicas():
    o = observed(ready("a", 1), ready("b", 1), rollout=ROLL)
    assert decisions(plan(o, desired(2, 2, max_surge=2), now=100.0)) == [Start(2), Start(2)]


def test_max_unavailable_1_with_max_surge_0_drains_an_old_replica_first():
    """The documented choice: without surge there is no slot for a new replica, so the
    rollout takes one old replica away (down to D - 1) and starts in its slot."""
    s: dict[str, Any] = {"max_surge": 0, "max_unavailable": 1}
    o = observed(ready("a", 1, created=0.0), ready("b", 1, created=1.0), rollout=ROLL)
    assert decisions(plan(o, desired(2, 2, **s), now=100.0)) == [replaced("a")]
    o = observed(draining("a", 1), ready("b", 1, created=1.0), rollout=ROLL)
    assert decisions(plan(o, desired(2, 2, **s), now=101.0)) == []  # b stays: D - 1 = 1
    o = observed(gone("a", 1), ready("b", 1, created=1.0), rollout=ROLL)
    assert decisions(plan(o, desired(2, 2, **s), now=110.0)) == [Start(2)]


# -- giving up on a replica ----------------------------------------------------------------


@pytest.mark.parametrize("new", [requested, starting], ids=["requested", "starting"])
def test_a_replica_not_ready_within_start_timeout_is_failed(new):
    o = observed(ready("a", 1), new("x", 2, created=10.0), rollout=rollout(1, 2))
    d = desired(2, start_timeout="2m")
    assert plan(o, d, now=129.0) == [WakeAt(130.0)]
    assert decisions(plan(o, d, now=130.0)) == [FailReplica("x", "not ready within 2m")]


def test_a_failed_replica_keeps_its_slot_so_its_replacement_waits():
    # x is drained next and holds a backend slot until stopped; a Start in the same plan
    # would exceed D + max_surge and, on a full fleet, fail again for no capacity.
    o = observed(ready("a", 1), starting("x", 2), rollout=rollout(1, 2))
    actions = plan(o, desired(2, start_timeout=120), now=120.0)
    assert decisions(actions) == [FailReplica("x", "not ready within 2m")]


def test_a_replica_unhealthy_for_start_timeout_is_failed():
    o = observed(ready("a", 1), unhealthy("x", 2, since=50.0), rollout=rollout(1, 2))
    d = desired(2, start_timeout=120)
    assert plan(o, d, now=169.0) == [WakeAt(170.0)]
    assert decisions(plan(o, d, now=170.0)) == [FailReplica("x", "unhealthy for 2m")]


def test_a_ready_replica_is_never_given_up_however_old():
    o = observed(ready("a", 1), rollout=None)
    assert plan(o, desired(1, start_timeout=1), now=1e9) == []


@pytest.mark.parametrize(
    ("status", "pausing"),
    [
        (RolloutStatus.PROGRESSING, [PauseRollout(7, "paused by request")]),
        (RolloutStatus.PAUSED, []),
    ],
    ids=["pause-asked", "paused"],
)
def test_a_paused_service_gives_up_on_nothing(status, pausing):
    o = observed(ready("a", 1), starting("x", 2), rollout=rollout(1, 2, status=status))
    assert decisions(plan(o, desired(2, paused=True), now=1000.0)) == pausing


# -- failing a rollout ---------------------------------------------------------------------


def test_a_rollout_fails_when_its_failures_exceed_retries():
    o = observed(
        ready("a", 1),
        gone("x", 2, S.FAILED, NO_CAPACITY),
        rollout=rollout(1, 2, failures=3),
        backoff=Backoff(3, 100.0, NO_CAPACITY),
    )
    assert plan(o, desired(2, retries=2), now=101.0) == [
        FailRollout(7, "no capacity: 1 of 1 slots in use (after 3 failures)"),
        BeginRollout(2, 1, "rollback"),
        WakeAt(101.0),
    ]


def test_a_rollout_within_its_retries_does_not_fail():
    o = observed(
        ready("a", 1), rollout=rollout(1, 2, failures=2), backoff=Backoff(2, 100.0, NO_CAPACITY)
    )
    assert not [a for a in plan(o, desired(2, retries=2), now=200.0) if isinstance(a, FailRollout)]


def test_a_failed_rollout_without_a_recorded_reason_says_what_failed():
    o = observed(ready("a", 1), rollout=rollout(1, 2, failures=1))
    assert plan(o, desired(2, retries=0), now=1.0) == [
        FailRollout(7, "replicas of the new revision failed (after 1 failure)"),
        BeginRollout(2, 1, "rollback"),
        WakeAt(1.0),
    ]


def test_a_rollout_fails_at_its_progress_deadline_and_touches_no_old_replica():
    o = observed(ready("a", 1), starting("x", 2, created=1500.0), rollout=rollout(1, 2))
    assert plan(o, desired(2), now=1799.0) == [WakeAt(1800.0)]
    assert plan(o, desired(2), now=1800.0) == [
        FailRollout(7, "not complete within 30m"),
        BeginRollout(2, 1, "rollback"),
        WakeAt(1800.0),
    ]


def test_the_progress_deadline_reason_names_the_last_failure():
    o = observed(
        ready("a", 1), rollout=rollout(1, 2), backoff=Backoff(1, 1700.0, "exited with code 1")
    )
    assert plan(o, desired(2), now=1800.0) == [
        FailRollout(7, "not complete within 30m; last failure: exited with code 1"),
        BeginRollout(2, 1, "rollback"),
        WakeAt(1800.0),
    ]


def test_a_paused_rollout_has_no_deadline():
    o = observed(ready("a", 1), rollout=rollout(1, 2, status=RolloutStatus.PAUSED, failures=9))
    assert plan(o, desired(2, paused=True), now=1e6) == []


def test_after_a_rollback_the_failed_revision_goes_and_the_old_comes_back():
    back = rollout(2, 1, kind="rollback", started=500.0)
    o = observed(
        ready("a", 1, created=0.0),
        ready("x", 2, created=100.0),
        starting("y", 2, created=200.0),
        rollout=back,
    )
    d = desired(1, 2)
    assert decisions(plan(o, d, now=500.0)) == [replaced("y", 1)]  # x serves until replaced
    o = observed(ready("a", 1), ready("x", 2, created=100.0), gone("y", 2), rollout=back)
    assert decisions(plan(o, d, now=510.0)) == [Start(1)]
    o = observed(ready("a", 1), ready("x", 2), gone("y", 2), ready("b", 1), rollout=back)
    assert decisions(plan(o, d, now=520.0)) == [replaced("x", 1)]


def back_to(rid: str, rev: int = 1) -> Undrain:
    return Undrain(rid, f"serves again: back to revision {rev}")


FAILING = rollout(1, 2, started=100.0, failures=3)
FAILED_AT = Backoff(3, 150.0, "exited with code 1")
WHY = "exited with code 1 (after 3 failures)"


def test_a_failed_rollout_rolls_back_and_takes_back_old_replicas_still_draining():
    o = observed(
        ready("a", 1),
        draining("b", 1, since=110.0),
        draining("c", 1, since=120.0),
        starting("x", 2, created=140.0),
        rollout=FAILING,
        backoff=FAILED_AT,
    )
    assert plan(o, desired(2, 3, retries=2), now=160.0) == [
        FailRollout(7, WHY),
        BeginRollout(2, 1, "rollback"),
        back_to("c"),  # newest drained first
        back_to("b"),
        WakeAt(160.0),
    ]


def test_a_failed_rollout_in_pause_mode_is_paused_and_touches_nothing():
    o = observed(
        ready("a", 1),
        draining("b", 1, since=110.0),
        starting("x", 2, created=140.0),
        rollout=FAILING,
        backoff=FAILED_AT,
    )
    d = desired(2, 2, retries=2, on_failure="pause")
    assert plan(o, d, now=160.0) == [PauseRollout(7, WHY), WakeAt(160.0)]
    # The deadline too; and once paused (desired.paused follows), nothing at all.
    late = observed(
        ready("a", 1), draining("b", 1, since=110.0), rollout=FAILING.replace(failures=0)
    )
    assert plan(late, d, now=1900.0) == [PauseRollout(7, "not complete within 30m"), WakeAt(1900.0)]
    paused = o.replace(rollout=FAILING.replace(status=RolloutStatus.PAUSED, reason=WHY))
    assert decisions(plan(paused, d.replace(paused=True), now=1e6)) == []


NOT_READY = "not ready within 1m: connection refused"


def hung(rid: str = "x", created: float = 100.0, failure: str = "") -> Replica:
    """A replica of revision 2 that runs and never became ready (its probes refused)."""
    r = starting(rid, 2, created=created)
    return r.replace(probe_failure="connection refused", failure=failure)


def test_in_pause_mode_the_replica_whose_give_up_fails_the_rollout_is_kept():
    # The give-up that spends the retries pauses the rollout in the same plan, and the
    # replica is kept running for inspection (counted as failed), not drained and stopped.
    o = observed(
        ready("a", 1),
        ready("b", 1),
        hung(),
        rollout=rollout(1, 2, started=100.0, failures=2),
        backoff=Backoff(2, 90.0, "exited with code 1"),
    )
    d = desired(2, 2, retries=2, on_failure="pause", start_timeout=60)
    assert plan(o, d, now=160.0) == [
        KeepFailed("x", NOT_READY),
        PauseRollout(7, f"{NOT_READY} (after 3 failures)"),
        WakeAt(160.0),
    ]
    # The deadline passing as it is given up: kept too, its failure said.
    late = o.replace(rollout=rollout(1, 2, started=100.0))
    assert plan(late, d, now=1900.0) == [
        KeepFailed("x", NOT_READY),
        PauseRollout(7, f"not complete within 30m; last failure: {NOT_READY}"),
        WakeAt(1900.0),
    ]
    # With retries left, or rolling back on failure, it is given up as before.
    for other in (
        desired(2, 2, retries=3, on_failure="pause", start_timeout=60),
        desired(2, 2, retries=2, on_failure="rollback", start_timeout=60),
    ):
        actions = plan(o, other, now=160.0)
        assert FailReplica("x", NOT_READY) in actions
        assert not [a for a in actions if isinstance(a, (KeepFailed, PauseRollout, FailRollout))]


def test_a_resumed_rollout_replaces_its_kept_replica_with_its_retries_afresh():
    kept = hung(failure=NOT_READY)
    paused = rollout(1, 2, status=RolloutStatus.PAUSED, failures=1, reason=NOT_READY)
    o = observed(ready("a", 1), kept, rollout=paused, backoff=Backoff(1, 160.0, NOT_READY))
    d = desired(2, 1, retries=0, on_failure="pause", start_timeout=60)
    assert plan(o, d, now=500.0) == [ResumeRollout(7), WakeAt(500.0)]
    # Resumed (ResumeRollout's transition): the kept replica, still not ready, is given up
    # without counting against the fresh retries (so it does not pause again at once); a
    # fresh replica starts once it stopped (it holds its slot until then: max_surge).
    resumed = o.replace(rollout=rollout(1, 2, started=500.0), backoff=NO_BACKOFF)
    assert decisions(plan(resumed, d, now=500.0)) == [FailReplica("x", NOT_READY, counts=False)]
    stopped = resumed.replace(replicas=(ready("a", 1), gone("x", 2, S.FAILED, NOT_READY)))
    assert decisions(plan(stopped, d, now=510.0)) == [Start(2)]
    # One that came up while paused (its failure cleared) completes the rollout instead.
    up = resumed.replace(replicas=(ready("a", 1), ready("x", 2, created=100.0, at=400.0)))
    assert decisions(plan(up, d, now=500.0)) == [Drain("a", "replaced by revision 2")]


def test_a_replica_whose_time_ran_out_while_paused_is_replaced_uncounted_once_resumed():
    # Paused (by request, or by a no-capacity failure), a starting replica is held past its
    # start_timeout; resumed, the rollout has its retries afresh: the give-up spends none.
    o = observed(ready("a", 1), hung(), rollout=rollout(1, 2, started=500.0))
    d = desired(2, 1, retries=0, on_failure="pause", start_timeout=60)
    assert decisions(plan(o, d, now=500.0)) == [FailReplica("x", NOT_READY, counts=False)]
    # Its time running out after the resume, it counts (and pauses it again: kept).
    o = observed(ready("a", 1), hung(created=480.0), rollout=rollout(1, 2, started=500.0))
    assert decisions(plan(o, d, now=540.0)) == [
        KeepFailed("x", NOT_READY),
        PauseRollout(7, f"{NOT_READY} (after 1 failure)"),
    ]


@pytest.mark.parametrize(
    ("kept", "expected"),
    [
        (hung(failure=NOT_READY), [FailReplica("x", NOT_READY, counts=False), CompleteRollout(7)]),
        (ready("x", 2, created=100.0), [Drain("x", "replaced by revision 1")]),
    ],
    ids=["still-unready", "came-up"],
)
def test_an_abort_after_a_pause_on_failure_stops_the_kept_replicas(kept, expected):
    paused = rollout(1, 2, status=RolloutStatus.PAUSED, failures=1, reason=NOT_READY)
    o = observed(ready("a", 1), kept, rollout=paused)
    d = desired(1, 1, paused=True, intent="abort", on_failure="pause", start_timeout=60)
    assert decisions(plan(o, d, now=500.0)) == [
        AbandonRollout(7, "aborted", "aborted by request"),
        BeginRollout(2, 1, "rollback"),
    ]
    # The rollback (BeginRollout's transition) takes the kept replica down: it is old.
    back = observed(ready("a", 1), kept, rollout=rollout(2, 1, kind="rollback", started=500.0))
    assert decisions(plan(back, d.replace(paused=False), now=500.0)) == expected


@pytest.mark.parametrize("on_failure", ["rollback", "pause"])
def test_a_failed_rollback_ends_failed_and_goes_nowhere(on_failure):
    back = rollout(2, 1, kind="rollback", failures=3)
    o = observed(ready("x", 2), draining("y", 2, since=50.0), rollout=back, backoff=FAILED_AT)
    d = desired(1, 2, retries=2, on_failure=on_failure)
    assert plan(o, d, now=160.0) == [FailRollout(7, WHY), WakeAt(160.0)]


def test_a_failed_first_rollout_ends_failed_with_nothing_to_go_back_to():
    o = observed(rollout=rollout(None, 1, failures=3), serving=None, backoff=FAILED_AT)
    assert plan(o, desired(1, 2, retries=2), now=160.0) == [FailRollout(7, WHY), WakeAt(160.0)]


# -- backoff -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "delay"), [(0, 0.0), (1, 10.0), (2, 20.0), (3, 40.0), (4, 60.0), (500, 60.0)]
)
def test_backoff_doubles_up_to_its_cap(failures, delay):
    assert backoff_delay(failures, RolloutStrategy(retry_backoff=10, max_retry_backoff=60)) == delay


def test_after_a_failure_no_start_until_the_backoff_then_exactly_one():
    o = observed(
        ready("a", 1),
        ready("b", 1),
        ready("c", 1),
        gone("x", 2, S.FAILED, "exited with code 1"),
        rollout=rollout(1, 2),
        backoff=Backoff(1, 100.0, "exited with code 1"),
    )
    d = desired(2, 3, max_surge=3, retry_backoff=10)
    assert plan(o, d, now=100.0) == [WakeAt(110.0)]
    assert plan(o, d, now=109.9) == [WakeAt(110.0)]
    assert decisions(plan(o, d, now=110.0)) == [Start(2)]  # room for 3, but one probe
    no_backoff = o.replace(backoff=Backoff())
    assert decisions(plan(no_backoff, d, now=100.0)) == [Start(2)] * 3


def test_the_backoff_grows_with_the_failures():
    o = observed(ready("a", 1), rollout=rollout(1, 2, failures=2), backoff=Backoff(3, 100.0, "x"))
    d = desired(2, retry_backoff=10, retries=5)
    assert plan(o, d, now=100.0) == [WakeAt(140.0)]
    assert decisions(plan(o, d, now=140.0)) == [Start(2)]


# -- a scale-up that cannot be placed ------------------------------------------------------


def test_a_scale_up_that_found_no_capacity_is_degraded_and_touches_nothing():
    o = observed(
        ready("a", 1),
        gone("f", 1, S.FAILED, NO_CAPACITY),
        backoff=Backoff(1, 100.0, NO_CAPACITY),
    )
    assert plan(o, desired(1, 2), now=100.5) == [
        SetDegraded("1 of 2 replicas ready: no capacity: 1 of 1 slots in use"),
        WakeAt(101.0),
    ]


def test_a_scale_up_retries_placement_after_the_backoff_and_never_drains():
    reason = "1 of 2 replicas ready: " + NO_CAPACITY
    for failures in (1, 5, 50):
        o = observed(
            ready("a", 1),
            *(gone(f"f{i}", 1, S.FAILED, NO_CAPACITY) for i in range(failures)),
            backoff=Backoff(failures, 100.0, NO_CAPACITY),
            degraded=reason,
        )
        d = desired(1, 2)
        at = 100.0 + backoff_delay(failures, d.strategy)
        assert plan(o, d, now=at - 0.5) == [WakeAt(at)]
        assert plan(o, d, now=at) == [Start(1)]


def test_a_degraded_service_clears_the_condition_once_ready():
    o = observed(ready("a", 1), ready("b", 1), degraded="1 of 2 replicas ready")
    assert plan(o, desired(1, 2), now=1.0) == [SetDegraded(None)]


# -- scale-down ----------------------------------------------------------------------------


def scaled(rid: str) -> Drain:
    return Drain(rid, "scaled down")


def test_a_scale_down_drains_the_not_ready_first_then_the_newest():
    o = observed(
        ready("a", 1, created=0.0),
        ready("b", 1, created=10.0),
        starting("c", 1, created=20.0),
        unhealthy("d", 1, since=30.0),
    )
    # c and d serve nothing: they go first (newest first), then the newest ready one.
    assert decisions(plan(o, desired(1, 2), now=100.0)) == [scaled("c"), scaled("d")]
    assert decisions(plan(o, desired(1, 1), now=100.0)) == [scaled("c"), scaled("d"), scaled("b")]


def test_a_scale_down_keeps_a_ready_replica_over_an_older_starting_one():
    # c is ready but not yet for min_ready: it serves, a and b do not. Draining c first
    # (newest, "not available") would leave no ready replica at all.
    o = observed(
        starting("a", 1, created=0.0),
        starting("b", 1, created=5.0),
        ready("c", 1, created=10.0, at=50.0),
    )
    assert decisions(plan(o, desired(1, 1, min_ready=30), now=60.0)) == [scaled("b"), scaled("a")]


def test_a_scale_down_never_goes_below_d_minus_max_unavailable():
    o = observed(ready("a", 1, created=0.0), ready("b", 1, created=10.0))
    assert plan(o, desired(1, 1), now=100.0) == [scaled("b")]
    during = observed(
        ready("o", 1, created=0.0),
        ready("x", 2, created=10.0),
        ready("y", 2, created=20.0),
        rollout=rollout(1, 2),
    )
    actions = plan(during, desired(2, 1), now=100.0)
    assert decisions(actions) == [replaced("o"), scaled("y")]  # x stays: D - 0 = 1


def test_a_scale_to_zero_drains_everything():
    o = observed(ready("a", 1, created=0.0), ready("b", 1, created=10.0))
    assert plan(o, desired(1, 0), now=100.0) == [scaled("b"), scaled("a")]


# -- superseding apply ---------------------------------------------------------------------


def test_a_superseding_apply_treats_both_older_revisions_as_old():
    r13 = rollout(1, 3, started=200.0)
    d = desired(3, 2)
    o = observed(ready("a", 1, created=0.0), ready("x", 2, created=100.0), rollout=r13)
    assert decisions(plan(o, d, now=200.0)) == [Start(3)]  # neither is drained yet
    z = ready("z", 3, created=200.0, at=210.0)
    o = observed(ready("a", 1, created=0.0), ready("x", 2, created=100.0), z, rollout=r13)
    # The superseded target before the serving revision (rule 5): r1 serves on.
    assert decisions(plan(o, d, now=220.0)) == [replaced("x", 3)]
    w = ready("w", 3, created=220.0, at=230.0)
    o = observed(ready("a", 1, created=0.0), gone("x", 2), z, w, rollout=r13)
    assert decisions(plan(o, d, now=240.0)) == [replaced("a", 3)]
    o = observed(draining("a", 1), gone("x", 2), z, w, rollout=r13)
    assert decisions(plan(o, d, now=250.0)) == [CompleteRollout(7)]


# -- beginning a rollout (rule 7) ----------------------------------------------------------

RUNNING = rollout(1, 2)


@pytest.mark.parametrize(
    ("o", "d", "expected"),
    [
        (
            observed(ready("a", 1)),
            desired(2),
            [BeginRollout(1, 2, "rollout")],
        ),
        (
            observed(serving=None),
            desired(1, 2),
            [BeginRollout(None, 1, "rollout")],
        ),
        (
            observed(ready("a", 1), starting("x", 2), rollout=RUNNING),
            desired(3),
            [
                AbandonRollout(7, "superseded", "superseded by a rollout to revision 3"),
                BeginRollout(1, 3, "rollout"),
            ],
        ),
        (  # an apply of the serving spec: a rollback from the target it leaves
            observed(ready("a", 1), starting("x", 2), rollout=RUNNING),
            desired(1),
            [
                AbandonRollout(7, "superseded", "superseded by a rollback to revision 1"),
                BeginRollout(2, 1, "rollback"),
            ],
        ),
        (
            observed(ready("a", 1), starting("x", 2), rollout=RUNNING),
            desired(1, intent="abort"),
            [AbandonRollout(7, "aborted", "aborted by request"), BeginRollout(2, 1, "rollback")],
        ),
        (
            observed(
                ready("a", 1),
                starting("x", 2),
                rollout=RUNNING.replace(status=RolloutStatus.PAUSED),
            ),
            desired(1, paused=True, intent="abort"),
            [AbandonRollout(7, "aborted", "aborted by request"), BeginRollout(2, 1, "rollback")],
        ),
        (
            observed(ready("x", 2), serving=2),
            desired(1, intent="undo"),
            [BeginRollout(2, 1, "undo")],
        ),
        (  # a rollout that has ended (failed) is not abandoned again
            observed(ready("a", 1), rollout=RUNNING.replace(status=RolloutStatus.FAILED)),
            desired(3),
            [BeginRollout(1, 3, "rollout")],
        ),
    ],
    ids=[
        "apply",
        "new-service",
        "superseding-apply",
        "apply-of-the-serving-spec",
        "abort",
        "abort-while-paused",
        "undo",
        "after-an-ended-rollout",
    ],
)
def test_a_new_desired_revision_begins_a_rollout_and_ends_the_active_one(o, d, expected):
    assert plan(o, d, now=300.0) == [*expected, WakeAt(300.0)]


def test_a_new_target_starts_and_drains_nothing_in_the_plan_that_begins_it():
    # Nothing serving is touched until the planner plans against the new rollout (rule 5).
    o = observed(ready("a", 1), ready("x", 2, created=10.0), rollout=RUNNING)
    actions = plan(o, desired(3, 2), now=300.0)
    assert not [a for a in actions if isinstance(a, (Start, Drain, Stop, FailReplica))]


def test_the_new_targets_draining_replicas_serve_again_up_to_d_newest_first():
    o = observed(
        ready("a", 1),
        ready("x", 2),
        draining("p", 1, since=10.0),
        draining("q", 1, since=30.0),
        draining("r", 1, since=20.0),
        draining("s", 1, since=40.0, drained=True),  # its drain is over: stopped next
        draining("f", 1, since=50.0, failure="unhealthy for 2m"),  # given up
        draining("u", 1, since=60.0, placed=False),  # never placed: nothing to route to
        draining("y", 2, since=70.0),  # of the revision being left
        rollout=RUNNING,
    )
    actions = plan(o, desired(1, 3), now=300.0)
    undrains = [a for a in actions if isinstance(a, Undrain)]
    assert undrains == [back_to("q"), back_to("r")]  # D = 3, one of revision 1 live


@pytest.mark.parametrize(
    ("replicas", "count"),
    [(1, 0), (2, 1), (5, 3)],
)
def test_no_more_draining_replicas_serve_again_than_the_target_lacks(replicas, count):
    o = observed(
        ready("a", 1),
        draining("p", 1, since=10.0),
        draining("q", 1, since=30.0),
        draining("r", 1, since=20.0),
        starting("x", 2),
        rollout=RUNNING,
    )
    undrains = [a for a in plan(o, desired(1, replicas), now=300.0) if isinstance(a, Undrain)]
    assert undrains == [back_to(rid) for rid in ("q", "r", "p")[:count]]


# -- paused --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason", "pausing"),
    [
        (RolloutStatus.PROGRESSING, "", [PauseRollout(7, "paused by request")]),
        (RolloutStatus.PAUSED, "paused by request", []),
        (RolloutStatus.PAUSED, "exited with code 1 (after 3 failures)", []),
    ],
    ids=["pause-asked", "paused-by-user", "paused-after-failure"],
)
def test_a_paused_rollout_starts_and_drains_nothing_but_stops_the_drained(status, reason, pausing):
    # A rollout is paused with desired.paused set (by the user, or by PauseRollout itself).
    o = observed(
        ready("a", 1),
        ready("b", 1),
        draining("c", 1, drained=True),
        draining("d", 1),
        ready("x", 2, created=100.0),
        starting("y", 2, created=0.0),  # long past its start timeout
        rollout=rollout(1, 2, status=status, reason=reason),
    )
    assert decisions(plan(o, desired(2, 3, paused=True), now=1000.0)) == [Stop("c"), *pausing]


def test_a_progressing_rollout_is_paused_when_the_user_asks():
    o = observed(ready("a", 1), rollout=rollout(1, 2))
    actions = plan(o, desired(2, paused=True), now=10.0)
    assert decisions(actions) == [PauseRollout(7, "paused by request")]  # no Start


@pytest.mark.parametrize("reason", ["paused by request", WHY])
def test_a_paused_rollout_resumes_when_the_user_asks_and_plans_afresh(reason):
    # The failures (past retries) and the deadline (long past) are reset by ResumeRollout's
    # transition; this plan only resumes, and wakes to plan again at once.
    paused = rollout(1, 2, status=RolloutStatus.PAUSED, failures=9, reason=reason)
    o = observed(ready("a", 1), rollout=paused, backoff=FAILED_AT)
    assert plan(o, desired(2, retries=2), now=1e6) == [ResumeRollout(7), WakeAt(1e6)]


# -- static replicas (rule 9) --------------------------------------------------------------


def test_static_replicas_are_never_given_up():
    o = observed(
        starting("x", 2, created=0.0),
        unhealthy("y", 2, since=0.0),
        rollout=rollout(None, 2),
        serving=None,
    )
    actions = plan(o, desired(2, 2, static=True, start_timeout=60), now=1000.0)
    assert not [a for a in actions if isinstance(a, FailReplica)]


@pytest.mark.parametrize(
    ("replicas", "complete"),
    [
        ((starting("x", 1), starting("y", 1)), True),  # each holds an address
        ((starting("x", 1), unhealthy("y", 1, since=0.0)), True),
        ((starting("x", 1), requested("y", 1)), False),  # y not placed yet
        ((starting("x", 1),), False),
    ],
)
def test_a_first_static_rollout_completes_once_each_replica_holds_an_address(replicas, complete):
    o = observed(*replicas, rollout=rollout(None, 1), serving=None)
    actions = plan(o, desired(1, 2, static=True), now=10.0)
    assert (CompleteRollout(7) in actions) is complete


def test_a_later_static_rollout_waits_for_readiness():
    o = observed(gone("a", 1), starting("x", 2), starting("y", 2), rollout=rollout(1, 2))
    assert CompleteRollout(7) not in plan(o, desired(2, 2, static=True), now=10.0)
    o = observed(gone("a", 1), ready("x", 2), ready("y", 2), rollout=rollout(1, 2))
    assert CompleteRollout(7) in plan(o, desired(2, 2, static=True), now=10.0)


# -- deleting ------------------------------------------------------------------------------


def test_a_deleted_service_drains_every_live_replica_and_stops_the_drained():
    o = observed(
        ready("a", 1),
        starting("b", 1),
        requested("c", 2),
        unhealthy("d", 2, since=0.0),
        draining("e", 1),
        draining("f", 1, drained=True),
        gone("g", 1),
        rollout=rollout(1, 2),
    )
    deleted = "service deleted"
    assert plan(o, desired(2, 2, deleting=True), now=1.0) == [
        Stop("f"),
        Drain("a", deleted),
        Drain("b", deleted),
        Drain("c", deleted),
        Drain("d", deleted),
    ]


@pytest.mark.parametrize(
    ("replicas", "forget"),
    [
        ((), True),
        ((gone("a", 1), gone("b", 1, S.FAILED, "exited with code 1")), True),
        ((gone("a", 1), Replica("b", 1, S.STOPPING, 0.0, 0.0)), False),
        ((gone("a", 1), draining("b", 1)), False),
    ],
    ids=["none", "all-terminal", "one-stopping", "one-draining"],
)
def test_a_deleted_service_is_forgotten_only_when_every_replica_is_terminal(replicas, forget):
    actions = plan(observed(*replicas), desired(1, 1, deleting=True), now=1.0)
    assert (Forget() in actions) is forget


# -- completing a rollout ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "complete"),
    [
        ((ready("x", 2), ready("y", 2)), True),
        ((draining("a", 1), ready("x", 2), ready("y", 2)), True),  # old, but not live
        ((gone("a", 1), ready("x", 2), ready("y", 2)), True),
        ((starting("a", 1), ready("x", 2), ready("y", 2)), False),  # old and live
        ((unhealthy("a", 1, since=0.0), ready("x", 2), ready("y", 2)), False),
        ((ready("x", 2), ready("y", 2, at=98.0)), False),  # y within min_ready
        ((ready("x", 2), starting("y", 2)), False),
        ((ready("x", 2),), False),
        ((ready("x", 2), ready("y", 2), ready("z", 2)), False),  # more than D: scale first
    ],
)
def test_a_rollout_completes_only_with_no_old_live_and_d_target_available(replicas, complete):
    o = observed(*replicas, rollout=rollout(1, 2))
    actions = plan(o, desired(2, 2, min_ready=5), now=100.0)
    assert (CompleteRollout(7) in actions) is complete


def test_a_paused_or_ended_rollout_is_not_completed():
    done = (ready("x", 2), ready("y", 2))
    paused = observed(*done, rollout=rollout(1, 2, status=RolloutStatus.PAUSED))
    assert not decisions(plan(paused, desired(2, 2, paused=True), now=100.0))
    ended = observed(*done, rollout=None, serving=2)
    assert not decisions(plan(ended, desired(2, 2), now=100.0))


def test_durations_are_written_the_way_users_write_them():
    assert [fmt_seconds(x) for x in (120.0, 1800.0, 90.0, 0.5, 3600.0)] == [
        "2m",
        "30m",
        "90s",
        "0.5s",
        "60m",
    ]


def test_after_a_failure_no_second_start_while_one_is_with_the_backend():
    strategy = RolloutStrategy(retry_backoff=1)
    failed = Backoff(failures=1, last_failure_at=0.0, reason="no capacity")
    pending = Replica("r-new", 1, ReplicaState.REQUESTED, created=5.0, since=5.0)
    observed = Observed(replicas=(pending,), serving_revision=1, backoff=failed, target=1)
    actions = plan(observed, Desired(1, 3, strategy), now=10.0)
    assert not [a for a in actions if isinstance(a, Start)]
    actions = plan(observed.replace(replicas=()), Desired(1, 3, strategy), now=10.0)
    assert [a for a in actions if isinstance(a, Start)] == [Start(1)]


# -- rule 11: the autoscaler --------------------------------------------------------------

SCALING = Autoscaling(
    min=0,
    max=3,
    metric="concurrency",
    target=2.0,
    window=10.0,
    scale_up_delay=0.0,
    scale_down_delay=5.0,
)


def autoscaled(replicas: int) -> Desired:
    return Desired(1, replicas, RolloutStrategy(), scaling=SCALING)


def test_a_held_request_at_zero_rescales_first_then_starts():
    o = Observed(serving_revision=1, target=1, samples=(Sample(100.0, 0, held=1),))
    actions = plan(o, autoscaled(0), 100.0)
    assert actions[:2] == [
        Rescale(1, "cold start: 1 request held, no replica: 0 -> 1"),
        Start(1),
    ]
    # On its way up it is not degraded: no SetDegraded at all.
    assert not [a for a in actions if isinstance(a, SetDegraded)]


def test_idle_drains_the_last_replicas_to_zero():
    """Rule 6: only a delete or the autoscaler of a min: 0 service gone idle drains the last."""
    samples = tuple(Sample(float(t), 0) for t in range(90, 101))
    o = Observed((ready("a", 1),), serving_revision=1, target=1, samples=samples)
    actions = plan(o, autoscaled(1), 100.0)
    assert actions == [Rescale(0, "idle for 5 s: 1 -> 0"), Drain("a", "scaled down")]


def test_load_within_the_delay_keeps_the_count():
    samples = tuple(Sample(float(t), 0) for t in range(90, 101))
    o = Observed((ready("a", 1),), serving_revision=1, target=1, samples=samples)
    o = o.replace(scaler=Memory(last_above=97.0))
    assert plan(o, autoscaled(1), 100.0) == []


def test_a_failed_cold_start_is_degraded_with_the_reason():
    o = Observed(
        (gone("a", 1, S.FAILED, NO_CAPACITY),),
        serving_revision=1,
        target=1,
        backoff=Backoff(1, 99.0, NO_CAPACITY),
        samples=(Sample(100.0, 0, held=2),),
    )
    actions = plan(o, autoscaled(1), 100.0)
    assert SetDegraded(f"0 of 1 replicas ready: {NO_CAPACITY}") in actions
    assert not [a for a in actions if isinstance(a, (Drain, Rescale))]
