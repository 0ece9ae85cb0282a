"""The autoscaler (``controller/planning/autoscaler.py``) on a fake clock: tables, then Hypothesis
properties over generated load histories. Nothing sleeps: ``now`` is a number."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.errors import SpecError
from controller.operations import validate_spec
from controller.planning.autoscaler import (
    Decision,
    Memory,
    Sample,
    changed,
    desired,
    load,
    queue,
    remember,
)
from controller.scaling import COLD_START_QUEUE_TIMEOUT, Autoscaling
from tests.support.clock import FakeClock


def scaling(**overrides: object) -> Autoscaling:
    base: dict[str, object] = {
        "min": 0,
        "max": 10,
        "metric": "concurrency",
        "target": 4.0,
        "window": 60.0,
        "scale_up_delay": 0.0,
        "scale_down_delay": 30.0,
    }
    return Autoscaling.model_validate(base | overrides)


@dataclass
class Run:
    """One service's autoscaler over time, as the planner and transitions drive it: each
    sample is remembered, then a decision taken and, if it changes the count, recorded."""

    spec: Autoscaling
    current: int
    clock: FakeClock = field(default_factory=lambda: FakeClock(0.0))
    samples: list[Sample] = field(default_factory=list)
    memory: Memory = field(default_factory=Memory)
    completed: int = 0
    changes: list[tuple[float, int, int, str]] = field(default_factory=list)
    """(time, from, to, reason)."""
    loads: list[tuple[float, float, int]] = field(default_factory=list)
    """(time, the sample's load, the count when it was taken)."""

    def second(self, level: int) -> Decision:
        """One second of ``level``: requests in flight (held, with no replica), or for rps
        completed that second."""
        self.clock.advance(1.0)
        now = self.clock()
        if self.spec.metric == "concurrency":
            held = level if self.current == 0 else 0
            sample = Sample(now, inflight=level - held, held=held)
        else:
            self.completed += level if self.current else 0
            held = level if self.current == 0 else 0
            sample = Sample(now, 0, held=held, completed=self.completed)
        self.loads.append((now, float(level), self.current))
        return self.take(sample)

    def queued(self, waiting: float, *, fresh: bool = True, requests: int = 1) -> Decision:
        """One second of ``metric: queue``: each replica reports ``waiting`` (``fresh``
        false: no replica's figures are fresh), and ``requests`` pass through the gateway
        (held, with no replica)."""
        self.clock.advance(1.0)
        self.completed += requests if self.current else 0
        held = requests if self.current == 0 else 0
        reported = self.current if fresh else 0
        sample = Sample(
            self.clock(),
            0,
            held=held,
            completed=self.completed,
            waiting=waiting * reported,
            reported=reported,
            unreported=self.current - reported,
        )
        self.loads.append((self.clock(), waiting, self.current))
        return self.take(sample)

    def take(self, sample: Sample) -> Decision:
        """``sample`` remembered, then a decision taken and, if it changes the count,
        recorded."""
        now = self.clock()
        self.samples.append(sample)
        self.samples = [s for s in self.samples if s.at > now - 200]
        self.memory = remember(self.memory, self.samples, self.current, self.spec)
        decision = desired(now, self.samples, self.current, self.spec, self.memory)
        if decision.count != self.current:
            self.memory = changed(self.memory, now, self.current, decision)
            self.changes.append((now, self.current, decision.count, decision.reason))
            self.current = decision.count
        return decision


# -- the spec -----------------------------------------------------------------------------

BASE = {"name": "web", "route": {"path_prefix": "/"}, "replica": {"commands": ["serve"]}}


@pytest.mark.parametrize(
    ("replicas", "lo", "hi"),
    [
        ("1..4", 1, 4),
        (" 0 .. 3 ", 0, 3),
        ({"min": 0, "max": 2}, 0, 2),
        ({"min": 2, "max": 2}, 2, 2),
    ],
)
def test_a_range_is_autoscaled_with_the_defaults(replicas, lo, hi):
    spec = validate_spec(BASE | {"replicas": replicas})
    assert spec.autoscaling == Autoscaling(
        min=lo,
        max=hi,
        metric="concurrency",
        target=10.0,
        window=60.0,
        scale_up_delay=6.0,
        scale_down_delay=60.0,
    )
    assert spec.desired_replicas == max(lo, 1)  # a new revision starts once before zero
    timeout = COLD_START_QUEUE_TIMEOUT if lo == 0 else 0.0
    assert spec.routing().queue_timeout == timeout


def test_a_plain_count_keeps_its_meaning_and_a_set_queue_timeout_is_kept():
    spec = validate_spec(BASE | {"replicas": 3})
    assert (spec.autoscaling, spec.desired_replicas) == (None, 3)
    spec = validate_spec(BASE | {"replicas": "0..2", "queue_timeout": "5s"})
    assert spec.routing().queue_timeout == 5.0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"replicas": "4..1"}, "replicas: min (4) is above max (1)"),
        ({"replicas": "0..0"}, "replicas: max: Input should be greater than or equal to 1"),
        ({"replicas": "1-4"}, "replicas: a count, {min, max} or 'min..max'"),
        ({"replicas": {"min": 1}}, "replicas: max: Field required"),
        ({"replicas": 2, "scaling": {"target": 4}}, "scaling: the replica count is fixed"),
        ({"scaling": {"target": 4}}, "scaling: the replica count is fixed"),
        ({"replicas": "0..2", "scaling": {"target": 0}}, "scaling.target"),
        ({"replicas": "0..2", "scaling": {"metric": "cpu"}}, "scaling.metric"),
        ({"replicas": "0..101"}, "replicas: max: Input should be less than or equal to 100"),
    ],
)
def test_a_bad_range_or_scaling_is_refused_with_the_field_and_reason(change, reason):
    with pytest.raises(SpecError, match=re.escape(reason)):
        validate_spec(BASE | change)


