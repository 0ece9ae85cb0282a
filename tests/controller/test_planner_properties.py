"""The planner's rules over generated histories, run through the simulator in ``simulation.py``.

Every step is one event (the backend, the prober, the clock or the user), then the plans the
reconciler would make at that instant, each applied through the real transitions; every plan
is checked against the rules (``plan_and_check``). At the end the world turns benign and the
service must converge. A failure prints the history's tail; the falsifying ``params``/``steps``
that Hypothesis prints can be pasted into an ``@example``.

R1  the planner's drains never take READY replicas below D - max_unavailable (if at or above)
R2  a READY old replica is drained only while old live + available target >= D - max_unavailable
R3  failures decide no other replica's fate: plans are blind to failed replicas, the backoff and
    the failure count (save a rollout failing); a failure event never adds a drain of a READY
    replica; FailReplica never hits a READY one; a READY target replica is drained only as
    scale-down excess; a failed rollout with rollback ends with the previous revision at full
    strength; with ``on_failure: pause`` it keeps the old revision as it was and the new
    replicas that run, gives up none as it pauses, and an abort stops them (the ``pause``
    test)
R4  the same causal check for no-capacity failures, and a scale-up (nothing old, not above D)
    drains nothing
R5  Stop only for a DRAINING replica whose drain finished; a superseding apply drains nothing
    of the serving revision before a replica of the new target is available (the
    ``superseding`` tests)
R6  without a delete (and D - max_unavailable >= 1) the planner never takes the last READY
    replica or the last live one away
R7  starts keep live + leaving replicas within D + max_surge (so a fleet of that size never
    runs out of capacity); WakeAt lies in the future, or is now after a rollout decision (the
    loop plans again at once); the plans at one instant are complete: one more drains, fails
    and stops nothing more. A rollout begun takes back the new target's replicas still
    draining (placed, not drained, not given up), up to D: one that was healthy serves again
R8  bookkeeping: CompleteRollout only with nothing old live and D target replicas available;
    Forget only for a deleted service with every replica terminal; in a backoff, no start
    before last failure + delay, then one start per plan
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from controller.planning import planner
from controller.planning.actions import (
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
    WakeAt,
)
from controller.planning.model import Backoff, Observed, Replica, ReplicaState, RolloutStatus
from controller.planning.planner import PAUSED_BY_REQUEST, backoff_delay, plan
from controller.spec import RolloutStrategy

from .simulation import MAX_REPLANS, World

READY = ReplicaState.READY
SETTINGS = settings(max_examples=250, deadline=None, print_blob=True)

# -- generated histories -------------------------------------------------------------------

strategies = st.fixed_dictionaries(
    {
        "min_ready": st.sampled_from([0.0, 5.0, 30.0]),
        "start_timeout": st.sampled_from([120.0, 600.0]),
        "progress_deadline": st.sampled_from([600.0, 1800.0]),
        "retries": st.integers(0, 3),
        "on_failure": st.sampled_from(["rollback", "pause"]),
        "retry_backoff": st.sampled_from([1.0, 10.0]),
    }
)
surge_unavailable = st.sampled_from([(1, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2), (2, 1)])
"""(max_surge, max_unavailable): any but (0, 0), the default most often."""

worlds = st.fixed_dictionaries(
    {
        "strategy": strategies,
        "surge_unavailable": surge_unavailable,
        "replicas": st.integers(0, 4),
        "capacity": st.integers(1, 6),
        "serving": st.booleans(),
    }
)

index = st.integers(0, 7)
step = st.one_of(
    st.tuples(
        st.just("spawn"), index, st.sampled_from(["ok", "ok", "no capacity", "start failed"])
    ),
    st.tuples(st.just("probe"), index, st.sampled_from([True, True, False])),
    st.tuples(st.just("crash"), index),
    st.tuples(st.just("drained"), index),
    st.tuples(st.just("stopped"), index),
    st.tuples(st.just("tick"), st.integers(0, 700)),
    st.tuples(st.just("apply"), st.sampled_from([None, None, "crash", "hang"])),
    st.tuples(st.just("scale"), st.integers(0, 4)),
    st.tuples(st.just("capacity"), st.integers(1, 6)),
    st.tuples(st.just("plan")),
    st.tuples(st.just("abort")),
    st.tuples(st.just("undo")),
)
histories = st.lists(step, min_size=10, max_size=100)

S = ReplicaState


def make_world(params: dict[str, Any]) -> World:
    surge, unavailable = params.get("surge_unavailable", (1, 0))
    strategy = RolloutStrategy(**params["strategy"], max_surge=surge, max_unavailable=unavailable)
    return World.create(strategy, params["replicas"], params["capacity"], serving=params["serving"])


def happen(w: World, step: tuple[Any, ...]) -> Observed | None:
    """Perform one step's event; if a replica failed or turned unhealthy, the state before."""
    before = w.observed
    kind, *args = step
    w.log.append(f"t={w.now:g} {step}")
    rollout = w.observed.rollout if w.observed.rollout and w.observed.rollout.active else None
    if kind == "spawn" and (rid := w.pick_pending(args[0])):
        w.spawn(rid, args[1])
    elif kind == "probe" and (r := w.pick([*RUNNING, S.DRAINING], args[0])):
        w.probe(r.id, args[1])
    elif kind == "crash" and (r := w.pick(RUNNING, args[0])):
        w.crash(r.id, 137)
    elif kind == "drained" and (r := w.pick_draining(args[0])):
        w.drain_done(r.id)
    elif kind == "stopped" and (r := w.pick([S.STOPPING], args[0])):
        w.stop_done(r.id)
    elif kind == "tick":
        w.now += args[0]
    elif kind == "apply":
        w.user_apply(args[0])
    elif kind == "scale":
        w.user_scale(args[0])
    elif kind == "capacity":
        w.capacity = args[0]
    elif kind == "pause" and rollout and rollout.status is RolloutStatus.PROGRESSING:
        # As operations.pause: only a progressing rollout, whatever the next plan holds.
        w.user_pause(True)
    elif kind == "resume" and rollout and rollout.status is RolloutStatus.PAUSED:
        w.user_pause(False)
    elif kind == "abort" and rollout and rollout.from_revision is not None:
        w.user_retarget(rollout.from_revision, "abort")
    elif kind == "undo":  # as operations.undo: where the rollout came from, or the one before
        back = rollout.from_revision if rollout else None
        back = w.desired.revision - 1 if back is None else back
        if 1 <= back != w.desired.revision:
            w.user_retarget(back, "undo")
    ready = {r.id for r in before.replicas if r.state is READY}
    was = {r.id: r.state for r in before.replicas}
    failed = w.observed.backoff.failures > before.backoff.failures or any(
        (r.id in ready and r.state is not READY) or (r.state is S.FAILED != was.get(r.id))
        for r in w.observed.replicas
    )
    return before if failed else None


