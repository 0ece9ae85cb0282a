"""``controller/planning/transitions.py``: decisions, observations and intents, one table each.

Pure: every test builds a ``(desired, observed)`` pair, applies one input at a literal
instant and checks the new pair and the journal entries.
"""

from __future__ import annotations

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
from controller.planning.autoscaler import Sample
from controller.planning.model import (
    Backoff,
    Desired,
    Observed,
    Replica,
    ReplicaState,
    Rollout,
    RolloutKind,
    RolloutStatus,
)
from controller.planning.transitions import (
    KEEP_TERMINAL,
    Configure,
    Delete,
    DrainDone,
    Event,
    Exited,
    HealthChanged,
    Observation,
    Placed,
    ProbeFailed,
    Retarget,
    Sampled,
    SetPaused,
    StartFailed,
    Step,
    decide,
    intend,
    observe,
)
from controller.scaling import Autoscaling
from controller.spec import RolloutStrategy

S = ReplicaState
NOW = 50.0
STRATEGY = RolloutStrategy()
NO_BACKOFF = Backoff()
FAILED_BEFORE = Backoff(1, 10.0, "exited with code 1")

# -- building blocks -----------------------------------------------------------------------


def replica(rid: str, rev: int, state: S, **fields: object) -> Replica:
    base = Replica(rid, rev, state, 0.0, 0.0, address=f"h:{rid}")
    return base.replace(**fields)


def rollout(
    status: RolloutStatus = RolloutStatus.PROGRESSING,
    *,
    to: int = 2,
    failures: int = 0,
    kind: RolloutKind = "rollout",
) -> Rollout:
    return Rollout(7, 1, to, kind, status, 0.0, failures)


def pair(
    *replicas: Replica,
    active: Rollout | None = None,
    revision: int = 2,
    backoff: Backoff = NO_BACKOFF,
    paused: bool = False,
) -> tuple[Desired, Observed]:
    desired = Desired(revision, 2, STRATEGY, paused=paused)
    observed = Observed(replicas, 1, active, backoff, None, revision)
    return desired, observed


def only(step: Step, rid: str) -> Replica:
    found = [r for r in step.observed.replicas if r.id == rid]
    assert len(found) == 1
    return found[0]


def kinds(step: Step) -> list[str]:
    return [e.kind for e in step.events]


# -- decide: replicas ----------------------------------------------------------------------


def test_a_start_requests_a_replica_under_the_new_id():
    d, o = pair()
    step = decide(d, o, Start(2), NOW, new_id="svc-2-a")
    assert step.observed.replicas == (Replica("svc-2-a", 2, S.REQUESTED, NOW, NOW),)
    assert step.desired == d
    assert step.events == ()


@pytest.mark.parametrize("state", [S.REQUESTED, S.STARTING, S.READY, S.UNHEALTHY])
def test_a_drain_of_a_live_replica_makes_it_draining(state):
    d, o = pair(replica("a", 1, state))
    step = decide(d, o, Drain("a", "replaced by revision 2"), NOW)
    assert only(step, "a").state is S.DRAINING
    assert only(step, "a").since == NOW
    assert step.events == (
        Event("replica_draining", "replica a draining: replaced by revision 2", 1, "a"),
    )


@pytest.mark.parametrize("state", [S.DRAINING, S.STOPPING, S.STOPPED, S.FAILED])
def test_a_drain_of_a_replica_not_live_changes_nothing(state):
    d, o = pair(replica("a", 1, state))
    assert decide(d, o, Drain("a", "x"), NOW) == Step(d, o)
    assert decide(d, o, FailReplica("a", "x"), NOW) == Step(d, o)


def test_a_given_up_target_replica_drains_as_failed_and_counts_against_the_rollout():
    d, o = pair(replica("x", 2, S.STARTING), active=rollout())
    step = decide(d, o, FailReplica("x", "not ready within 10m"), NOW)
    x = only(step, "x")
    assert (x.state, x.failure) == (S.DRAINING, "not ready within 10m")
    assert step.observed.backoff == Backoff(1, NOW, "not ready within 10m")
    assert step.observed.rollout == rollout(failures=1)
    assert kinds(step) == ["replica_failed", "replica_draining"]


