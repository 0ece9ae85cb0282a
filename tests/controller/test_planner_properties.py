"""The planner's rules over generated histories, run through the simulator in ``simulation.py``.

Every step is one event (the backend, the prober, the clock or the user), then a plan that the
simulator applies; every plan is checked against the rules (``plan_and_check``). At the end the
world turns benign and the service must converge. A failure prints the history's tail; the
falsifying ``params``/``steps`` that Hypothesis prints can be pasted into an ``@example``.

R1  the planner's drains never take READY replicas below D - max_unavailable (if at or above)
R2  a READY old replica is drained only while old live + available target >= D - max_unavailable
R3  failures decide no other replica's fate: plans are blind to failed replicas, the backoff and
    the failure count (save FailRollout); a failure event never adds a drain of a READY replica;
    FailReplica never hits a READY one; a READY target replica is drained only as scale-down
    excess; a failed rollout with rollback ends with the previous revision at full strength
R4  the same causal check for no-capacity failures, and a scale-up (nothing old, not above D)
    drains nothing
R5  Stop only for a DRAINING replica whose drain finished
R6  without a delete (and D - max_unavailable >= 1) the planner never takes the last READY
    replica or the last live one away
R7  starts keep live + leaving replicas within D + max_surge (so a fleet of that size never
    runs out of capacity); WakeAt lies in the future; a plan is complete: planning again at the
    same instant drains, fails and stops nothing more
R8  bookkeeping: CompleteRollout only with nothing old live and D target replicas available;
    Forget only for a deleted service with every replica terminal; in a backoff, no start
    before last failure + delay, then one start per plan
"""

from __future__ import annotations

from typing import Any

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from controller.actions import (
    Action,
    CompleteRollout,
    Drain,
    FailReplica,
    FailRollout,
    Forget,
    SetDegraded,
    Start,
    Stop,
    WakeAt,
)
from controller.model import Backoff, Observed, ReplicaState, RolloutStatus
from controller.planner import backoff_delay, plan
from controller.spec import RolloutStrategy

from .simulation import World

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
    if kind == "spawn" and (r := w.pick([S.REQUESTED], args[0])):
        w.spawn(r.id, args[1])
    elif kind == "probe" and (r := w.pick([S.STARTING, S.READY, S.UNHEALTHY], args[0])):
        w.probe(r.id, args[1])
    elif kind == "crash" and (r := w.pick([S.STARTING, S.READY, S.UNHEALTHY], args[0])):
        w.crash(r.id, 137)
    elif kind == "drained" and (r := w.pick([S.DRAINING], args[0])):
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
    ready = {r.id for r in before.replicas if r.state is READY}
    failed = w.observed.backoff.failures > before.backoff.failures or any(
        r.id in ready and r.state is not READY for r in w.observed.replicas
    )
    return before if failed else None


def fates(actions: list[Action]) -> set[Action]:
    """The actions that decide a replica's fate."""
    return {a for a in actions if isinstance(a, (Drain, FailReplica, Stop))}


def blind(o: Observed) -> Observed:
    """``o`` without its failures: no failed replica, no backoff, no failure count."""
    rollout = o.rollout.replace(failures=0) if o.rollout else None
    kept = tuple(r for r in o.replicas if r.state is not S.FAILED)
    return o.replace(replicas=kept, backoff=Backoff(), rollout=rollout)


def plan_and_check(w: World, before_failure: Observed | None = None) -> list[Action]:
    """Plan, check the plan against the rules, and apply it."""
    o, d, now = w.observed, w.desired, w.now
    s, target = d.strategy, d.revision
    floor = d.replicas - s.max_unavailable
    actions = w.plan()
    by_id = {r.id: r for r in o.replicas}
    drained = [by_id[a.replica_id] for a in actions if isinstance(a, Drain)]
    given_up = [by_id[a.replica_id] for a in actions if isinstance(a, FailReplica)]
    ready_drained = [r for r in drained if r.state is READY]
    failing_rollout = any(isinstance(a, FailRollout) for a in actions)

    for a in actions:
        if isinstance(a, Stop):
            r = by_id[a.replica_id]
            assert r.state is S.DRAINING, f"R5: {a} of {r}"
            assert r.drained, f"R5: {a} before the drain finished"
    assert all(r.live for r in drained + given_up), "Drain/FailReplica of a replica not live"
    assert not [r for r in given_up if r.state is READY], "R3: FailReplica of a READY replica"
    wakes = [a.at for a in actions if isinstance(a, WakeAt)]
    assert len(wakes) <= 1, f"R7: WakeAt {wakes}"
    assert all(at > now for at in wakes), f"R7: WakeAt {wakes} at {now}"
    if not failing_rollout:
        assert fates(plan(blind(o), d, now)) == fates(actions), "R3: a failure decided a fate"
    if before_failure is not None:
        earlier = {a.replica_id for a in plan(before_failure, d, now) if isinstance(a, Drain)}
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
            available = sum(r.revision == target and r.available(now, s.min_ready) for r in after)
            assert old_live + available >= floor, f"R2: {old_live} old + {available} new"
        if any(r.revision == target for r in ready_drained):
            kept = [r for r in live if r.revision == target and r not in given_up]
            assert len(kept) > d.replicas, "R3: a READY target replica drained, not in excess"
        if d.replicas >= 1 and floor >= 1:
            assert ready_after or not ready_before, "R6: the last READY replica was taken away"
            assert not drained or any(r.live for r in after), "R6: the last live one drained"
    if any(isinstance(a, Start) for a in actions):
        holding = sum(not r.terminal for r in after)
        assert holding <= d.replicas + s.max_surge, f"R7: {holding} slots > D + max_surge"
    if not failing_rollout:
        again = w.plan()
        extra = [a for a in again if isinstance(a, (Drain, FailReplica, Stop))]
        if not w.observed.backoff.failures:  # with a backoff, each plan may probe with a start
            extra += [a for a in again if isinstance(a, Start)]
        assert not extra, f"R7: planning again at the same instant adds {extra}"
    return actions


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
    for mark in ("failed: no capacity", "failed: exited", "FailReplica(", "FailRollout("):
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
    failed = w.ended[-1]
    assert failed.status is RolloutStatus.FAILED
    assert failed.reason == "no capacity: 1 of 1 slots in use (after 3 failures)"
    plan_and_check(w)  # the rollback: nothing to do but complete
    assert w.ended[-1].kind == "rollback"
    assert w.ended[-1].status is RolloutStatus.COMPLETE
    assert w.observed.serving_revision == 1
    assert ready_of(w, 1) == 1
    assert not [r for r in w.observed.replicas if r.live and r.revision == 2]


def test_a_scale_up_that_cannot_be_placed_leaves_the_service_up_and_degraded():
    """scale-up-failure-terminates-service: one node, scale 1 -> 2."""
    w = World.create(RolloutStrategy(), replicas=1, capacity=1, serving=True)
    w.user_scale(2)
    assert plan_and_check(w)[0] == Start(1)
    w.spawn(w.pick([S.REQUESTED], 0).id, "ok")
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
        if not settle(w):
            w.user_apply(None)
            assert settle(w)
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