RUNNING = [S.STARTING, S.READY, S.UNHEALTHY]


def fates(actions: list[Action]) -> set[Action]:
    """The actions that decide a replica's fate."""
    return {a for a in actions if isinstance(a, (Drain, FailReplica, Stop))}


def blind(o: Observed) -> Observed:
    """``o`` without its failures: no failed replica, no backoff, no failure count."""
    rollout = o.rollout.replace(failures=0) if o.rollout else None
    kept = tuple(r for r in o.replicas if r.state is not S.FAILED)
    return o.replace(replicas=kept, backoff=Backoff(), rollout=rollout)


def takeable(o: Observed, revision: int) -> list[Replica]:
    """Replicas of ``revision`` still draining that could serve again (rule 7)."""
    return [
        r
        for r in o.replicas
        if r.state is S.DRAINING
        and r.revision == revision
        and r.address is not None
        and not r.drained
        and not r.failure
    ]


def check_plan(w: World, before_failure: Observed | None = None) -> list[Action]:
    """One plan: check it against the rules, and apply it."""
    o, d, now = w.observed, w.desired, w.now
    actions = w.plan()
    for a in actions:  # the autoscaler's count is what the rest of the plan works to
        if isinstance(a, Rescale):
            d = d.replace(replicas=a.count)
    s, target = d.strategy, d.revision
    floor = d.replicas - s.max_unavailable
    by_id = {r.id: r for r in o.replicas}
    drained = [by_id[a.replica_id] for a in actions if isinstance(a, Drain)]
    given_up = [by_id[a.replica_id] for a in actions if isinstance(a, FailReplica)]
    ready_drained = [r for r in drained if r.state is READY]
    failing_rollout = any(
        isinstance(a, FailRollout)
        or (isinstance(a, PauseRollout) and a.reason != PAUSED_BY_REQUEST)
        for a in actions
    )
    rollout = o.rollout if o.rollout is not None and o.rollout.active else None
    deciding = any(
        isinstance(a, (BeginRollout, ResumeRollout, FailRollout, PauseRollout)) for a in actions
    ) or (  # a give-up counts against the rollout: it is judged again at once
        rollout is not None and any(r.revision == w.desired.revision for r in given_up)
    )

    for a in actions:
        if isinstance(a, Stop):
            r = by_id[a.replica_id]
            assert r.state is S.DRAINING, f"R5: {a} of {r}"
            assert r.drained, f"R5: {a} before the drain finished"
    assert all(r.live for r in drained + given_up), "Drain/FailReplica of a replica not live"
    assert not [r for r in given_up if r.state is READY], "R3: FailReplica of a READY replica"
    wakes = [a.at for a in actions if isinstance(a, WakeAt)]
    assert len(wakes) <= 1, f"R7: WakeAt {wakes}"
    assert all(at > now or (at == now and deciding) for at in wakes), f"R7: WakeAt {wakes} at {now}"
    if not failing_rollout:
        assert fates(plan(blind(o), w.desired, now)) == fates(actions), (
            "R3: a failure decided a fate"
        )
    if before_failure is not None:
        earlier = {
            a.replica_id for a in plan(before_failure, w.desired, now) if isinstance(a, Drain)
        }
        added = [r.id for r in ready_drained if r.id not in earlier]
        assert not added, f"R3/R4: the failure caused drains of READY {added}"
    live = [r for r in o.replicas if r.live]
    if any(isinstance(a, CompleteRollout) for a in actions):
        staying = [r for r in live if r not in given_up]
        old = [r for r in staying if r.revision != target]
        available = [r for r in staying if r.revision == target and r.available(now, s.min_ready)]
        assert not old, f"CompleteRollout with {old} live"
        assert len(available) == d.replicas, "CompleteRollout without D available"
    if any(isinstance(a, Forget) for a in actions):
        assert d.deleting, "Forget without a delete"
        assert all(r.terminal for r in o.replicas), "Forget with replicas left"
    if any(isinstance(a, Start) for a in actions) and o.backoff.failures:
        retry_at = o.backoff.last_failure_at + backoff_delay(o.backoff.failures, s)
        starts = sum(isinstance(a, Start) for a in actions)
        assert now >= retry_at, f"a start at {now}, in a backoff until {retry_at}"
        assert starts == 1, f"{starts} starts after a backoff"
    if not d.deleting and all(r.revision == target for r in live) and len(live) <= d.replicas:
        assert not drained, f"R4: drains {drained} while nothing is old or in excess"

    w.apply(actions)
    after = w.observed.replicas
    ready_before = sum(r.state is READY for r in o.replicas)
    ready_after = sum(r.state is READY for r in after)
    if not d.deleting:
        if ready_before >= floor:
            assert ready_after >= floor, f"R1: READY {ready_before} -> {ready_after} < {floor}"
        if any(r.revision != target for r in ready_drained):
            old_live = sum(r.live and r.revision != target for r in after)
            new = sum(r.revision == target and r.available(now, s.min_ready) for r in after)
            assert old_live + new >= floor, f"R2: {old_live} old + {new} new"
        if any(r.revision == target for r in ready_drained):
            kept = [r for r in live if r.revision == target and r not in given_up]
            assert len(kept) > d.replicas, "R3: a READY target replica drained, not in excess"
        if d.replicas >= 1 and floor >= 1:
            assert ready_after or not ready_before, "R6: the last READY replica was taken away"
            assert not drained or any(r.live for r in after), "R6: the last live one drained"
    if any(isinstance(a, Start) for a in actions):
        holding = sum(not r.terminal for r in after)
        assert holding <= d.replicas + s.max_surge, f"R7: {holding} slots > D + max_surge"
    for begun in [a for a in actions if isinstance(a, BeginRollout)]:
        check_taken_back(w, o, d.replicas, begun)
    return actions