@pytest.mark.parametrize("state", [S.STARTING, S.UNHEALTHY])
def test_a_kept_replica_counts_as_failed_and_stays_live(state):
    # on_failure: pause (rule 3): the replica whose failure pauses the rollout is kept.
    d, o = pair(replica("x", 2, state), active=rollout())
    step = decide(d, o, KeepFailed("x", "not ready within 10m"), NOW)
    x = only(step, "x")
    assert (x.state, x.since, x.failure) == (state, 0.0, "not ready within 10m")
    assert step.observed.backoff == Backoff(1, NOW, "not ready within 10m")
    assert step.observed.rollout == rollout(failures=1)
    message = "replica x failed: not ready within 10m; kept for inspection"
    assert step.events == (Event("replica_failed", message, 2, "x"),)
    # Kept once: a second decision changes nothing.
    assert decide(step.desired, step.observed, KeepFailed("x", "again"), NOW) == Step(
        step.desired, step.observed
    )


def test_a_give_up_that_does_not_count_spends_no_retry():
    # A resumed rollout replaces its kept replica (counted as it was kept) with its retries
    # afresh (the planner decides: rule 3).
    kept = replica("x", 2, S.STARTING, failure="not ready within 10m")
    d, o = pair(kept, active=rollout())
    step = decide(d, o, FailReplica("x", "not ready within 10m", counts=False), NOW)
    assert only(step, "x").state is S.DRAINING
    assert step.observed.backoff == o.backoff
    assert step.observed.rollout == o.rollout
    assert kinds(step) == ["replica_failed", "replica_draining"]


def test_a_kept_replica_that_comes_up_has_failed_no_more():
    kept = replica("x", 2, S.STARTING, failure="not ready within 10m")
    d, o = pair(kept, active=rollout(RolloutStatus.PAUSED), paused=True)
    step = observe(d, o, HealthChanged("x", True, ""), NOW)
    assert (only(step, "x").state, only(step, "x").failure) == (S.READY, "")


@pytest.mark.parametrize(
    ("healthy", "back"), [(True, S.READY), (False, S.UNHEALTHY)], ids=["healthy", "unhealthy"]
)
def test_an_undrained_replica_serves_again_as_its_last_verdict_says(healthy, back):
    d, o = pair(replica("a", 1, S.DRAINING, healthy=healthy), revision=1)
    step = decide(d, o, Undrain("a", "serves again: back to revision 1"), NOW)
    assert only(step, "a").state is back
    assert only(step, "a").since == NOW
    assert step.events == (
        Event("replica_undrained", "replica a serves again: back to revision 1", 1, "a"),
    )


@pytest.mark.parametrize("state", [S.READY, S.STOPPING, S.STOPPED])
def test_an_undrain_of_a_replica_not_draining_changes_nothing(state):
    d, o = pair(replica("a", 1, state, healthy=True), revision=1)
    assert decide(d, o, Undrain("a", "x"), NOW) == Step(d, o)


@pytest.mark.parametrize(
    ("fields", "final"),
    [
        ({}, S.STOPPING),  # placed: the backend stops it, its exit ends it
        ({"address": None}, S.STOPPED),  # never placed: nothing runs
        ({"address": None, "failure": "not ready within 10m"}, S.FAILED),
    ],
    ids=["placed", "never-placed", "never-placed-failed"],
)
def test_a_stop_of_a_drained_replica(fields, final):
    d, o = pair(replica("a", 1, S.DRAINING, drained=True, **fields))
    assert only(decide(d, o, Stop("a"), NOW), "a").state is final


def test_a_stop_of_a_replica_not_draining_changes_nothing():
    d, o = pair(replica("a", 1, S.READY))
    assert decide(d, o, Stop("a"), NOW) == Step(d, o)