def test_a_static_service_is_not_autoscaled():
    static = BASE | {"backend": "static", "replica": {"addresses": ["127.0.0.1:1"]}}
    with pytest.raises(SpecError, match="static service's addresses are not autoscaled"):
        validate_spec(static | {"replicas": "0..1"})


# -- tables -------------------------------------------------------------------------------


def test_concurrency_above_target_scales_up_with_the_reason():
    run = Run(scaling(scale_up_delay=0.0), current=2)
    run.second(15)
    assert run.changes == [(1.0, 2, 4, "concurrency 7.5 per replica now > target 4: 2 -> 4")]


def test_a_held_request_with_no_replica_is_a_cold_start_at_once():
    run = Run(scaling(scale_up_delay=6.0, target=100.0), current=0)
    run.second(1)
    assert run.changes == [(1.0, 0, 1, "cold start: 1 request held, no replica: 0 -> 1")]
    assert run.memory.cold_start == 1.0


def test_idle_goes_to_min_after_scale_down_delay_and_not_before():
    run = Run(scaling(min=0, scale_down_delay=10.0), current=0)
    run.second(1)  # cold start: 0 -> 1 at t=1
    for _ in range(9):
        run.second(0)
    assert run.current == 1  # at t=10 the last change and the load (t=1) are 9 s old
    run.second(0)
    assert run.current == 0  # at t=11, 10 s
    assert run.changes[-1][3] == "idle for 10 s: 1 -> 0"


def test_no_scale_down_before_the_samples_reach_back_scale_down_delay():
    """A gateway that just started knows nothing of the last 30 s: it keeps the count."""
    spec = scaling(scale_down_delay=30.0)
    samples = [Sample(100.0 + i, 0) for i in range(5)]
    assert desired(104.0, samples, 3, spec, Memory()) == Decision(3)
    samples = [Sample(70.0 + i, 0) for i in range(35)]
    assert desired(104.0, samples, 3, spec, Memory()).count == 0


def test_scale_down_follows_the_window_mean_and_keeps_min():
    spec = scaling(min=1, target=4.0, window=10.0, scale_down_delay=5.0)
    samples = [Sample(float(t), 6) for t in range(1, 31)]
    decision = desired(30.0, samples, 5, spec, Memory())
    assert decision.count == 2
    assert decision.reason == "concurrency 1.2 per replica over 10 s < target 4: 5 -> 2"
    idle = [Sample(float(t), 0) for t in range(1, 31)]
    assert desired(30.0, idle, 5, spec, Memory()).count == 1  # min