def check_taken_back(w: World, o: Observed, replicas: int, begun: BeginRollout) -> None:
    """R7: the replicas of the new target still draining serve again, up to D; if they were
    all healthy, the target has a READY replica at once."""
    to = begun.to_revision
    lacking = replicas - sum(r.live and r.revision == to for r in o.replicas)
    candidates = takeable(o, to)
    now_ = {r.id: r for r in w.observed.replicas}
    back = [r for r in candidates if r.id in now_ and now_[r.id].live]
    wanted = min(max(lacking, 0), len(candidates))
    assert len(back) >= wanted, f"R7: {begun}: {len(back)} of {wanted} draining taken back"
    if wanted and all(r.healthy for r in candidates):
        assert w.ready_of(to) >= 1, f"R7: {begun}: a healthy draining replica does not serve"


def plan_and_check(w: World, before_failure: Observed | None = None) -> list[Action]:
    """The plans of one instant, as the loop makes them: each checked and applied; then one
    more would decide nothing. Every action taken."""
    taken: list[Action] = []
    for _ in range(MAX_REPLANS):
        actions = check_plan(w, before_failure)
        before_failure = None
        taken += actions
        if WakeAt(w.now) not in actions:
            break
    else:
        raise AssertionError(f"R7: plans at {w.now:g} do not settle")
    again = w.plan()
    extra: list[Action] = [a for a in again if isinstance(a, (Drain, FailReplica, Stop))]
    if not w.observed.backoff.failures:  # with a backoff, each plan may probe with a start
        extra += [a for a in again if isinstance(a, Start)]
    assert not extra, f"R7: planning again at the same instant adds {extra}"
    rollout = w.observed.rollout
    if w.desired.paused:
        paused = rollout is not None and rollout.status is RolloutStatus.PAUSED
        assert paused, f"R8: paused with no paused rollout to resume ({rollout})"
    return taken


def settle(w: World, rounds: int = 300) -> bool:
    """Benign rounds (ample capacity, starts placed, probes pass) until done; done?

    The benign backend and prober answer within a second; when neither they nor the plan
    change anything, the clock jumps to the plan's WakeAt (at most a minute).
    """
    w.capacity = 1000
    for _ in range(rounds):
        w.log.append(f"t={w.now:g} settle")
        changed = w.settle()
        actions = plan_and_check(w)
        if w.forgotten if w.desired.deleting else w.converged():
            return True
        busy = changed or [a for a in actions if not isinstance(a, (WakeAt, SetDegraded))]
        wakes = [a.at - w.now for a in actions if isinstance(a, WakeAt)]
        w.now += 1.0 if busy else max(1.0, min([60.0, *wakes]))
    return False


def check_liveness(w: World) -> None:
    if settle(w):
        rollback = next((r for r in reversed(w.ended) if r.kind == "rollback"), None)
        if rollback is not None and w.desired.revision == rollback.to_revision:
            serving = [r for r in w.observed.replicas if r.live]
            assert all(r.revision == rollback.to_revision for r in serving), "R3: not rolled back"
        return
    # Only a target that cannot work and has nothing to go back to, or a paused rollout, may
    # stay put; the user then fixes forward, and that must converge.
    rollout = w.observed.rollout
    paused = rollout is not None and rollout.status is RolloutStatus.PAUSED
    assert paused or w.desired.revision in w.bad, "did not converge"
    assert not w.desired.deleting, "a delete did not finish"
    w.log.append("user applies a good revision")
    w.user_apply(None)
    assert settle(w), "did not converge after a good apply"


def run_history(
    params: dict[str, Any], steps: list[tuple[Any, ...]], delete: bool = False
) -> World:
    w = make_world(params)
    try:
        plan_and_check(w)
        for s in steps:
            plan_and_check(w, happen(w, s))
        if delete:
            w.user_delete()
        check_liveness(w)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{w.describe()}") from e
    # What the histories reached (pytest --hypothesis-show-statistics).
    for rollout in {(r.kind, r.status) for r in w.ended}:
        event(" ".join(rollout))
    for mark in ("failed: no capacity", "failed: replica exited", "Undrain(", "FailRollout("):
        if any(mark in line for line in w.log):
            event(mark)
    return w


@SETTINGS
@given(params=worlds, steps=histories, delete=st.booleans())
@example(  # a replica given up was not counted as holding its slot: R7, a spurious no capacity
    params={
        "strategy": {"start_timeout": 120.0},
        "surge_unavailable": (0, 1),
        "replicas": 1,
        "capacity": 1,
        "serving": False,
    },
    steps=[("apply", "hang")],
    delete=False,
)
@example(  # a scale-down drained the only READY replica (within min_ready) before a REQUESTED
    params={"strategy": {"min_ready": 5.0}, "replicas": 1, "capacity": 2, "serving": True},
    steps=[("scale", 2), ("scale", 1)],
    delete=False,
)
def test_generated_histories_keep_the_rules_and_converge(params, steps, delete):
    run_history(params, steps, delete)


# -- the background reports, as properties -------------------------------------------------

full_fleet_step = st.one_of(
    st.tuples(st.just("spawn"), index, st.sampled_from(["ok", "no capacity", "start failed"])),
    st.tuples(st.just("probe_new"), index, st.booleans()),
    st.tuples(st.just("drained"), index),
    st.tuples(st.just("stopped"), index),
    st.tuples(st.just("tick"), st.integers(0, 700)),
    st.tuples(st.just("apply"), st.sampled_from([None, "crash", "hang"])),
    st.tuples(st.just("scale_up"), st.integers(1, 2)),
)