def test_only_the_newest_terminal_replicas_are_kept():
    old = [replica(f"s{i}", 1, S.STOPPED, since=float(i)) for i in range(KEEP_TERMINAL)]
    d, o = pair(*old, replica("a", 1, S.DRAINING, drained=True, address=None))
    kept = {r.id for r in decide(d, o, Stop("a"), NOW).observed.replicas}
    assert kept == {f"s{i}" for i in range(1, KEEP_TERMINAL)} | {"a"}


# -- decide: rollouts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("since", "message"),
    [(1, "rollback 9: revision 1 -> 2"), (None, "rollback 9: new service, revision 2")],
)
def test_a_rollout_begins_with_its_backoff_afresh_unpaused_toward_its_target(since, message):
    d, o = pair(backoff=FAILED_BEFORE, paused=True, revision=1)
    o = o.replace(target=1)
    step = decide(d, o, BeginRollout(since, 2, "rollback"), NOW, rollout_id=9)
    assert step.observed.rollout == Rollout(9, since, 2, "rollback", RolloutStatus.PROGRESSING, NOW)
    assert step.observed.target == 2
    assert step.observed.backoff == Backoff()
    assert (step.desired.revision, step.desired.paused) == (2, False)
    assert step.events == (Event("rollout_started", message, 2),)


def test_a_completed_rollout_ends_and_its_target_serves():
    d, o = pair(active=rollout())
    step = decide(d, o, CompleteRollout(7), NOW)
    assert (step.observed.rollout, step.observed.serving_revision) == (None, 2)
    assert step.events == (Event("rollout_complete", "rollout 7 complete: revision 2 serving", 2),)


def test_a_failed_rollout_ends_and_what_serves_stays():
    d, o = pair(active=rollout())
    step = decide(d, o, FailRollout(7, "exited with code 1 (after 3 failures)"), NOW)
    assert (step.observed.rollout, step.observed.serving_revision) == (None, 1)
    message = "rollout 7 to revision 2 failed: exited with code 1 (after 3 failures)"
    assert step.events == (Event("rollout_failed", message, 2),)


@pytest.mark.parametrize(
    ("outcome", "kind"), [("aborted", "rollout_aborted"), ("superseded", "rollout_superseded")]
)
def test_an_abandoned_rollout_ends_as_the_user_moved_the_target(outcome, kind):
    d, o = pair(active=rollout(RolloutStatus.PAUSED))
    step = decide(d, o, AbandonRollout(7, outcome, "aborted by request"), NOW)
    assert step.observed.rollout is None
    assert step.events == (Event(kind, "rollout 7 aborted by request", 2),)


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("paused by request", "rollout 7 paused"),
        ("not complete within 30m", "rollout 7 paused on failure: not complete within 30m"),
    ],
)
def test_a_paused_rollout_is_held_and_desired_paused_follows(reason, message):
    d, o = pair(active=rollout(failures=4))
    step = decide(d, o, PauseRollout(7, reason), NOW)
    assert step.observed.rollout == rollout(RolloutStatus.PAUSED, failures=4).replace(reason=reason)
    assert step.desired.paused
    assert step.events == (Event("rollout_paused", message, 2),)


def test_a_resumed_rollout_has_its_retries_deadline_and_backoff_afresh():
    paused = rollout(RolloutStatus.PAUSED, failures=4).replace(reason="exited (after 4 failures)")
    d, o = pair(active=paused, backoff=FAILED_BEFORE)
    step = decide(d, o, ResumeRollout(7), NOW)
    assert step.observed.rollout == Rollout(
        7, 1, 2, "rollout", RolloutStatus.PROGRESSING, NOW, 0, ""
    )
    assert step.observed.backoff == Backoff()
    assert step.events == (Event("rollout_resumed", "rollout 7 resumed", 2),)


@pytest.mark.parametrize(
    "action",
    [
        CompleteRollout(8),
        FailRollout(8, "x"),
        AbandonRollout(8, "superseded", "x"),
        PauseRollout(8, "x"),
        ResumeRollout(8),
    ],
    ids=["complete", "fail", "abandon", "pause", "resume"],
)
@pytest.mark.parametrize("active", [None, rollout()], ids=["no-rollout", "another"])
def test_a_decision_about_a_rollout_that_is_not_the_active_one_changes_nothing(action, active):
    d, o = pair(active=active)
    assert decide(d, o, action, NOW) == Step(d, o)


