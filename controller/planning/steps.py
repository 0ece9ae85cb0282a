"""Staged rollouts: canary steps and the blue/green switch. PURE; the planner calls it.

Rules (the planner's rule 12), with D the desired count and T the target revision:

a. A canary step of weight w wants ``ceil(D * w / 100)`` replicas of T (at least one),
   started beside the old ones: nothing of the serving revision is drained before T holds
   100 (a superseded canary's replicas go once the serving revision is at strength).
   Once they are available the step holds T at w percent of the traffic (``SetWeight``),
   whatever the replica counts: its pause and its analysis window begin.
b. A step holds for its ``pause``; with ``analysis`` it is judged every ``interval`` and at
   the end of its pause. A failed check fails the rollout at once (it rolls back by rule 3,
   the weight back to 0); not enough data is never a pass: the step holds, and fails after
   ``progress_deadline`` past its pause. A step with no pause holds until promoted.
c. The last step (100) wants D replicas of T, and moves the weight to 100 only once they
   are all available; the old replicas are drained after that.
d. Blue/green wants D replicas of T at once, at weight 0 (preview traffic only). Promotion
   (asked, or the first passing analysis) switches all traffic at once; the old replicas are
   kept ``keep_previous`` after the switch, so that an undo is instant, then drained.
e. ``rollout promote`` skips the remaining steps (to the last one); on a rolling update it
   starts every remaining replica at once instead of ``max_surge`` at a time.
f. While a staged rollout waits for its replicas the ``progress_deadline`` runs from its
   step's beginning; while a step holds, only the analysis can fail it. A rollback and an
   undo are rolling, and so is a service's first rollout; with a staged strategy and the
   revision they return to at full strength they take all the traffic at once.
"""

from __future__ import annotations

import math

from ..spec import RolloutStrategy
from . import analysis
from .actions import Action, Judge, NextStep, SetWeight
from .model import Desired, Observed, Rollout, RolloutStatus

PAUSED_BY_REQUEST = "paused by request"


def step_weights(rollout: Rollout, strategy: RolloutStrategy) -> tuple[int, ...]:
    """Each step's weight: the canary's steps, or blue/green's 0 then 100."""
    if rollout.strategy == "blue_green":
        return (0, 100)
    return tuple(step.weight for step in strategy.canary_steps)


def wanted(rollout: Rollout, strategy: RolloutStrategy, replicas: int) -> int:
    """Replicas of the target the rollout wants now (rules a, c, d)."""
    if rollout.strategy != "canary":
        return replicas
    weights = step_weights(rollout, strategy)
    weight = weights[min(rollout.step, len(weights) - 1)]
    if weight >= 100 or replicas <= 0:
        return replicas
    return max(1, math.ceil(replicas * weight / 100))


def full(rollout: Rollout, strategy: RolloutStrategy, now: float, wake: list[float]) -> bool:
    """Whether the target holds all the traffic and the old replicas may go (rules c, d)."""
    if rollout.weight < 100 or rollout.holding_since is None:
        return False
    if rollout.strategy == "blue_green":
        until = rollout.holding_since + strategy.keep_previous
        if now < until:
            wake.append(until)
            return False
    return True


def deadline(rollout: Rollout, strategy: RolloutStrategy) -> float | None:
    """When the rollout fails for not progressing (rule f); None: not now."""
    if not rollout.staged:
        return rollout.started + strategy.progress_deadline
    if rollout.holding_since is None:
        since = rollout.started if rollout.step_since is None else rollout.step_since
        return since + strategy.progress_deadline
    return None


def split(rollout: Rollout | None, desired: Desired, observed: Observed) -> tuple[int, int] | None:
    """The traffic split the pool should hold (rules a, b, d, f)."""
    if rollout is None:
        return None
    to = rollout.to_revision
    if rollout.staged:
        if rollout.status is RolloutStatus.PAUSED and rollout.reason != PAUSED_BY_REQUEST:
            return (to, 0)  # failed and held: the weight back to 0
        return (to, rollout.weight)
    if rollout.kind != "rollout" and desired.strategy.strategy != "rolling":
        live = sum(1 for r in observed.replicas if r.live and r.revision == to)
        if live >= desired.replicas:
            return (to, 100)
    return None


def progress(
    observed: Observed,
    desired: Desired,
    rollout: Rollout,
    now: float,
    available: int,
    wake: list[float],
) -> tuple[list[Action], str | None]:
    """The staged rollout's next move (rules a to d), and the reason it fails, if it does.
    ``available``: the target's available replicas."""
    s = desired.strategy
    weights = step_weights(rollout, s)
    last = len(weights) - 1
    step = min(rollout.step, last)
    weight = weights[step]
    rid = rollout.id
    if rollout.holding_since is None:  # rules a, c, d: the step's replicas first
        if available >= wanted(rollout, s, desired.replicas) and desired.replicas > 0:
            return [SetWeight(rid, step, len(weights), weight)], None
        return [], None
    if weight >= 100:
        return [], None
    if rollout.promoted:
        if rollout.strategy == "blue_green":
            return [SetWeight(rid, last, len(weights), 100)], None
        return [NextStep(rid, last)], None
    held = rollout.holding_since
    pause = None if rollout.strategy == "blue_green" else s.canary_steps[step].pause
    ends = None if pause is None else held + pause
    actions: list[Action] = []
    config = s.analysis
    outcome: analysis.Outcome | None = None
    if config is not None:
        due = now >= rollout.judged_at + config.interval
        if due or (ends is not None and now >= ends > rollout.judged_at):
            verdict = analysis.judge(
                config,
                rollout.baseline,
                observed.traffic,
                rollout.to_revision,
                rollout.from_revision,
                rollout.weight,
            )
            actions.append(Judge(rid, verdict.outcome, verdict.reason))
            if verdict.outcome == "fail":
                return actions, verdict.reason
            outcome = verdict.outcome
            wake.append(now + config.interval)
        else:
            wake.append(rollout.judged_at + config.interval)
            if ends is not None and rollout.judged_at >= ends:
                outcome = rollout.verdict
    if rollout.strategy == "blue_green":
        if outcome == "pass":  # rule d: promoted by the analysis
            actions.append(SetWeight(rid, last, len(weights), 100))
        return actions, None
    if ends is None:
        return actions, None  # rule b: held until promoted
    if now < ends:
        wake.append(ends)
        return actions, None
    if config is None or outcome == "pass":
        actions.append(NextStep(rid, step + 1))
        return actions, None
    if now >= ends + s.progress_deadline:
        why = rollout.analysis or "analysis: no verdict"
        return actions, f"{why}, {_fmt(s.progress_deadline)} after the pause"
    return actions, None


def _fmt(seconds: float) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