@SETTINGS
@given(params=worlds, steps=st.lists(full_fleet_step, max_size=40))
def test_a_full_fleet_never_loses_its_serving_replicas(params, steps):
    """A service on a fleet with no spare slot, updated or scaled up with nothing failing but
    the new replicas: READY replicas never drop below D - max_unavailable (with the default
    ``max_unavailable: 0``, the old revision serves at full strength throughout)."""
    params = {**params, "serving": True, "replicas": max(1, params["replicas"])}
    params["capacity"] = params["replicas"]
    w = make_world(params)
    floor = params["replicas"] - w.desired.strategy.max_unavailable
    try:
        for kind, *args in steps:
            w.log.append(f"t={w.now:g} {(kind, *args)}")
            if kind == "probe_new":  # only replicas that are not ready: nothing ready fails
                if r := w.pick([S.STARTING, S.UNHEALTHY], args[0]):
                    w.probe(r.id, args[1])
                plan_and_check(w)
            elif kind == "scale_up":
                w.user_scale(min(w.desired.replicas + args[0], 8))
                plan_and_check(w)
            else:
                plan_and_check(w, happen(w, (kind, *args)))
            ready = sum(r.state is READY for r in w.observed.replicas)
            assert ready >= floor, f"{ready} READY < {floor}"
            if ready < w.desired.replicas:  # reported now, or by the next plan (drains lag)
                reported = [a for a in w.plan() if isinstance(a, SetDegraded) and a.reason]
                assert w.observed.degraded or reported, "fewer ready than desired, not degraded"
        check_liveness(w)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{w.describe()}") from e


# -- the background reports, step by step --------------------------------------------------


def ready_of(w: World, revision: int) -> int:
    return sum(r.state is READY and r.revision == revision for r in w.observed.replicas)


def test_a_rolling_update_that_cannot_place_its_replica_leaves_the_old_one_serving():
    """failed-rollout-terminates-healthy-service: one node, one replica, apply v2."""
    w = World.create(RolloutStrategy(), replicas=1, capacity=1, serving=True)
    w.user_apply()
    for _ in range(20):
        actions = plan_and_check(w)
        assert ready_of(w, 1) == 1
        if w.desired.revision == 1:
            break
        if r := w.pick([S.REQUESTED], 0):
            assert not [a for a in actions if isinstance(a, (Drain, Stop))]
            w.spawn(r.id, "ok")  # no slot: the backend raises no capacity
        w.now += 60
    failed, rollback = w.ended[-2:]
    assert failed.status is RolloutStatus.FAILED
    assert failed.reason == "no capacity: 1 of 1 slots in use (after 3 failures)"
    # The rollback began and, with nothing to do, completed at the same instant.
    assert rollback.kind == "rollback"
    assert rollback.status is RolloutStatus.COMPLETE
    assert w.observed.serving_revision == 1
    assert ready_of(w, 1) == 1
    assert not [r for r in w.observed.replicas if r.live and r.revision == 2]


def test_a_scale_up_that_cannot_be_placed_leaves_the_service_up_and_degraded():
    """scale-up-failure-terminates-service: one node, scale 1 -> 2."""
    w = World.create(RolloutStrategy(), replicas=1, capacity=1, serving=True)
    w.user_scale(2)
    assert plan_and_check(w)[0] == Start(1)
    requested = w.pick_pending(0)
    assert requested is not None
    w.spawn(requested, "ok")
    actions = plan_and_check(w)
    assert SetDegraded("1 of 2 replicas ready: no capacity: 1 of 1 slots in use") in actions
    assert not [a for a in actions if isinstance(a, (Drain, Stop, FailRollout))]
    for _ in range(30):  # it keeps retrying, with backoff, and never touches the running one
        w.now += 120
        if r := w.pick([S.REQUESTED], 0):
            w.spawn(r.id, "ok")
        plan_and_check(w)
        assert ready_of(w, 1) == 1
    assert w.observed.backoff.failures > 5
    w.capacity = 2
    assert settle(w)
    assert ready_of(w, 1) == 2


@SETTINGS
@given(
    params=worlds,
    steps=histories,
    bad=st.sampled_from(["crash", "hang"]),
    retries=st.integers(0, 2),
)
@example(
    params={
        "strategy": {},
        "surge_unavailable": (1, 0),
        "replicas": 2,
        "capacity": 3,
        "serving": True,
    },
    steps=[],
    bad="crash",
    retries=2,
)
def test_a_failed_rollout_rolls_back_to_full_strength(params, steps, bad, retries):
    """A bad apply on a serving service, any history, then a benign world (bad stays bad):
    with rollback, the previous revision comes back at full strength, nothing of the bad one
    stays live, and the failure is recorded."""
    params = {
        **params,
        "serving": True,
        "replicas": max(1, params["replicas"]),
        "strategy": {**params["strategy"], "on_failure": "rollback", "retries": retries},
    }
    w = make_world(params)
    try:
        for s in steps:  # some history that ends with a serving revision
            plan_and_check(w, happen(w, s))
        w.user_scale(max(1, w.desired.replicas))
        if w.desired.paused:
            w.user_pause(False)
        # Whatever reaches full strength serves (rule 10), even if its own rollout failed; a
        # history may end on a revision that never comes up (a bad first revision): apply a
        # good one then.
        if not settle(w):
            w.user_apply(None)
            assert settle(w), w.describe()
        assert w.observed.serving_revision == w.desired.revision, w.describe()
        serving = w.desired.revision
        broken = w.user_apply(bad)
        assert settle(w)
        assert w.desired.revision == serving
        assert ready_of(w, serving) == w.desired.replicas
        assert not [r for r in w.observed.replicas if r.live and r.revision == broken]
        failed = [r for r in w.ended if r.to_revision == broken]
        assert failed, "the bad rollout was not recorded"
        assert failed[-1].status is RolloutStatus.FAILED
        assert failed[-1].reason
    except AssertionError as e:
        raise AssertionError(f"{e}\n{w.describe()}") from e


# -- pause and resume (rule 8) -------------------------------------------------------------