def test_a_decision_about_an_ended_rollout_changes_nothing():
    d, o = pair(active=rollout(RolloutStatus.COMPLETE))
    for action in (CompleteRollout(7), FailRollout(7, "x"), PauseRollout(7, "x")):
        assert decide(d, o, action, NOW) == Step(d, o)


@pytest.mark.parametrize(
    ("action", "events"),
    [
        (
            SetDegraded("1 of 2 replicas ready"),
            [("service_degraded", "degraded: 1 of 2 replicas ready")],
        ),
        (SetDegraded(None), [("service_recovered", "all replicas ready")]),
        (Forget(), [("service_deleted", "service deleted")]),
        (WakeAt(99.0), []),
    ],
    ids=["degraded", "recovered", "forget", "wake"],
)
def test_the_service_wide_decisions(action: Action, events):
    d, o = pair()
    step = decide(d, o, action, NOW)
    assert [(e.kind, e.message) for e in step.events] == events
    if isinstance(action, SetDegraded):
        assert step.observed.degraded == action.reason
    else:
        assert step.observed == o


# -- observe -------------------------------------------------------------------------------


def test_a_placed_replica_starts_at_its_address():
    d, o = pair(replica("x", 2, S.REQUESTED, address=None))
    step = observe(d, o, Placed("x", "127.0.0.1:9000"), NOW)
    x = only(step, "x")
    assert (x.state, x.address, x.since) == (S.STARTING, "127.0.0.1:9000", NOW)
    message = "replica x of revision 2 started at 127.0.0.1:9000"
    assert step.events == (Event("replica_started", message, 2, "x"),)


def test_a_replica_drained_while_requested_is_marked_drained_once_placed():
    d, o = pair(replica("x", 2, S.DRAINING, address=None, since=5.0))
    step = observe(d, o, Placed("x", "127.0.0.1:9000"), NOW)
    x = only(step, "x")
    assert (x.state, x.address, x.drained, x.since) == (S.DRAINING, "127.0.0.1:9000", True, 5.0)
    assert step.events == ()


@pytest.mark.parametrize(
    "seen",
    [
        StartFailed("x", "no capacity: 3 of 3 slots in use"),
        Exited("x", 1, "no capacity: 3 of 3 slots in use", requested=False),
    ],
    ids=["start-failed", "exited"],
)
def test_a_target_replica_that_fails_backs_off_and_counts_against_its_progressing_rollout(seen):
    state = S.REQUESTED if isinstance(seen, StartFailed) else S.STARTING
    d, o = pair(replica("x", 2, state), active=rollout(failures=1), backoff=FAILED_BEFORE)
    step = observe(d, o, seen, NOW)
    assert only(step, "x").state is S.FAILED
    assert step.observed.backoff.failures == 2
    assert step.observed.backoff.last_failure_at == NOW
    assert step.observed.rollout == rollout(failures=2)
    assert kinds(step) == ["replica_failed"]


def test_a_start_its_host_did_not_answer_backs_off_but_does_not_count_against_the_rollout():
    """An engine stopped during a rollout: the starts placed on it fail, and the revision's
    starts back off, but the rollout goes on (it is not the revision's fault)."""
    d, o = pair(replica("x", 2, S.REQUESTED), active=rollout(failures=1), backoff=FAILED_BEFORE)
    seen = StartFailed("x", "host b unreachable: engine unix:///b.sock: refused", counts=False)
    step = observe(d, o, seen, NOW)
    assert only(step, "x").state is S.FAILED
    assert step.observed.backoff.failures == 2
    assert step.observed.rollout == rollout(failures=1)
    assert kinds(step) == ["replica_failed"]


