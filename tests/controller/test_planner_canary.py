"""Canary and blue/green rollouts through the real planner and transitions (``simulation``):
steps, pauses, the analysis of the gateway's counts, promotion, abort and undo."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.planning.actions import SetSplit, SetWeight
from controller.planning.analysis import NO_TRAFFIC
from controller.planning.model import (
    ReplicaState,
    Rollout,
    RolloutStatus,
    restore_strategy,
    strategy_state,
)
from controller.spec import RolloutStrategy

from .simulation import World


def canary(**fields: Any) -> RolloutStrategy:
    return RolloutStrategy.model_validate(
        {
            "strategy": "canary",
            "steps": [{"weight": 25, "pause": 10}, {"weight": 50, "pause": 10}],
            "analysis": {"max_error_rate": 0.01, "min_requests": 20, "interval": 2},
            **fields,
        }
    )


def live(w: World, revision: int) -> int:
    return sum(1 for r in w.observed.replicas if r.live and r.revision == revision)


def tick(w: World, rps: int = 100) -> None:
    """One second of the loop: the backend and the prober settle, the planner plans, then
    ``rps`` requests go through the pool's split and are sampled."""
    for _ in range(10):
        if not w.settle():
            break
        w.step()
    w.step()
    w.requests(rps)
    w.now += 1.0
    w.step()


def run_until(w: World, done: Any, limit: int = 400, rps: int = 100) -> None:
    for _ in range(limit):
        if done(w):
            return
        tick(w, rps)
    raise AssertionError(f"not reached in {limit} s\n{w.describe()}")


def split_of(w: World) -> tuple[int, int] | None:
    return w.observed.split


def test_a_canary_steps_through_its_weights_then_completes() -> None:
    w = World.create(canary(), 4, 20, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 25))
    # Rule 12a: ceil(4 * 25%) = 1 replica of the canary; all four old ones stay.
    assert live(w, 2) == 1
    assert live(w, 1) == 4
    rollout = w.observed.rollout
    assert rollout is not None
    assert rollout.step == 0
    assert rollout.weight == 25
    started = w.now
    run_until(w, lambda w: split_of(w) == (2, 50))
    assert w.now - started >= 10  # the pause held
    assert live(w, 2) == 2
    assert live(w, 1) == 4
    judged = [e for e in w.log if "rollout_analysis" in e and "at weight 25" in e]
    assert judged
    assert "pass: analysis: error rate 0% <= 1% over" in judged[-1]
    run_until(w, World.converged)
    assert [a.weight for a in _actions(w, SetWeight)] == [25, 50, 100]
    assert [a.split for a in _actions(w, SetSplit)] == [(2, 0), (2, 25), (2, 50), (2, 100), None]
    assert split_of(w) is None
    assert w.ended[-1].status is RolloutStatus.COMPLETE
    steps = [e for e in w.log if "rollout_step" in e]
    assert len(steps) == 3
    assert "revision 2 takes 25% of the traffic (step 1 of 3)" in steps[0]


def test_the_weight_holds_whatever_the_replica_counts() -> None:
    w = World.create(canary(), 4, 20, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 25))
    before = dict(w.served)
    for _ in range(5):
        tick(w, 1000)
    got = {rev: w.served.get(rev, 0) - before.get(rev, 0) for rev in (1, 2)}
    assert got[2] / (got[1] + got[2]) == pytest.approx(0.25)


def test_a_failing_canary_is_aborted_at_its_first_step_and_rolled_back() -> None:
    w = World.create(canary(), 4, 20, serving=True)
    w.errors[2] = 0.2  # one request in five is a 500
    w.user_apply()
    run_until(w, lambda w: bool(w.ended))
    failed = w.ended[0]
    assert failed.status is RolloutStatus.FAILED
    assert failed.reason.startswith("analysis: error rate 20% > 1% over ")
    assert failed.reason.endswith(" requests at weight 25")
    # The weight went back at once: the stable revision takes everything from now on.
    assert split_of(w) == (1, 100)
    served = w.served.get(2, 0)
    run_until(w, World.converged)
    for _ in range(5):
        tick(w)
    assert w.served.get(2, 0) == served
    assert w.desired.revision == 1
    assert w.ended[-1].kind == "rollback"
    assert w.ended[-1].status is RolloutStatus.COMPLETE
    assert split_of(w) is None
    assert any("rollout_analysis" in e and "fail" in e for e in w.log)