def test_out_of_range_is_brought_back_at_once():
    spec = scaling(min=2, max=3)
    assert desired(0.0, [], 0, spec, Memory()) == Decision(2, "replicas 2..3: 0 -> 2")
    assert desired(0.0, [], 7, spec, Memory()) == Decision(3, "replicas 2..3: 7 -> 3")


def test_rps_reads_completions_per_second():
    spec = scaling(metric="rps", target=10.0, scale_up_delay=5.0)
    samples = [Sample(float(t), 0, completed=t * 35) for t in range(0, 11)]
    assert load(samples, 5.0, 10.0, "rps") == pytest.approx(35.0)
    decision = desired(10.0, samples, 1, spec, Memory())
    assert decision == Decision(4, "rps 35 per replica over 5 s > target 10: 1 -> 4")


def test_long_streams_are_load_for_concurrency_but_not_for_rps():
    """Two streams open all along, none completes: concurrency sees 2, rps sees nothing."""
    samples = [Sample(float(t), 2, completed=0) for t in range(0, 61)]
    assert load(samples, 60.0, 60.0, "concurrency") == 2.0
    assert load(samples, 60.0, 60.0, "rps") == 0.0


def test_a_spike_counts_for_its_share_of_scale_up_delay():
    """One second of 40 after quiet: over a 5 s scale_up_delay it is a mean of 8 (2
    replicas at target 4); with no delay, it is 40 (10 replicas)."""
    slow = Run(scaling(min=1, scale_up_delay=5.0, target=4.0), current=1)
    fast = Run(scaling(min=1, scale_up_delay=0.0, target=4.0), current=1)
    for run in (slow, fast):
        for _ in range(10):
            run.second(0)
        run.second(40)
    assert (slow.current, fast.current) == (2, 10)


def test_remember_marks_load_above_target_per_replica():
    spec = scaling(target=4.0)
    memory = remember(Memory(), [Sample(5.0, 9)], 2, spec)
    assert memory.last_above == 5.0
    assert remember(Memory(), [Sample(5.0, 8)], 2, spec).last_above is None


# -- properties -----------------------------------------------------------------------------

specs = st.builds(
    lambda lo, span, metric, target, window, up, down: scaling(
        min=lo,
        max=max(lo, 1) + span,
        metric=metric,
        target=target,
        window=window,
        scale_up_delay=up,
        scale_down_delay=down,
    ),
    st.integers(0, 2),
    st.integers(0, 4),
    st.sampled_from(["concurrency", "rps"]),
    st.sampled_from([1.0, 2.0, 4.0, 2.5]),
    st.sampled_from([5.0, 10.0, 30.0]),
    st.sampled_from([0.0, 2.0, 5.0]),
    st.sampled_from([0.0, 5.0, 20.0]),
)
segments = st.lists(st.tuples(st.integers(1, 25), st.integers(0, 24)), min_size=1, max_size=12)
"""A load history: (seconds, level) steps."""
PROPERTIES = settings(max_examples=300, deadline=None)


def play(spec: Autoscaling, start: int, history: list[tuple[int, int]]) -> Run:
    run = Run(spec, current=start)
    for seconds, level in history:
        for _ in range(seconds):
            run.second(level)
    return run


def wants(level: float, spec: Autoscaling) -> int:
    return spec.clamp(math.ceil(level / spec.target - 1e-9) if level else 0)


@PROPERTIES
@given(spec=specs, start=st.integers(0, 8), history=segments)
def test_never_outside_min_max(spec, start, history):
    run = play(spec, start, history)
    assert all(spec.min <= to <= spec.max for _, _, to, _ in run.changes)
    assert spec.min <= run.current <= spec.max


