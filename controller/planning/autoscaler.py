"""The autoscaler: ``desired(now, samples, current, spec, memory) -> Decision``. PURE.

It reads a service's traffic as the gateway saw it (``Sample``: in flight, held, completed,
taken every second or so by the reconciler; in a cluster, over every live node), or for
``metric: queue`` the requests its replicas themselves report waiting, and says how
many replicas the service wants. No I/O, no clock: ``now`` and the samples are given, and
what it must remember between two decisions (``Memory``: the last change, the last load above
target) is plain data kept in the service's observed state, updated by ``remember`` as
samples come in.

Rules:

1. The count stays within ``min..max`` (one out of range is brought back at once).
2. Up: the mean load over the last ``scale_up_delay`` (the latest sample alone at 0) wants
   ``ceil(load / target)`` replicas; more than the count scales up at once. Requests held
   with no replica at all want one (a cold start), whatever the metric.
3. Down: only when neither the last change nor load above target (more than ``target`` per
   replica in one sample) lies within ``scale_down_delay``, and the samples reach back that
   far; then to ``ceil(mean over window / target)`` (never below what rule 2 wants), or to
   ``min`` when no request at all was seen for ``scale_down_delay`` (idle: a ``min: 0``
   service goes to zero).
4. The count the autoscaler chose is the desired count whether or not it could be placed:
   replicas that do not start never read as less load, so they never cause a scale-down.
5. ``queue``: the figure is the fresh ``waiting`` reported, summed and divided by the
   replicas that reported; times the routable replicas it is the load of rule 2. Figures
   missing (a replica not reporting, or reporting too long ago) within ``scale_down_delay``:
   no scale-down and no idle, and the decision's reason says so. A queue says what waits,
   not what capacity is spare (an empty queue may be a busy service), so a scale-down goes
   one replica at a time and below one replica only when idle. A service with no replica
   has no figures: held requests scale it from zero (rule 2).

Under constant load both means are the same number, so the count moves once and stays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..scaling import Autoscaling

__all__ = [
    "Decision",
    "Memory",
    "Sample",
    "changed",
    "desired",
    "horizon",
    "load",
    "queue",
    "remember",
]

EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Sample:
    """A service's traffic at one moment, over every process that serves it."""

    at: float
    inflight: int
    """Requests in flight on its upstreams (streams and WebSockets included)."""
    held: int = 0
    """Requests waiting for a routable upstream."""
    completed: int = 0
    """Requests its upstreams completed: a running total (``rps`` is its rate)."""
    waited: int = 0
    """Requests that found no routable upstream (held or refused): a running total."""
    ready: int = 0
    per_replica: tuple[tuple[str, int], ...] = ()
    """In flight per upstream (replica id, count): what a scale-down disturbs least."""
    waiting: float = 0.0
    """Requests the routable replicas themselves reported waiting (``load_metrics``), summed
    over those whose figures are fresh."""
    reported: int = 0
    """Routable replicas whose fresh figures ``waiting`` sums."""
    unreported: int = 0
    """Routable replicas with no fresh figures (none yet, too old, unreadable)."""

    def plus(self, other: Sample) -> Sample:
        """This sample with ``other``'s traffic added (the other nodes' of a cluster): its
        time, ready count and the replicas' own figures kept (the same replicas' figures, as
        this node read them)."""
        per_replica = dict(self.per_replica)
        for rid, count in other.per_replica:
            per_replica[rid] = per_replica.get(rid, 0) + count
        return replace(
            self,
            inflight=self.inflight + other.inflight,
            held=self.held + other.held,
            completed=self.completed + other.completed,
            waited=self.waited + other.waited,
            per_replica=tuple(sorted(per_replica.items())),
        )

    def inflight_of(self, replica_id: str) -> int:
        for rid, count in self.per_replica:
            if rid == replica_id:
                return count
        return 0