def test_not_enough_data_is_never_a_pass() -> None:
    strategy = canary(progress_deadline=30)
    w = World.create(strategy, 2, 10, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 25), rps=0)
    held = w.now
    run_until(w, lambda w: bool(w.ended), rps=0)
    # The pause (10 s) is long over, but no verdict passed: the step held, then failed.
    assert w.now - held >= 10 + 30 - 1  # held: the second after the weight was set
    rollout = w.ended[0]
    assert rollout.status is RolloutStatus.FAILED
    assert "not enough data yet (0 of 20 requests)" in rollout.reason
    assert split_of(w) == (1, 100)


def test_a_canary_without_analysis_moves_on_its_pauses_alone() -> None:
    strategy = RolloutStrategy(
        strategy="canary",
        steps=({"weight": 10, "pause": 5},),
    )
    w = World.create(strategy, 2, 10, serving=True)
    w.user_apply()
    run_until(w, World.converged, rps=0)
    assert w.ended[-1].status is RolloutStatus.COMPLETE


def test_promote_skips_the_remaining_steps() -> None:
    w = World.create(canary(steps=[{"weight": 10}, {"weight": 20}]), 4, 20, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 10))
    for _ in range(30):  # a step with no pause holds until promoted
        tick(w)
    assert split_of(w) == (2, 10)
    w.user_promote()
    run_until(w, World.converged)
    weights = [a.weight for a in _actions(w, SetWeight)]
    assert weights == [10, 100]
    assert any("rollout_promoted" in e for e in w.log)


def test_abort_sends_the_weight_back_at_once() -> None:
    w = World.create(canary(), 2, 10, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 25))
    w.user_retarget(1, "abort")
    w.step()
    assert split_of(w) == (1, 100)
    run_until(w, World.converged)
    assert w.ended[0].status is RolloutStatus.ABORTED


def test_pause_holds_the_step_and_resume_holds_it_again() -> None:
    w = World.create(canary(), 2, 10, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 25))
    w.user_pause(True)
    for _ in range(30):
        tick(w)
    rollout = w.observed.rollout
    assert rollout is not None
    assert rollout.status is RolloutStatus.PAUSED
    assert split_of(w) == (2, 25)
    w.user_pause(False)
    run_until(w, World.converged)
    assert w.ended[-1].status is RolloutStatus.COMPLETE


def test_on_failure_pause_holds_the_canary_at_weight_0() -> None:
    w = World.create(canary(on_failure="pause"), 2, 10, serving=True)
    w.errors[2] = 0.5
    w.user_apply()
    run_until(w, lambda w: w.desired.paused)
    assert split_of(w) == (2, 0)
    assert live(w, 1) == 2


def blue_green(**fields: Any) -> RolloutStrategy:
    return RolloutStrategy.model_validate({"strategy": "blue_green", "keep_previous": 60, **fields})


def test_blue_green_starts_in_full_with_no_traffic_then_switches_on_promote() -> None:
    w = World.create(blue_green(), 3, 10, serving=True)
    w.user_apply()
    run_until(w, lambda w: w.ready_of(2) == 3)
    for _ in range(20):  # no traffic but preview, until promoted
        tick(w)
    assert split_of(w) == (2, 0)
    assert w.served.get(2, 0) == 0
    assert live(w, 1) == 3
    w.user_promote()
    tick(w)
    assert split_of(w) == (2, 100)
    switched = w.now - 1  # the second the weight was set
    run_until(w, lambda w: live(w, 1) < 3)
    assert w.now - switched >= 60  # the old revision kept for keep_previous
    run_until(w, World.converged)
    assert w.ended[-1].status is RolloutStatus.COMPLETE