@pytest.mark.parametrize(
    ("rev", "active", "backs_off", "counts"),
    [
        (2, rollout(), True, True),
        (2, rollout(RolloutStatus.PAUSED), True, False),  # only while progressing
        (2, None, True, False),  # no rollout: a scale-up's failure
        (1, rollout(), False, False),  # an old replica: not the target's
        (1, rollout(to=1, kind="rollback"), False, False),  # desired moved on to 2
    ],
    ids=["target-progressing", "target-paused", "no-rollout", "old", "other-rollout-target"],
)
def test_failures_count_only_for_the_target_and_only_while_progressing(
    rev, active, backs_off, counts
):
    d, o = pair(replica("x", rev, S.READY), active=active)
    step = observe(d, o, Exited("x", 137, "exited with code 137", requested=False), NOW)
    assert only(step, "x").failure == "replica exited with code 137"
    assert (step.observed.backoff.failures == 1) is backs_off
    failures = step.observed.rollout.failures if step.observed.rollout else 0
    assert failures == (1 if counts else 0)


def test_a_replica_given_up_is_not_counted_again_when_its_start_fails():
    d, o = pair(
        replica("x", 2, S.DRAINING, address=None, failure="not ready within 10m"),
        active=rollout(failures=1),
        backoff=FAILED_BEFORE,
    )
    step = observe(d, o, StartFailed("x", "no capacity"), NOW)
    x = only(step, "x")
    assert (x.state, x.failure) == (S.FAILED, "not ready within 10m")
    assert (step.observed.backoff, step.observed.rollout) == (FAILED_BEFORE, rollout(failures=1))


@pytest.mark.parametrize(
    ("rev", "backoff"), [(2, Backoff()), (1, FAILED_BEFORE)], ids=["target", "old"]
)
@pytest.mark.parametrize("state", [S.STARTING, S.UNHEALTHY])
def test_a_healthy_verdict_makes_a_replica_ready_and_clears_the_targets_backoff(
    state, rev, backoff
):
    d, o = pair(replica("x", rev, state), backoff=FAILED_BEFORE)
    step = observe(d, o, HealthChanged("x", True, ""), NOW)
    x = only(step, "x")
    assert (x.state, x.since, x.ready_since, x.healthy) == (S.READY, NOW, NOW, True)
    assert step.observed.backoff == backoff
    assert step.events == (Event("replica_ready", "replica x ready at h:x", rev, "x"),)


def test_an_unhealthy_verdict_makes_a_ready_replica_unhealthy_and_keeps_why():
    d, o = pair(replica("x", 2, S.READY, healthy=True, ready_since=1.0))
    step = observe(d, o, HealthChanged("x", False, "connection refused"), NOW)
    x = only(step, "x")
    assert (x.state, x.since, x.healthy) == (S.UNHEALTHY, NOW, False)
    assert x.probe_failure == "connection refused"
    message = "replica x unhealthy: connection refused"
    assert step.events == (Event("replica_unhealthy", message, 2, "x"),)


def test_an_unhealthy_verdict_leaves_a_starting_replica_starting():
    d, o = pair(replica("x", 2, S.STARTING))
    step = observe(d, o, HealthChanged("x", False, "connection refused"), NOW)
    x = only(step, "x")
    assert (x.state, x.since, x.healthy) == (S.STARTING, 0.0, False)
    assert x.probe_failure == "connection refused"
    assert step.events == ()


def test_an_unhealthy_verdict_makes_a_static_replica_that_never_passed_unhealthy():
    # Rule 9: a static address is not starting up, it is down; it stays live, never given up.
    d, o = pair(replica("x", 2, S.STARTING))
    d = d.replace(static=True)
    step = observe(d, o, HealthChanged("x", False, "connection refused"), NOW)
    x = only(step, "x")
    assert (x.state, x.since, x.healthy) == (S.UNHEALTHY, NOW, False)
    assert x.probe_failure == "connection refused"
    assert x.live
    message = "replica x unhealthy: connection refused"
    assert step.events == (Event("replica_unhealthy", message, 2, "x"),)
    assert step.observed.backoff == o.backoff
    assert step.observed.rollout == o.rollout
    # Once the address answers, it is ready like any other.
    back = observe(d, step.observed, HealthChanged("x", True, ""), NOW + 1)
    assert (only(back, "x").state, only(back, "x").ready_since) == (S.READY, NOW + 1)