@PROPERTIES
@given(spec=specs, start=st.integers(0, 8), history=segments)
def test_no_scale_down_within_delay_of_a_change_or_of_load_above_target(spec, start, history):
    run = play(spec, start, history)
    delay = spec.scale_down_delay
    for at, before, to, reason in run.changes:
        if to >= before or reason.startswith("replicas "):
            continue
        earlier = [c for c in run.changes if c[0] < at]
        if earlier:
            assert at - earlier[-1][0] >= delay, f"down at {at} after a change at {earlier[-1]}"
        above = [
            t
            for t, level, count in run.loads
            if t <= at and level > spec.target * count + 1e-9 and (count or level)
        ]
        if above:
            assert at - above[-1] >= delay, f"down at {at}, load above target at {above[-1]}"


@PROPERTIES
@given(
    spec=specs,
    start=st.integers(0, 8),
    before=segments,
    level=st.integers(1, 40),
)
def test_a_spike_scales_up_within_scale_up_delay(spec, start, before, level):
    """Load held at ``level`` from some second on: by ``scale_up_delay`` seconds later (and
    the sample that shows it), the count is what that level wants."""
    run = play(spec, start, before)
    wanted = wants(level, spec)
    hold = math.ceil(spec.scale_up_delay) + 1
    for _ in range(hold):
        run.second(level)
    assert run.current >= wanted, f"{level} held {hold} s: {run.current} < {wanted}"


@PROPERTIES
@given(spec=specs, start=st.integers(0, 8), level=st.integers(0, 40), seconds=st.integers(1, 200))
def test_no_oscillation_under_constant_load(spec, start, level, seconds):
    """Under one level from the start, the count moves one way only, and once (a cold start
    and a range brought back aside) to where that level wants it."""
    run = play(spec, start, [(seconds, level)])
    moves = [to - before for _, before, to, reason in run.changes]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves), run.changes
    organic = [c for c in run.changes if not c[3].startswith(("replicas ", "cold start"))]
    assert len(organic) <= 1, organic


# -- metric: queue (the replicas' own waiting requests) -------------------------------------

LOAD_METRICS = {"load_metrics": {"format": "vllm"}}


def test_queue_needs_load_metrics_and_the_error_names_both_keys():
    data = BASE | {"replicas": "1..4", "scaling": {"metric": "queue", "target": 4}}
    with pytest.raises(SpecError, match=r"scaling\.metric: queue .* needs load_metrics"):
        validate_spec(data)
    spec = validate_spec(data | LOAD_METRICS)
    assert spec.autoscaling is not None
    assert (spec.autoscaling.metric, spec.autoscaling.target) == ("queue", 4.0)


def test_queue_above_target_scales_up_with_the_reason():
    run = Run(scaling(metric="queue", min=1, scale_up_delay=0.0), current=1)
    run.queued(3)
    assert run.changes == []  # 3 waiting on one replica, target 4
    run.queued(6)
    assert run.changes == [(2.0, 1, 2, "queue 6 per replica now > target 4: 1 -> 2")]


def test_the_queue_figure_counts_only_the_replicas_that_reported():
    """Two routable replicas, one reporting 10 waiting, one with no fresh figures: 10 per
    replica, which over the two is 20 waiting: 5 replicas at target 4."""
    samples = [Sample(1.0, 0, waiting=10.0, reported=1, unreported=1)]
    assert queue(samples, 0.0, 1.0) == (10.0, 20.0)
    assert load(samples, 0.0, 1.0, "queue") == 20.0
    spec = scaling(metric="queue", scale_up_delay=0.0)
    assert desired(1.0, samples, 2, spec, Memory()) == Decision(
        5, "queue 10 per replica now > target 4: 2 -> 5"
    )
    assert queue([Sample(1.0, 3, waiting=0.0, reported=0, unreported=2)], 0.0, 1.0) is None


def test_queue_over_scale_up_delay_is_the_mean_of_the_samples_with_figures():
    samples = [
        Sample(1.0, 0, waiting=2.0, reported=2),  # 1 per replica
        Sample(2.0, 0, reported=0, unreported=2),  # no figures: not counted
        Sample(3.0, 0, waiting=10.0, reported=2),  # 5 per replica
    ]
    assert queue(samples, 5.0, 3.0) == (3.0, 6.0)


