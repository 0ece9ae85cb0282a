"""The planner with the autoscaler in it (rule 11), run through the simulator: the real rules,
the real transitions, generated load histories on a fake clock and a fake backend.

Properties: every plan keeps the rules (``plan_and_check``, the autoscaler's count being the
desired one); the count stays within min..max; a scale-up that cannot be placed never
triggers a scale-down of anything and leaves the service degraded (the first background
report); a scale-down drains the replicas with the fewest requests in flight, newest first.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.planning.actions import Drain, Rescale, SetDegraded
from controller.planning.autoscaler import Sample
from controller.planning.model import ReplicaState
from controller.planning.transitions import Sampled, observe
from controller.scaling import Autoscaling
from controller.spec import RolloutStrategy

from .simulation import World
from .test_planner_properties import happen, plan_and_check, settle

S = ReplicaState
SETTINGS = settings(max_examples=150, deadline=None, print_blob=True)


def scaling(lo: int, hi: int, **overrides: Any) -> Autoscaling:
    base: dict[str, Any] = {
        "min": lo,
        "max": hi,
        "metric": "concurrency",
        "target": 2.0,
        "window": 10.0,
        "scale_up_delay": 0.0,
        "scale_down_delay": 5.0,
    }
    return Autoscaling.model_validate(base | overrides)


index = st.integers(0, 7)
step = st.one_of(
    st.tuples(st.just("spawn"), index, st.sampled_from(["ok", "ok", "no capacity"])),
    st.tuples(st.just("probe"), index, st.sampled_from([True, True, False])),
    st.tuples(st.just("crash"), index),
    st.tuples(st.just("drained"), index),
    st.tuples(st.just("stopped"), index),
    st.tuples(st.just("tick"), st.integers(0, 8)),
    st.tuples(st.just("load"), st.integers(0, 12)),
    st.tuples(st.just("capacity"), st.integers(1, 6)),
    st.tuples(st.just("apply"), st.sampled_from([None, None, "crash"])),
)


@SETTINGS
@given(
    lo=st.integers(0, 2),
    span=st.integers(0, 3),
    capacity=st.integers(1, 6),
    steps=st.lists(step, min_size=5, max_size=80),
)
def test_autoscaled_histories_keep_the_rules(lo, span, capacity, steps):
    spec = scaling(lo, max(lo, 1) + span)
    w = World.create(RolloutStrategy(), spec.clamp(1), capacity, serving=True, scaling=spec)
    level = 0
    try:
        plan_and_check(w)
        for s in steps:
            if s[0] == "load":
                level = s[1]
                w.sample(level)
                plan_and_check(w)
            else:
                before = happen(w, s)
                if s[0] == "tick":
                    w.sample(level)
                plan_and_check(w, before)
            assert spec.min <= w.desired.replicas <= spec.max, w.desired
        settle(w)  # converges at whatever count the last samples wanted
    except AssertionError as e:
        raise AssertionError(f"{e}\n{w.describe()}") from e


@SETTINGS
@given(
    capacity=st.integers(1, 3),
    level=st.integers(5, 20),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("spawn"), index, st.just("ok")),
            st.tuples(st.just("probe"), index, st.just(True)),
            st.tuples(st.just("tick"), st.integers(1, 30)),
        ),
        max_size=60,
    ),
)
def test_a_scale_up_that_cannot_be_placed_drains_nothing_and_is_degraded(capacity, level, steps):
    """Load above what the fleet can place: the autoscaler wants more than fits; the starts
    fail for no capacity and are retried; nothing READY is ever drained, the count never
    goes down, and the service reads degraded (with the reason) once a start failed."""
    spec = scaling(1, 8)
    w = World.create(RolloutStrategy(), 1, capacity, serving=True, scaling=spec)
    highest = w.desired.replicas
    try:
        for s in steps:
            w.now += 1
            w.sample(level)
            plan_and_check(w, happen(w, s))
            drained = [a for a in w.log if "Drain(" in a]
            assert not drained, drained
            assert w.desired.replicas >= highest, "the count went down under the same load"
            highest = w.desired.replicas
            ready = sum(r.state is S.READY for r in w.observed.replicas)
            if ready < w.desired.replicas and w.observed.backoff.failures:
                pending = [a for a in w.plan() if isinstance(a, SetDegraded) and a.reason]
                assert w.observed.degraded or pending, "fewer ready than desired, not degraded"
        assert w.desired.replicas == min(spec.max, -(-level // 2)) or not steps
    except AssertionError as e:
        raise AssertionError(f"{e}\n{w.describe()}") from e


def test_scale_down_drains_the_fewest_in_flight_newest_first():
    spec = scaling(1, 4, scale_down_delay=2.0, window=2.0)
    w = World.create(RolloutStrategy(), 4, 8, serving=True, scaling=spec)
    # r1..r4, created in that order; in flight: r1 3, r2 0, r3 1, r4 0.
    replicas = tuple(r.replace(created=float(i)) for i, r in enumerate(w.observed.replicas))
    w.observed = w.observed.replace(replicas=replicas)
    ids = [r.id for r in w.observed.replicas]
    per = {"r1": 3, "r2": 0, "r3": 1, "r4": 0}
    total = sum(per.values())
    for _ in range(4):
        w.now += 1
        sample = Sample(w.now, total, 0, 0, 0, 4, tuple(per.items()))
        step = observe(w.desired, w.observed, Sampled(sample), w.now)
        w.desired, w.observed = step.desired, step.observed
    actions = w.plan()
    assert Rescale(2, "concurrency 1 per replica over 2 s < target 2: 4 -> 2") in actions
    drained = [a.replica_id for a in actions if isinstance(a, Drain)]
    assert ids == ["r1", "r2", "r3", "r4"]
    assert drained == ["r4", "r2"], drained  # none in flight, the newest first