@pytest.mark.parametrize("state", [S.STARTING, S.UNHEALTHY])
def test_a_failed_probe_of_a_replica_not_passing_keeps_its_latest_reason(state):
    d, o = pair(replica("x", 2, state, probe_failure="connection refused"))
    step = observe(d, o, ProbeFailed("x", "HTTP 404"), NOW)
    x = only(step, "x")
    assert (x.state, x.since, x.healthy, x.probe_failure) == (state, 0.0, False, "HTTP 404")
    assert step.events == ()


def test_a_failed_probe_of_a_passing_replica_is_no_verdict():
    d, o = pair(replica("x", 2, S.READY, healthy=True, ready_since=1.0))
    step = observe(d, o, ProbeFailed("x", "timed out"), NOW)
    assert step.observed == o
    assert step.events == ()


@pytest.mark.parametrize("healthy", [True, False])
def test_a_draining_replica_keeps_its_verdict_for_an_undrain(healthy):
    d, o = pair(replica("a", 1, S.DRAINING, healthy=not healthy))
    step = observe(d, o, HealthChanged("a", healthy, "" if healthy else "refused"), NOW)
    a = only(step, "a")
    assert (a.state, a.healthy, a.since) == (S.DRAINING, healthy, 0.0)
    assert step.events == ()


@pytest.mark.parametrize(
    ("clean", "events"),
    [(True, []), (False, ["replica_drain_timeout"])],
    ids=["clean", "timeout"],
)
def test_a_finished_drain_marks_the_replica_drained(clean, events):
    d, o = pair(replica("a", 1, S.DRAINING))
    step = observe(d, o, DrainDone("a", clean), NOW)
    assert only(step, "a").drained
    assert kinds(step) == events


def test_a_drain_done_for_a_replica_no_longer_draining_changes_nothing():
    d, o = pair(replica("a", 1, S.READY))
    assert observe(d, o, DrainDone("a", True), NOW) == Step(d, o)


@pytest.mark.parametrize(
    ("state", "failure", "final"),
    [
        (S.STOPPING, "", S.STOPPED),
        (S.STOPPING, "not ready within 10m", S.FAILED),
        (S.DRAINING, "", S.STOPPED),  # an exit we asked for (a stop of the backend's own)
    ],
)
def test_an_exit_we_asked_for_stops_the_replica(state, failure, final):
    d, o = pair(replica("a", 1, state, failure=failure), active=rollout())
    step = observe(d, o, Exited("a", 0, "stopped", requested=True), NOW)
    a = only(step, "a")
    assert (a.state, a.exit_code, a.since) == (final, 0, NOW)
    assert (step.observed.backoff, step.observed.rollout) == (Backoff(), rollout())
    assert kinds(step) == ["replica_stopped"]


@pytest.mark.parametrize(
    "seen",
    [
        Placed("a", "h:1"),
        StartFailed("a", "x"),
        HealthChanged("a", True, ""),
        DrainDone("a", True),
        Exited("a", 1, "x", requested=False),
    ],
    ids=["placed", "start-failed", "health", "drain-done", "exited"],
)
@pytest.mark.parametrize("known", [False, True], ids=["unknown", "terminal"])
def test_what_is_seen_of_an_unknown_or_terminal_replica_changes_nothing(seen: Observation, known):
    d, o = pair(*([replica("a", 2, S.STOPPED)] if known else []), active=rollout())
    assert observe(d, o, seen, NOW) == Step(d, o)


# -- intend --------------------------------------------------------------------------------


def test_intents_move_only_what_is_desired_in_order():
    d, o = pair(active=rollout())
    faster = RolloutStrategy(max_surge=2)
    step = intend(
        d,
        o,
        [Retarget(1, "abort"), Configure(3, faster, static=True), SetPaused(True)],
    )
    assert step.desired == Desired(1, 3, faster, paused=True, intent="abort", static=True)
    assert step.observed == o
    assert step.events == ()