pausing_step = st.one_of(step, st.tuples(st.just("pause")), st.tuples(st.just("resume")))


@SETTINGS
@given(params=worlds, steps=st.lists(pausing_step, min_size=10, max_size=100))
def test_generated_histories_with_pause_and_resume_keep_the_rules_and_converge(params, steps):
    w = run_history(params, steps)
    if any("PauseRollout(" in line for line in w.log):
        event("paused")
    if any("ResumeRollout(" in line for line in w.log):
        event("resumed")


def test_a_pause_asked_as_the_rollout_completes_is_kept():
    """Rule 8: D = 1; revision 2's replica is READY and revision 1's drains (the rollout
    completes at the next plan) when the user pauses. The pause should hold the rollout
    (or be refused), never leave the service paused with nothing to resume."""
    w = World.create(RolloutStrategy(), replicas=1, capacity=3, serving=True)
    w.user_apply(None)
    w.step()
    w.spawn("r2", "ok")
    w.probe("r2", True)
    w.step()  # r2 READY: r1 drains
    w.user_pause(True)
    w.step()
    rollout = w.observed.rollout
    assert w.desired.paused
    assert rollout is not None, f"paused with no rollout to resume\n{w.describe()}"
    assert rollout.status is RolloutStatus.PAUSED
    w.user_pause(False)  # resumed, it completes; nothing is left paused
    w.step()
    assert w.observed.rollout is None, w.describe()
    assert not w.desired.paused
    w.user_scale(2)
    w.step()
    assert [r for r in w.observed.replicas if r.state is S.REQUESTED], "a scale-up starts nothing"


# -- the rules that were decided outside the planner -----------------------------------------
#
# Each test below drives the real loop (``World.step``: plan, decide, replan at once) through
# a history built to reach its rule, and checks that rule alone, so that a mutation of the rule
# is caught by its own test (the ``mutated`` tests at the end).

FOCUSED = settings(max_examples=100, deadline=None, print_blob=True)


def roll_on(w: World, drains_finish: bool = False, seconds: float = 5.0) -> None:
    """A benign moment of the rollout: starts are placed, probes pass, stops end; drains
    finish only if ``drains_finish``. Then the clock moves on ``seconds`` and the loop
    plans."""
    for rid in list(w.pending):
        w.spawn(rid, "ok")
    for r in w.observed.replicas:
        if r.state in (S.STARTING, S.UNHEALTHY):
            w.probe(r.id, True)
        elif r.state is S.STOPPING:
            w.stop_done(r.id)
        elif drains_finish and r.state is S.DRAINING and r.address and not r.drained:
            w.drain_done(r.id)
    w.now += seconds
    w.step()


def run_focused(w: World, body: Callable[[], None]) -> None:
    try:
        body()
    except AssertionError as e:
        raise AssertionError(f"{e}\n{w.describe()}") from e


rollback_worlds = st.fixed_dictionaries(
    {
        "strategy": st.fixed_dictionaries(
            {
                "min_ready": st.sampled_from([0.0, 5.0]),
                "retries": st.integers(0, 2),
                "on_failure": st.just("rollback"),
            }
        ),
        "surge_unavailable": surge_unavailable,
        "replicas": st.integers(1, 4),
        "capacity": st.just(20),
        "serving": st.just(True),
    }
)


@FOCUSED
@given(
    params=rollback_worlds,
    rounds=st.integers(1, 8),
    back=st.sampled_from(["failure", "abort", "apply of the serving spec", "undo"]),
)
@example(
    params={
        "strategy": {"retries": 0, "on_failure": "rollback"},
        "replicas": 2,
        "capacity": 20,
        "serving": True,
    },
    rounds=2,
    back="failure",
)
def test_a_rollback_takes_back_old_replicas_still_draining(params, rounds, back):
    check_taking_back(params, rounds, back)


def note(what: str) -> None:
    """What a focused history reached, for ``--hypothesis-show-statistics``."""
    if currently_in_test_context():
        event(what)


def check_taking_back(params: dict[str, Any], rounds: int, back: str) -> None:
    """Rule 7, through rule 3: revision 2 replaces revision 1, whose replicas drain slowly;
    then the rollout goes back (its new replicas crash, or the user aborts, applies the
    serving spec or undoes). From the plan that goes back on, revision 1 never lacks a
    routable replica while one of its replicas is draining and healthy: the draining ones
    serve again, up to D."""
    w = make_world(params)
    d = params["replicas"]

    def body() -> None:
        w.user_apply(None)
        w.step()
        for _ in range(rounds):
            roll_on(w)
        if not takeable(w.observed, 1):
            return  # nothing of revision 1 drains yet: nothing to take back
        if back in ("failure", "abort") and w.observed.rollout is None:
            return  # complete already: it can neither fail nor be aborted
        note(f"a replica of revision 1 drains as the rollout goes back ({back})")
        routable = w.ready_of(1) + len(takeable(w.observed, 1))
        if back == "failure":
            w.bad[2] = "crash"
            for _ in range(30):  # the new replicas crash until the rollout fails
                r = next((r for r in w.observed.replicas if r.revision == 2 and r.live), None)
                rollout = w.observed.rollout
                if r is None:  # no slot for one (no surge): the deadline fails the rollout
                    started = rollout.started if rollout else 0.0
                    w.now = max(w.now, started + w.desired.strategy.progress_deadline)
                elif r.state is S.REQUESTED:
                    w.spawn(r.id, "ok")
                else:
                    w.crash(r.id, 1)
                w.now += 1.0
                w.step()
                if w.desired.revision == 1:
                    break
            assert [r for r in w.ended if r.status is RolloutStatus.FAILED], "did not fail"
        elif back == "undo":
            w.user_retarget(1, "undo")
            w.step()
        else:
            w.user_retarget(1, "abort" if back == "abort" else "apply")
            w.step()
        assert w.observed.target == 1
        ready = w.ready_of(1)
        assert ready >= min(d, routable), f"rule 7: {ready} of revision 1 serve, not {routable}"
        for _ in range(60):  # and on, until revision 1 serves at full strength
            held = takeable(w.observed, 1)
            lacking = d - sum(r.live and r.revision == 1 for r in w.observed.replicas)
            if held and lacking > 0:
                assert w.ready_of(1) >= 1, "rule 7: nothing of revision 1 serves, one drains"
            roll_on(w, drains_finish=True)
        assert w.ready_of(1) == d

    run_focused(w, body)