def test_blue_green_undo_within_keep_previous_is_instant() -> None:
    w = World.create(blue_green(), 3, 10, serving=True)
    w.user_apply()
    run_until(w, lambda w: w.ready_of(2) == 3)
    w.user_promote()
    tick(w)
    assert split_of(w) == (2, 100)
    tick(w)
    starts_before = w.next_replica
    w.user_retarget(1, "undo")
    w.step()
    assert split_of(w) == (1, 100)  # all traffic back at once
    run_until(w, World.converged)
    assert w.next_replica == starts_before  # nothing had to start
    assert w.desired.revision == 1


def test_blue_green_promoted_by_analysis_of_preview_traffic() -> None:
    strategy = blue_green(analysis={"min_requests": 50, "interval": 1})
    w = World.create(strategy, 2, 10, serving=True)
    w.user_apply()
    run_until(w, lambda w: w.ready_of(2) == 2)
    for _ in range(5):
        tick(w)
    assert split_of(w) == (2, 0)  # no preview traffic: not enough data, no switch
    _preview(w, 2, 60)
    run_until(w, lambda w: split_of(w) == (2, 100))


def test_a_rolling_update_promoted_starts_every_replica_at_once() -> None:
    w = World.create(RolloutStrategy(), 4, 20, serving=True)
    w.user_apply()
    w.step()
    assert live(w, 2) == 1  # max_surge: 1
    w.user_promote()
    w.step()
    assert live(w, 2) == 4


def _preview(w: World, revision: int, n: int) -> None:
    from controller.planning.analysis import Counts, Traffic
    from controller.planning.transitions import Counted

    before = w.counts.get(revision, Counts(0, 0, (0, 0)))
    w.counts[revision] = Counts(before.requests + n, before.errors, (before.latency[0] + n, 0))
    w._observe(Counted(Traffic(w.now, (0.1,), tuple(sorted(w.counts.items())))))


def _actions(w: World, kind: type) -> list[Any]:
    return [a for a in w.taken if isinstance(a, kind)]


# -- properties ------------------------------------------------------------------------------

events = st.lists(
    st.sampled_from(["tick", "tick", "tick", "burst", "promote", "pause", "resume", "crash"]),
    min_size=10,
    max_size=120,
)


@settings(max_examples=60, deadline=None)
@given(
    replicas=st.integers(1, 5),
    error=st.sampled_from([0.0, 0.0, 0.005, 0.2, 1.0]),
    history=events,
    kind=st.sampled_from(["canary", "blue_green"]),
)
def test_staged_histories_keep_the_rules(
    replicas: int, error: float, history: list[str], kind: str
) -> None:
    strategy = canary() if kind == "canary" else blue_green(analysis={"min_requests": 20})
    w = World.create(strategy, replicas, 3 * replicas + 2, serving=True)
    w.errors[2] = error
    w.user_apply()
    for event in history:
        match event:
            case "tick":
                tick(w)
            case "burst":
                tick(w, 1000)
            case "promote":
                w.user_promote()
            case "pause":
                w.user_pause(True)
            case "resume":
                w.user_pause(False)
            case "crash":
                r = w.pick([ReplicaState.READY], len(w.log))
                if r is not None:
                    w.crash(r.id, 1)
        _check(w, replicas, error)
        _restores_exactly(w)
    w.user_pause(False)
    # A blue/green, or a canary step with no pause, waits for a promote, which is taken once
    # its rollout has begun (a promote asked before is refused, as the admin API refuses it).
    run_until(w, lambda w: World.converged(w) or w.user_promote(), limit=2000)
    run_until(w, World.converged, limit=2000)
    _check(w, replicas, error)
    if error >= 0.2 and not any(r.promoted for r in w.ended):
        # A revision that fails the analysis never takes all the traffic (unless promoted).
        assert all(r.status is not RolloutStatus.COMPLETE or r.to_revision == 1 for r in w.ended)