def test_a_later_intent_wins():
    d, o = pair()
    step = intend(
        d, o, [Retarget(3, "apply"), Retarget(1, "undo"), SetPaused(True), SetPaused(False)]
    )
    assert (step.desired.revision, step.desired.intent, step.desired.paused) == (1, "undo", False)


def test_a_delete_is_recorded_and_journaled():
    d, o = pair()
    step = intend(d, o, [Delete()])
    assert step.desired.deleting
    assert step.events == (Event("service_deleting", "deleting: draining every replica"),)


# -- the autoscaler ---------------------------------------------------------------------------

AUTOSCALING = Autoscaling(
    min=0,
    max=4,
    metric="concurrency",
    target=2.0,
    window=10.0,
    scale_up_delay=0.0,
    scale_down_delay=5.0,
)


def test_rescale_moves_the_count_remembers_and_journals():
    d = Desired(1, 0, STRATEGY, scaling=AUTOSCALING)
    why = "cold start: 1 request held, no replica: 0 -> 1"
    step = decide(d, Observed(target=1), Rescale(1, why), NOW)
    assert step.desired.replicas == 1
    memory = step.observed.scaler
    assert (memory.last_change, memory.decision, memory.decided_at) == (NOW, why, NOW)
    assert memory.cold_start == NOW  # from zero: a cold start begins
    assert step.events == (Event("autoscaled", why, 1),)
    down = decide(step.desired, step.observed, Rescale(0, "idle for 5 s: 1 -> 0"), NOW + 9)
    assert down.desired.replicas == 0
    assert down.observed.scaler.cold_start is None


def test_a_cold_start_ends_when_a_replica_is_ready_with_its_duration():
    d = Desired(1, 1, STRATEGY, scaling=AUTOSCALING)
    o = Observed((replica("a", 1, S.STARTING, address="127.0.0.1:1"),), target=1)
    o = decide(d.replace(replicas=0), o, Rescale(1, "cold start"), NOW).observed
    step = observe(d, o, HealthChanged("a", True, ""), NOW + 2.5)
    kinds = [e.kind for e in step.events]
    assert kinds == ["replica_ready", "cold_start"]
    assert step.events[1].message == "cold start: replica a ready 2.50 s after the scale from zero"
    memory = step.observed.scaler
    assert (memory.cold_start, memory.cold_starts, memory.last_cold_start) == (None, 1, 2.5)
    # The next replica ready is no cold start.
    again = observe(d, step.observed, HealthChanged("a", True, ""), NOW + 3)
    assert [e.kind for e in again.events] == []


def test_samples_are_kept_as_far_back_as_the_autoscaler_reads_and_remembered():
    d = Desired(1, 1, STRATEGY, scaling=AUTOSCALING)
    o = Observed(target=1)
    for t in range(30):
        o = observe(d, o, Sampled(Sample(float(t), 3 if t == 20 else 0)), float(t)).observed
    horizon = max(AUTOSCALING.window, AUTOSCALING.scale_down_delay) + 2.0
    assert [s.at for s in o.samples] == [float(t) for t in range(30) if t > 29 - horizon]
    assert o.scaler.last_above == 20.0  # 3 in flight on 1 replica > target 2
    fixed = Desired(1, 1, STRATEGY)
    kept = observe(fixed, o, Sampled(Sample(31.0, 0)), 31.0).observed
    assert kept.samples == (Sample(31.0, 0),)  # a fixed count keeps the latest only


def test_configure_with_scaling_keeps_the_count_within_the_range():
    d = Desired(1, 6, STRATEGY)
    step = intend(d, Observed(), [Configure(1, STRATEGY, scaling=AUTOSCALING)])
    assert (step.desired.replicas, step.desired.scaling) == (4, AUTOSCALING)
    back = intend(step.desired, Observed(), [Configure(2, STRATEGY)])
    assert (back.desired.replicas, back.desired.scaling) == (2, None)