pause_worlds = st.fixed_dictionaries(
    {
        "strategy": st.fixed_dictionaries(
            {
                "min_ready": st.sampled_from([0.0, 5.0]),
                "retries": st.integers(0, 2),
                "progress_deadline": st.sampled_from([600.0, 1800.0]),
                "on_failure": st.just("pause"),
            }
        ),
        "surge_unavailable": surge_unavailable,
        "replicas": st.integers(1, 4),
        "capacity": st.integers(1, 8),
        "serving": st.just(True),
    }
)
new_replica_step = st.one_of(
    st.tuples(st.just("spawn"), index, st.sampled_from(["ok", "no capacity", "start failed"])),
    st.tuples(st.just("probe_new"), index, st.booleans()),
    st.tuples(st.just("crash_new"), index),
    st.tuples(st.just("drained"), index),
    st.tuples(st.just("stopped"), index),
    st.tuples(st.just("tick"), st.integers(0, 700)),
)


@FOCUSED
@given(
    params=pause_worlds,
    bad=st.sampled_from(["crash", "hang"]),
    steps=st.lists(new_replica_step),
    end=st.sampled_from(["abort", "resume"]),
)
@example(
    params={
        "strategy": {"retries": 0, "on_failure": "pause"},
        "replicas": 2,
        "capacity": 8,
        "serving": True,
    },
    bad="crash",
    steps=[("spawn", 0, "ok"), ("probe_new", 0, True)],
    end="abort",
)
@example(
    params={
        "strategy": {"retries": 0, "on_failure": "pause"},
        "replicas": 1,
        "capacity": 8,
        "serving": True,
    },
    bad="hang",
    steps=[("spawn", 0, "ok"), ("probe_new", 0, False)],
    end="resume",
)
def test_a_failed_rollout_in_pause_mode_keeps_the_old_revision_at_full_strength(
    params, bad, steps, end
):
    check_pausing_on_failure(params, bad, steps, end)


def check_pausing_on_failure(
    params: dict[str, Any], bad: str, steps: list[tuple[Any, ...]], end: str = "abort"
) -> None:
    """Rule 3 with ``on_failure: pause``: a bad revision 2 is applied; only its replicas
    fail. Its READY replicas of revision 1 never drop below D - max_unavailable; once the
    rollout fails it is held paused, and from then on nothing is started, drained or given
    up: revision 1 keeps what it had, for as long as the user leaves it so. The replicas of
    revision 2 that run when it fails are kept (for inspection), those whose give-up failed
    it too. Then the user aborts (back to revision 1 at full strength, every replica of
    revision 2 stopped) or resumes (the rollout goes on with its retries afresh: the kept
    replicas that were given up are replaced, not counted again)."""
    w = make_world(params)
    d, floor = params["replicas"], params["replicas"] - w.desired.strategy.max_unavailable

    def new(index: int, states: list[S]) -> Replica | None:
        found = [r for r in w.observed.replicas if r.revision == 2 and r.state in states]
        return found[index % len(found)] if found else None

    def body() -> None:
        w.user_apply(bad)
        w.step()
        held: int | None = None  # revision 1's READY replicas when the rollout failed
        for kind, *args in [*steps, ("tick", 2000), ("tick", 2000)]:
            w.log.append(f"t={w.now:g} {(kind, *args)}")
            if kind == "spawn" and (rid := w.pick_pending(args[0])):
                w.spawn(rid, args[1])
            elif kind == "probe_new" and (r := new(args[0], RUNNING)):
                w.probe(r.id, args[1])
            elif kind == "crash_new" and (r := new(args[0], RUNNING)):
                w.crash(r.id, 1)
            elif kind == "drained" and (r := w.pick_draining(args[0])):
                w.drain_done(r.id)
            elif kind == "stopped" and (r := w.pick([S.STOPPING], args[0])):
                w.stop_done(r.id)
            elif kind == "tick":
                w.now += args[0]
            actions = w.step()
            assert w.ready_of(1) >= floor, f"rule 3: {w.ready_of(1)} of revision 1 READY"
            if held is not None:
                moved = [a for a in actions if isinstance(a, (Start, Drain, FailReplica))]
                assert not moved, f"rule 3: {moved} after the rollout failed, paused"
                assert w.ready_of(1) >= held, "rule 3: revision 1 lost strength, paused"
            failed = [r for r in w.ended if r.to_revision == 2]
            rollout = w.observed.rollout
            if held is None and (failed or (rollout and rollout.status is RolloutStatus.PAUSED)):
                assert not failed, f"rule 3: the rollout ended {failed[0].status}, not paused"
                assert rollout is not None
                assert rollout.reason, "rule 3: paused with no reason"
                assert w.desired.paused, "rule 3: paused, but desired.paused is not set"
                given_up = [a for a in actions if isinstance(a, FailReplica)]
                assert not given_up, f"rule 3: {given_up} as it paused, not kept"
                for a in actions:
                    if isinstance(a, KeepFailed):
                        assert w.get(a.replica_id).live, f"rule 3: {a}, not live"
                        note("a replica kept on failure")
                held = w.ready_of(1)
                note("paused on failure")
        assert held is not None, "rule 3: past its deadline, the rollout did not fail"
        assert w.desired.revision == 2, "rule 3: paused, the target moved"
        w.capacity = 1000
        if end == "resume":
            check_resume()
            return
        # The user aborts: back to revision 1, at full strength, revision 2 all stopped.
        w.user_retarget(1, "abort")
        for _ in range(60):
            roll_on(w, drains_finish=True)
        assert w.ready_of(1) == d, "after the abort, revision 1 not at full strength"
        left = [r for r in w.observed.replicas if r.revision == 2 and not r.terminal]
        assert not left, f"after the abort, {left} of revision 2 not stopped"

    def check_resume() -> None:
        kept = {r.id for r in w.observed.replicas if r.live and r.failure}
        w.user_pause(False)
        w.step()
        rollout = w.observed.rollout
        assert rollout is not None, "rule 8: resumed, the rollout ended"
        assert rollout.status is RolloutStatus.PROGRESSING, "rule 8: resumed, paused again"
        assert rollout.failures == 0, "rule 8: resumed, its kept replicas counted again"
        still = [r for r in w.observed.replicas if r.id in kept and r.live]
        assert not still, f"rule 8: resumed, kept {still} not replaced"
        for _ in range(10):  # the revision is bad: it fails again, and pauses again
            roll_on(w, drains_finish=True, seconds=500.0)
            assert w.ready_of(1) >= floor, f"rule 3: {w.ready_of(1)} of revision 1 READY"
            rollout = w.observed.rollout
            assert rollout is not None, "rule 3: resumed, the rollout ended, not paused"
            if rollout.status is RolloutStatus.PAUSED:
                return
        raise AssertionError("rule 3: resumed, the rollout did not fail again")

    run_focused(w, body)