def _check(w: World, replicas: int, error: float) -> None:
    rollout = w.observed.rollout
    split = w.observed.split
    if rollout is not None and rollout.active and rollout.staged:
        # Nothing old is drained before the target holds all the traffic (rule 12a, d).
        if rollout.weight < 100:
            leaving = [r for r in w.observed.replicas if r.revision == 1 and r.leaving]
            assert not leaving, w.describe()
        assert split is not None, w.describe()
        assert split[0] == rollout.to_revision, w.describe()
        assert split[1] <= rollout.weight or split[1] == 0, w.describe()
    if split is not None and split[0] == 2 and split[1] == 100 and rollout is not None:
        assert rollout.promoted or error < 0.2 or rollout.verdict != "fail", w.describe()


def _rebuilt(rollout: Rollout, shift: float = 0.0) -> Rollout:
    """``rollout`` as the restore reads it back from its record's columns alone, on a clock
    ``shift`` ahead (``Controller.restore``)."""
    r = rollout
    return Rollout(
        r.id, r.from_revision, r.to_revision, r.kind, r.status, r.anchor + shift, r.failures,
        r.reason,
    )  # fmt: skip


def _restores_exactly(w: World) -> None:
    """At any moment, the active rollout read back from its record is the rollout itself
    (the baseline aside: the counts are the process's)."""
    rollout = w.observed.rollout
    if rollout is None or not rollout.active:
        return
    restored = restore_strategy(_rebuilt(rollout), strategy_state(rollout), w.now, rollout.baseline)
    assert restored == rollout, w.describe()


# -- restored after a restart ----------------------------------------------------------------


def test_a_canary_at_step_2_of_3_is_restored_exactly_on_another_clock() -> None:
    w = World.create(canary(), 4, 20, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 50))
    for _ in range(4):
        tick(w)
    rollout = w.observed.rollout
    assert rollout is not None
    assert (rollout.step, rollout.weight, rollout.verdict) == (1, 50, "pass")
    assert rollout.analysis.startswith("analysis: error rate 0% <= 1% over ")
    shift = 50_000.0  # the new process' clock, and 7 s of downtime
    now = w.now + shift + 7
    restored = restore_strategy(_rebuilt(rollout, shift), strategy_state(rollout), now)
    assert rollout.holding_since is not None
    assert rollout.step_since is not None
    assert restored == rollout.replace(
        started=rollout.started + shift,
        step_since=rollout.step_since + shift,
        holding_since=rollout.holding_since + shift,
        judged_at=rollout.judged_at + shift,
        baseline=NO_TRAFFIC,  # the analysis window begins again with the new counts
    )
    assert restored.begun == rollout.started + shift


def test_a_resumed_rollout_keeps_its_new_start_and_times_never_come_back_in_the_future() -> None:
    rollout = Rollout(
        3, 1, 2, "rollout", RolloutStatus.PROGRESSING, 130.0, strategy="canary", step=1,
        step_since=130.0, holding_since=140.0, weight=50, judged_at=150.0, begun=100.0,
    )  # fmt: skip
    text = strategy_state(rollout)
    back = restore_strategy(_rebuilt(rollout, 1000), text, 1160.0)
    assert (back.started, back.step_since, back.holding_since, back.judged_at) == (
        1130.0,
        1130.0,
        1140.0,
        1150.0,
    )
    # The wall clock went back while it was down: the restore put its start at ``now``.
    back = restore_strategy(_rebuilt(rollout).replace(started=500.0, begun=None), text, 500.0)
    assert back.holding_since == back.judged_at == back.started == 500.0
    with pytest.raises(ValueError, match="unknown rollout strategy"):
        restore_strategy(rollout, '{"strategy": "linear"}', 0.0)
    assert restore_strategy(rollout, None, 0.0) is rollout


def test_an_apply_during_a_canary_drains_the_superseded_canary_only() -> None:
    w = World.create(canary(), 4, 20, serving=True)
    w.user_apply()
    run_until(w, lambda w: split_of(w) == (2, 25))
    w.user_apply()  # revision 3 supersedes the canary of 2
    run_until(w, lambda w: split_of(w) == (3, 25))
    assert live(w, 2) == 0  # the superseded canary takes no share of the traffic
    assert live(w, 1) == 4
    assert w.ended[0].status is RolloutStatus.SUPERSEDED
    run_until(w, World.converged)
    assert w.desired.revision == 3