def test_missing_figures_hold_the_count_and_the_reason_says_so():
    """Idle through the gateway, but the replicas' figures stopped (a replica hung, the
    scraper cut off): the count holds, never to zero; fresh figures of 0 then let it go."""
    run = Run(scaling(metric="queue", min=0, scale_down_delay=10.0), current=2)
    for _ in range(30):
        decision = run.queued(0, fresh=False, requests=0)
    assert run.changes == []
    assert decision == Decision(
        2, "queue: no fresh figures from the replicas (load_metrics): no scale-down, holding at 2"
    )
    for _ in range(9):
        run.queued(0, requests=0)
    assert run.changes == []  # a span with missing figures still lies within 10 s
    run.queued(0, requests=0)
    assert run.changes == [(40.0, 2, 0, "idle for 10 s: 2 -> 0")]


def test_one_replica_without_figures_holds_a_scale_down():
    spec = scaling(metric="queue", min=1, window=10.0, scale_down_delay=5.0)
    fresh = [Sample(float(t), 0, completed=t, reported=3) for t in range(1, 30)]
    assert desired(30.0, fresh, 3, spec, Memory()).count == 2
    partial = [*fresh, Sample(30.0, 0, completed=30, reported=2, unreported=1)]
    assert desired(30.0, partial, 3, spec, Memory()) == Decision(
        3, "queue: no fresh figures from 1 of 3 replicas: no scale-down, holding at 3"
    )


def test_an_empty_queue_scales_down_one_replica_at_a_time_and_not_to_zero_while_busy():
    """An empty queue may be a service at capacity: requests keep coming, so each step
    drops one replica after ``scale_down_delay``, and never the last."""
    run = Run(scaling(metric="queue", min=0, window=5.0, scale_down_delay=5.0), current=3)
    for _ in range(40):
        run.queued(0, requests=2)
    assert [(t, a, b) for t, a, b, _ in run.changes] == [(6.0, 3, 2), (11.0, 2, 1)]
    assert run.changes[0][3] == "queue 0 per replica over 5 s < target 4: 3 -> 2"
    assert run.current == 1


def test_a_queue_scaled_service_scales_from_zero_on_held_requests():
    """No replica, no figures: a request held is the demand, as for the other metrics."""
    run = Run(scaling(metric="queue", min=0, scale_up_delay=6.0), current=0)
    run.queued(0, fresh=False, requests=1)
    assert run.changes == [(1.0, 0, 1, "cold start: 1 request held, no replica: 0 -> 1")]


def test_remember_marks_a_queue_above_target_per_replica():
    spec = scaling(metric="queue", target=4.0)
    above = [Sample(5.0, 0, waiting=9.0, reported=2)]  # 4.5 per replica
    assert remember(Memory(), above, 2, spec).last_above == 5.0
    below = [Sample(5.0, 0, waiting=8.0, reported=2)]
    assert remember(Memory(), below, 2, spec).last_above is None
    unknown = [Sample(5.0, 0, reported=0, unreported=2)]
    assert remember(Memory(), unknown, 2, spec).last_above is None


queue_specs = specs.map(lambda spec: spec.model_copy(update={"metric": "queue"}))
queue_seconds = st.lists(
    st.tuples(
        st.integers(1, 15),
        st.sampled_from([0.0, 1.0, 3.0, 6.0, 12.0]),
        st.booleans(),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)
"""(seconds, waiting per replica, figures fresh, requests through the gateway) steps."""


@PROPERTIES
@given(spec=queue_specs, start=st.integers(0, 8), history=queue_seconds)
def test_queue_never_scales_down_on_missing_figures_nor_to_zero_while_busy(spec, start, history):
    run = Run(spec, current=start)
    seen: list[tuple[float, bool, bool]] = []
    for seconds, waiting, fresh, requests in history:
        for _ in range(seconds):
            run.queued(waiting, fresh=fresh, requests=int(requests))
            seen.append((run.clock(), fresh, requests))
    assert spec.min <= run.current <= spec.max
    for at, before, to, reason in run.changes:
        if to >= before or reason.startswith("replicas "):
            continue
        span = [(fresh, busy) for t, fresh, busy in seen if at - spec.scale_down_delay < t <= at]
        assert all(fresh for fresh, _ in span), (at, reason, span)
        if to == 0:
            assert not any(busy for _, busy in span), (at, reason, span)