superseding_worlds = st.fixed_dictionaries(
    {
        "strategy": st.fixed_dictionaries(
            {"min_ready": st.just(0.0), "retries": st.integers(0, 3)}
        ),
        "surge_unavailable": st.sampled_from([(1, 0), (2, 0), (3, 0)]),
        "replicas": st.integers(1, 4),
        "capacity": st.just(20),
        "serving": st.just(True),
    }
)
superseding_step = st.one_of(
    st.tuples(st.just("spawn"), index, st.sampled_from(["ok", "ok", "start failed"])),
    st.tuples(st.just("probe"), index, st.sampled_from([True, True, False])),
    st.tuples(st.just("crash"), index),
    st.tuples(st.just("drained"), index),
    st.tuples(st.just("stopped"), index),
    st.tuples(st.just("tick"), st.integers(0, 60)),
)


def supersede(
    w: World, v2: str | None, before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]
) -> None:
    """Revision 1 serves; apply revision 2 (``v2``: bad or not), the ``before`` events, then
    apply a good revision 3 and the ``after`` events, then a benign world. Rule 5: no plan
    drains a READY replica of revision 1 while no replica of revision 3 is available."""
    s = w.desired.strategy

    def step() -> None:
        o = w.observed
        actions = w.step()
        if w.desired.revision != 3:
            return
        available = [r for r in o.replicas if r.revision == 3 and r.available(w.now, s.min_ready)]
        serving = {r.id for r in o.replicas if r.revision == 1 and r.state is READY}
        drained = [a for a in actions if isinstance(a, Drain) and a.replica_id in serving]
        assert available or not drained, f"rule 5: {drained} before revision 3 is available"

    def body() -> None:
        w.user_apply(v2)
        step()
        for e in before:
            happen(w, e)
            step()
        w.user_apply(None)
        step()
        for e in after:
            happen(w, e)
            step()
        for _ in range(120):
            if w.converged():
                break
            w.settle()
            w.now += 5.0
            step()
        assert w.converged(), "did not converge"

    run_focused(w, body)


@FOCUSED
@given(
    params=superseding_worlds,
    v2=st.sampled_from([None, "crash", "hang"]),
    before=st.lists(superseding_step, max_size=30),
    after=st.lists(superseding_step, max_size=30),
)
def test_a_superseding_apply_drains_nothing_serving_before_the_new_target_is_available(
    params, v2, before, after
):
    """Rule 5, with a plan after each event and no ``min_ready``: apply revision 3 during
    the rollout to revision 2; revision 1 keeps serving until a replica of revision 3 can
    take a place."""
    supersede(make_world(params), v2, before, after)


def test_a_superseding_apply_within_min_ready_drains_nothing_serving_too_early():
    """Rule 5: revision 2's replica is READY, not yet for ``min_ready``, when revision 3 is
    applied; revision 1's only replica is drained at once, for revision 2 to serve alone."""
    params = {
        "strategy": {"min_ready": 5.0},
        "replicas": 1,
        "capacity": 20,
        "serving": True,
    }
    supersede(make_world(params), None, [("spawn", 0, "ok"), ("probe", 1, True)], [])


def test_going_back_takes_back_a_healthy_draining_replica_first():
    """Rule 7: an undo to revision 1, D = 1, finds two of its replicas draining, the newer
    one unhealthy; the older, healthy one should serve again."""
    w = World.create(RolloutStrategy(), replicas=1, capacity=20, serving=True)
    r1 = w.observed.replicas[0]
    sick = r1.replace(
        id="r9", since=20.0, address="127.0.0.1:r9", healthy=False, probe_failure="refused"
    )
    v2 = Replica("r8", 2, READY, 10.0, 10.0, 10.0, "127.0.0.1:r8", healthy=True)
    w.observed = w.observed.replace(
        replicas=(r1.replace(state=S.DRAINING), sick.replace(state=S.DRAINING), v2),
        serving_revision=2,
        target=2,
    )
    w.desired = w.desired.replace(revision=2)
    w.now = 30.0
    w.user_retarget(1, "undo")
    w.step()
    assert w.ready_of(1) == 1, w.describe()