@dataclass(frozen=True, slots=True)
class Memory:
    """What the autoscaler remembers of a service between decisions."""

    last_change: float | None = None
    """When it last changed the count."""
    last_above: float | None = None
    """When a sample last showed more than ``target`` per replica."""
    decision: str = ""
    """Its last change and why (for status)."""
    decided_at: float | None = None
    cold_start: float | None = None
    """When a scale up from zero began, until a replica is ready (its duration)."""
    cold_starts: int = 0
    """Scales up from zero that reached a ready replica."""
    last_cold_start: float | None = None
    """How long the last one took, from the decision to the replica ready (seconds)."""


@dataclass(frozen=True, slots=True)
class Decision:
    count: int
    reason: str = ""


def horizon(spec: Autoscaling) -> float:
    """How far back samples are kept: the longest span a rule reads, and one more second
    for the baseline of a rate."""
    return max(spec.window, spec.scale_up_delay, spec.scale_down_delay) + 2.0


def queue(samples: Sequence[Sample], span: float, now: float) -> tuple[float, float] | None:
    """``metric: queue`` over the last ``span`` seconds (the latest sample at 0): the mean of
    the requests waiting per replica, and of that times the routable replicas (the load);
    None when no sample of the span has fresh figures (rule 5)."""
    if not samples:
        return None
    recent = [s for s in samples if s.at > now - span] or [samples[-1]]
    figured = [s for s in recent if s.reported]
    if not figured:
        return None
    per = [s.waiting / s.reported for s in figured]
    total = [p * (s.reported + s.unreported) for p, s in zip(per, figured, strict=True)]
    return sum(per) / len(per), sum(total) / len(total)


def load(samples: Sequence[Sample], span: float, now: float, metric: str) -> float:
    """The service's mean load over the last ``span`` seconds (the latest sample at 0)."""
    if not samples:
        return 0.0
    if metric == "queue":
        figures = queue(samples, span, now)
        return figures[1] if figures else 0.0
    recent = [s for s in samples if s.at > now - span] or [samples[-1]]
    if metric == "concurrency":
        return sum(s.inflight + s.held for s in recent) / len(recent)
    if span <= 0:
        return _point(samples, metric)
    # rps: completions over the span, from the last sample before it (or its first), and
    # the requests held now (each one a request to serve).
    older = [s for s in samples if s.at <= now - span]
    base = older[-1] if older else recent[0]
    last = recent[-1]
    elapsed = last.at - base.at
    rate = (last.completed - base.completed) / elapsed if elapsed > 0 else 0.0
    return max(rate, 0.0) + last.held


def _point(samples: Sequence[Sample], metric: str) -> float:
    """The latest sample's load alone."""
    if not samples:
        return 0.0
    last = samples[-1]
    if metric == "concurrency":
        return float(last.inflight + last.held)
    if len(samples) < 2:
        return 0.0
    prev = samples[-2]
    elapsed = last.at - prev.at
    rate = (last.completed - prev.completed) / elapsed if elapsed > 0 else 0.0
    return max(rate, 0.0) + last.held


def _demand(samples: Sequence[Sample], i: int) -> bool:
    """Whether sample ``i`` saw any request: in flight, held, completed or refused."""
    i %= len(samples)
    s = samples[i]
    if s.inflight or s.held:
        return True
    if i == 0:
        return False
    prev = samples[i - 1]
    return s.completed > prev.completed or s.waited > prev.waited


def _wants(value: float, target: float) -> int:
    return math.ceil(value / target - EPSILON) if value > EPSILON else 0


def remember(memory: Memory, samples: Sequence[Sample], current: int, spec: Autoscaling) -> Memory:
    """``memory`` once the latest of ``samples`` is taken in, at ``current`` replicas."""
    if not samples:
        return memory
    if not current:
        above = _demand(samples, -1)
    elif spec.metric == "queue":
        last = samples[-1]
        above = last.reported > 0 and last.waiting / last.reported > spec.target + EPSILON
    else:
        above = _point(samples, spec.metric) > spec.target * current + EPSILON
    if above:
        return replace(memory, last_above=samples[-1].at)
    return memory