def test_an_undo_takes_back_a_replica_drained_before_it_was_ready_and_it_serves():
    """Rules 7 and 10: a new service's only replica is drained while it starts (``max_surge:
    0, max_unavailable: 1``) for revision 2, which has no slot; its probes pass while it
    drains; an undo takes it back. READY, it is available from when its probes passed (a
    READY replica with no ``ready_since`` is never available), so the undo completes and
    revision 1 serves."""
    strategy = RolloutStrategy(max_surge=0, max_unavailable=1, retries=0, start_timeout=120.0)
    w = World.create(strategy, replicas=1, capacity=1, serving=False)
    plan_and_check(w)  # the first rollout begins and starts r1
    w.spawn("r1", "ok")
    plan_and_check(w)
    w.now = 5.0
    w.user_apply()
    plan_and_check(w)  # r1, still starting, is drained first; revision 2 has no slot
    assert w.get("r1").state is S.DRAINING
    w.now = 10.0
    w.probe("r1", True)
    plan_and_check(w)
    w.now = 20.0
    w.user_retarget(1, "undo")
    plan_and_check(w)
    r1 = w.get("r1")
    assert (r1.state, r1.ready_since) == (READY, 10.0), w.describe(tail=20)
    assert [(r.kind, r.status) for r in w.ended] == [
        ("rollout", RolloutStatus.SUPERSEDED),
        ("rollout", RolloutStatus.SUPERSEDED),
        ("undo", RolloutStatus.COMPLETE),
    ]
    assert w.observed.serving_revision == 1
    assert settle(w)


def test_a_failed_rollout_goes_back_to_what_served_even_after_a_failed_first_rollout():
    """Rule 3: a new service's first rollout fails once (its replica crashes, retries 0),
    then revision 1 comes up on retry and serves at full strength; a bad revision 2 is then
    applied and fails. It should roll back to revision 1."""
    w = World.create(RolloutStrategy(retries=0), replicas=1, capacity=20, serving=False)
    w.step()  # the first rollout begins and starts r1
    w.spawn("r1", "ok")
    w.step()
    w.crash("r1", 1)
    w.step()  # retries 0: the first rollout fails, with nothing to go back to
    assert [r.status for r in w.ended] == [RolloutStatus.FAILED]
    assert settle(w)
    assert w.ready_of(1) == 1  # revision 1 serves at full strength
    w.user_apply("crash")
    settle(w, rounds=100)
    assert w.desired.revision == 1, w.describe(tail=10)


def test_a_give_up_that_spends_the_retries_fails_the_rollout_at_once():
    """Rule 3 then 7: revision 2's only replica is READY, revision 1's drains; revision 2
    turns unhealthy and is given up after start_timeout (retries 0). The rollout should fail
    in the same instant and revision 1's replica serve again, before its drain can end."""
    strategy = RolloutStrategy(retries=0, start_timeout=120)
    w = World.create(strategy, replicas=1, capacity=20, serving=True)
    w.user_apply(None)
    w.step()
    w.spawn("r2", "ok")
    w.probe("r2", True)
    w.step()  # r2 READY: r1 drains
    assert w.get("r1").state is S.DRAINING
    w.probe("r2", False)
    w.step()
    w.now += 120.0
    w.step()  # r2 given up: one failure, retries 0
    assert w.ready_of(1) == 1, w.describe()


# -- each rule above, broken on purpose, fails its test ------------------------------------


@contextmanager
def mutated(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``controller.planning.planner.<name>`` replaced for the duration (the planner looks its
    helpers up by name at each call)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(planner, name, replacement)
    try:
        yield
    finally:
        mp.undo()


TAKING_BACK = {
    "strategy": {"retries": 0, "on_failure": "rollback"},
    "replicas": 2,
    "capacity": 20,
    "serving": True,
}


def no_undrains(observed: Observed, replicas: int, revision: int) -> list[Action]:
    return []


@pytest.mark.parametrize("back", ["failure", "abort", "apply of the serving spec", "undo"])
def test_mutated_no_draining_replica_is_taken_back(back):
    check_taking_back(TAKING_BACK, 2, back)  # as the property runs it
    with mutated("_undrains", no_undrains), pytest.raises(AssertionError, match="rule 7"):
        check_taking_back(TAKING_BACK, 2, back)


PAUSING = {
    "strategy": {"retries": 0, "on_failure": "pause"},
    "replicas": 2,
    "capacity": 8,
    "serving": True,
}
CRASHING_ONCE = [("spawn", 0, "ok"), ("probe_new", 0, True)]
real_fail = planner._fail


def fail_and_retry(observed: Observed, desired: Any, rollout: Any, reason: str) -> list[Action]:
    """``on_failure: pause`` taken as: end the rollout failed, keep retrying the target."""
    if desired.strategy.on_failure == "pause":
        return [FailRollout(rollout.id, reason)]
    return real_fail(observed, desired, rollout, reason)


def fail_and_roll_back(observed: Observed, desired: Any, rollout: Any, reason: str) -> list[Action]:
    """``on_failure: pause`` ignored: roll back as ``on_failure: rollback`` would."""
    rollback = desired.replace(
        strategy=desired.strategy.model_copy(update={"on_failure": "rollback"})
    )
    return real_fail(observed, rollback, rollout, reason)


@pytest.mark.parametrize("mutation", [fail_and_retry, fail_and_roll_back])
@pytest.mark.parametrize("bad", ["crash", "hang"])
def test_mutated_a_failed_rollout_in_pause_mode_is_not_held(mutation, bad):
    check_pausing_on_failure(PAUSING, bad, CRASHING_ONCE)  # as the property runs it
    with mutated("_fail", mutation), pytest.raises(AssertionError, match="rule 3"):
        check_pausing_on_failure(PAUSING, bad, CRASHING_ONCE)


real_retarget = planner._retarget


def retire_the_serving(observed: Observed, desired: Any, rollout: Any) -> list[Action]:
    """A superseding apply that retires the serving revision at once."""
    actions = real_retarget(observed, desired, rollout)
    if rollout is not None:
        serving = observed.serving_revision
        actions += [
            Drain(r.id, "superseded")
            for r in observed.replicas
            if r.revision == serving and r.state is READY
        ]
    return actions


SUPERSEDING = {
    "strategy": {"min_ready": 0.0},
    "replicas": 2,
    "capacity": 20,
    "serving": True,
}


@pytest.mark.parametrize("v2", [None, "crash", "hang"])
def test_mutated_a_superseding_apply_drains_the_serving_revision(v2):
    before = [("spawn", 0, "ok")]
    supersede(make_world(SUPERSEDING), v2, before, [])  # as the property runs it
    with mutated("_retarget", retire_the_serving), pytest.raises(AssertionError, match="rule 5"):
        supersede(make_world(SUPERSEDING), v2, before, [])