def changed(memory: Memory, now: float, current: int, decision: Decision) -> Memory:
    """``memory`` once ``decision`` moved the count from ``current``."""
    cold = memory.cold_start
    if decision.count == 0:
        cold = None
    elif current == 0:
        cold = now
    return replace(
        memory,
        last_change=now,
        decision=decision.reason,
        decided_at=now,
        cold_start=cold,
    )


def _span(seconds: float) -> str:
    return f"over {seconds:g} s" if seconds > 0 else "now"


def _missing(samples: Sequence[Sample], now: float, delay: float) -> str:
    """Why the figures of ``metric: queue`` within ``delay`` do not allow a scale-down (rule 5),
    or "" if they do: every sample with every routable replica's fresh figures."""
    for s in reversed([s for s in samples if s.at > now - delay] or samples[-1:]):
        if not s.reported:
            return "queue: no fresh figures from the replicas (load_metrics)"
        if s.unreported:
            replicas = s.reported + s.unreported
            return f"queue: no fresh figures from {s.unreported} of {replicas} replicas"
    return ""


def desired(
    now: float, samples: Sequence[Sample], current: int, spec: Autoscaling, memory: Memory
) -> Decision:
    """How many replicas the service wants now, and why (``reason`` empty: no change)."""
    bounded = spec.clamp(current)
    if bounded != current:  # rule 1
        why = f"replicas {spec.min}..{spec.max}: {current} -> {bounded}"
        return Decision(bounded, why)
    if not samples:
        return Decision(current)
    unit, target = spec.metric, spec.target

    up = load(samples, spec.scale_up_delay, now, spec.metric)  # rule 2
    wants = _wants(up, target)
    figures = queue(samples, spec.scale_up_delay, now) if unit == "queue" else None
    last = samples[-1]
    waiting = last.held > 0 or (len(samples) > 1 and last.waited > samples[-2].waited)
    if current == 0 and waiting and wants < 1:
        wants = 1
    if wants > current:
        count = min(wants, spec.max)
        if count > current:
            if current == 0:
                held = "1 request" if last.held == 1 else f"{last.held} requests"
                why = f"cold start: {held} held, no replica: 0 -> {count}"
            else:
                per = figures[0] if figures else up / current
                why = (
                    f"{unit} {per:.3g} per replica {_span(spec.scale_up_delay)} > target "
                    f"{target:g}: {current} -> {count}"
                )
            return Decision(count, why)

    # Rule 3: down only with evidence that reaches back ``scale_down_delay``.
    delay = spec.scale_down_delay
    if unit == "queue" and current:  # rule 5
        missing = _missing(samples, now, delay)
        if missing:
            return Decision(current, f"{missing}: no scale-down, holding at {current}")
    if current <= spec.min or len(samples) < 2 or samples[0].at > now - delay:
        return Decision(current)
    if memory.last_change is not None and now - memory.last_change < delay:
        return Decision(current)
    if memory.last_above is not None and now - memory.last_above < delay:
        return Decision(current)
    start = next((i for i, s in enumerate(samples) if s.at > now - delay), len(samples) - 1)
    idle = start > 0 and not any(_demand(samples, i) for i in range(start, len(samples)))
    if unit == "queue":
        idle = idle and not any(s.waiting for s in samples[start:])
    if idle:
        count = spec.min
        why = f"idle for {delay:g} s: {current} -> {count}"
    elif unit == "queue":  # rule 5: one at a time, one replica at least
        figures = queue(samples, spec.window, now)
        per, mean = figures if figures else (0.0, 0.0)
        count = max(_wants(mean, target), wants, spec.min, current - 1, 1)
        why = (
            f"queue {per:.3g} per replica {_span(spec.window)} < target {target:g}: "
            f"{current} -> {count}"
        )
    else:
        mean = load(samples, spec.window, now, spec.metric)
        count = max(_wants(mean, target), wants, spec.min)
        per = mean / current
        why = (
            f"{unit} {per:.3g} per replica {_span(spec.window)} < target {target:g}: "
            f"{current} -> {count}"
        )
    if count < current:
        return Decision(count, why)
    return Decision(current)
