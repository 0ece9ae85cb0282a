"""The planner: ``plan(observed, desired, now) -> actions``. PURE; the rules live here only.

Rules (docs/architecture.md), with D = desired replicas and T = the target revision:

1. Ready replicas never drop below ``D - max_unavailable`` because of a drain the planner
   asks for: a ready replica is drained only while the count of available replicas (old ones
   that are ready, target ones ready for ``min_ready``) stays at or above that floor after it.
2. An old replica (any revision but T) is drained only while ``old live + available target``
   stays at or above ``D - max_unavailable`` after it; with the default ``max_unavailable: 0``
   that means only once a target replica is available to take its place. A drained replica is
   stopped only after its drain finished or timed out.
3. A target replica that fails is replaced with backoff; the reconciler counts the failures
   of the active rollout, and when they exceed ``retries`` or ``progress_deadline`` passes,
   the rollout fails: with ``on_failure: pause`` it is paused (nothing more is started,
   drained or given up, so the old revision keeps its strength, and the target's replicas
   are kept for inspection, the one whose give-up failed it too: ``KeepFailed``); otherwise
   it ends failed and a rollback to the revision it started from begins (rule 7). A failed
   rollback, or a failed first rollout, ends with nothing to go back to: the target stays,
   retried, degraded. Only target-revision replicas are ever failed by a rollout. A
   replica whose time ran out while its rollout was paused, or that was kept, is given up
   without counting again: resumed, the rollout has its retries afresh (rule 8).
4. A start that cannot be placed touches no running replica: the service is reported
   degraded with the reason and placement is retried after the backoff.
5. Replicas of every revision but T are old, so a superseding apply just changes T: nothing of
   the serving revision is drained before a replica of the new target is available (rule 2).
6. Nothing is drained for lack of anything; only a scale-down, a rollout step or a delete
   drains, and only a delete, or the autoscaler of a ``min: 0`` service gone idle, drains the
   last replicas.
7. A rollout begins when the desired revision differs from the one the service moves to: the
   active rollout, if any, ends superseded (aborted, when the user aborted it), and the
   replicas of the new target that are still draining, up to D, serve again instead of
   being stopped while fresh ones start.
8. A rollout is paused and resumed as the user asks; a resumed rollout has its retries and
   its deadline afresh.
9. Replicas at static addresses (something else runs them) are never given up: an address
   that is down is an unhealthy upstream, probed for ever. A static service's first rollout
   completes once each of its replicas holds an address; a later one waits for readiness.
10. The target at full strength with no rollout in progress serves, and is what a later
    failed rollout returns to, though no rollout to it completed (a first rollout that
    failed and came up on a retry; a rollback that failed, then came up).
11. An autoscaled service's desired count is the autoscaler's (``controller.planning.autoscaler``),
    decided first from the traffic samples and applied as a ``Rescale``; the rest of the plan
    works to that count. A scale-down drains the replicas that disturb least: not ready
    first, then the fewest requests in flight, newest first.
12. A canary or blue/green rollout moves by steps and traffic weights
    (``controller.planning.steps``, its rules a to f), judged by the analysis of the gateway's
    own counts (``controller.planning.analysis``); the pool's split follows the rollout's
    weight. A failed analysis fails the rollout as rule 3 does, the weight back to 0 at once.

Starts are bounded by ``D + max_surge`` over live and leaving replicas together (a replica
that is draining still holds a backend slot; counting it keeps a full fleet from failing the
rollout's starts for no capacity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..spec import RolloutStrategy
from . import autoscaler, steps
from .actions import (
    AbandonRollout,
    Action,
    BeginRollout,
    CompleteRollout,
    Drain,
    FailReplica,
    FailRollout,
    Forget,
    KeepFailed,
    MarkServing,
    PauseRollout,
    Promote,
    Rescale,
    ResumeRollout,
    SetDegraded,
    SetSplit,
    Start,
    Stop,
    Undrain,
    WakeAt,
)
from .model import (
    Backoff,
    Desired,
    Observed,
    Replica,
    ReplicaState,
    Rollout,
    RolloutKind,
    RolloutStatus,
)

__all__ = ["Desired", "backoff_delay", "fmt_seconds", "plan", "retry_at"]

PAUSED_BY_REQUEST = steps.PAUSED_BY_REQUEST


def backoff_delay(failures: int, strategy: RolloutStrategy) -> float:
    """Seconds to wait after ``failures`` consecutive failures (1 -> retry_backoff, doubling)."""
    if failures <= 0:
        return 0.0
    return float(
        min(strategy.retry_backoff * 2 ** min(failures - 1, 30), strategy.max_retry_backoff)
    )


def retry_at(backoff: Backoff, strategy: RolloutStrategy) -> float | None:
    """When the next start of the target revision may be tried after ``backoff``'s failures
    (monotonic seconds); None when nothing failed."""
    if not backoff.failures:
        return None
    return backoff.last_failure_at + backoff_delay(backoff.failures, strategy)


def fmt_seconds(seconds: float) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def plan(observed: Observed, desired: Desired, now: float) -> list[Action]:
    """The actions that move ``observed`` toward ``desired`` at time ``now``."""
    s = desired.strategy
    actions: list[Action] = []
    wake: list[float] = []

    for r in observed.replicas:
        if r.state is ReplicaState.DRAINING and r.drained:
            actions.append(Stop(r.id))

    live = [r for r in observed.replicas if r.live]
    if desired.deleting:
        actions.extend(Drain(r.id, "service deleted") for r in live)
        if all(r.terminal for r in observed.replicas):
            actions.append(Forget())
        return actions

    if desired.scaling is not None:  # rule 11
        decision = autoscaler.desired(
            now, observed.samples, desired.replicas, desired.scaling, observed.scaler
        )
        if decision.count != desired.replicas:
            actions.append(Rescale(decision.count, decision.reason))
            desired = desired.replace(replicas=decision.count)

    rollout = observed.rollout if observed.rollout and observed.rollout.active else None
    if desired.revision != observed.target:  # rule 7
        actions.extend(_retarget(observed, desired, rollout))
        actions.append(WakeAt(now))
        return actions
    if rollout is not None and desired.promote:  # rule 12e
        actions.append(Promote(rollout.id))
        rollout = rollout.replace(promoted=True)
    if rollout is not None:  # rule 8
        if rollout.status is RolloutStatus.PROGRESSING and desired.paused:
            actions.append(PauseRollout(rollout.id, PAUSED_BY_REQUEST))
        elif rollout.status is RolloutStatus.PAUSED and not desired.paused:
            actions.extend([ResumeRollout(rollout.id), WakeAt(now)])
            return actions
    paused = desired.paused or (rollout is not None and rollout.status is RolloutStatus.PAUSED)

    # A replica that does not become ready in time, or stays unhealthy as long, is given up.
    giving_up: list[Replica] = []
    if not paused:
        for r in live:
            deadline = None if desired.static else _give_up_at(r, s)  # rule 9
            if deadline is None:
                continue
            if now >= deadline:
                giving_up.append(r)
                if r.revision == desired.revision and rollout is not None:
                    wake.append(now)  # the failure counts against the rollout: judge it now
            else:
                wake.append(deadline)
    counts = {r.id: _counts(r, rollout, s) for r in giving_up}
    counted = [r for r in giving_up if r.revision == desired.revision and counts[r.id]]

    if rollout is not None and not paused and _pauses_on_failure(rollout, s):  # rule 3
        failed = _failure(observed, rollout, s, now, counted)
        if failed is not None:
            # Nothing is given up: the replicas that failed it are kept for inspection.
            actions.extend(KeepFailed(r.id, _give_up_reason(r, s)) for r in counted)
            actions.extend(_fail(observed, desired, rollout, failed))
            actions.append(WakeAt(now))
            return actions

    actions.extend(FailReplica(r.id, _give_up_reason(r, s), counts[r.id]) for r in giving_up)
    failing = {r.id for r in giving_up}
    live = [r for r in live if r.id not in failing]
    # A replica given up above is drained next, so it holds its backend slot until stopped:
    # count it as leaving, or the replacement started in this same plan would exceed
    # D + max_surge and, on a full fleet, fail for no capacity (a second, spurious failure).
    leaving = [r for r in observed.replicas if r.leaving or r.id in failing]

    target = desired.revision
    new = [r for r in live if r.revision == target]
    old = [r for r in live if r.revision != target]

    if rollout is not None and not paused:  # rule 3
        failed = _failure(observed, rollout, s, now)
        if failed is not None:
            actions.extend(_fail(observed, desired, rollout, failed))
            actions.append(WakeAt(now))
            return actions
        deadline = steps.deadline(rollout, s)
        if deadline is not None:
            wake.append(deadline)

    available_new = [r for r in new if r.available(now, s.min_ready)]
    for r in new:
        if r.state is ReplicaState.READY and r.ready_since is not None and r not in available_new:
            wake.append(r.ready_since + s.min_ready)

    staged = rollout is not None and rollout.staged
    full = True
    if rollout is not None and staged and not paused:  # rule 12
        moves, failed = steps.progress(observed, desired, rollout, now, len(available_new), wake)
        actions.extend(moves)
        if failed is not None:
            actions.extend(_fail(observed, desired, rollout, failed))
            actions.append(WakeAt(now))
            return actions
        if moves:
            wake.append(now)  # the step moved: plan again with it
    if rollout is not None and staged:
        full = steps.full(rollout, s, now, wake)

    if not paused:
        pending = sum(1 for r in new if r.state is ReplicaState.REQUESTED)
        want, limit = desired.replicas, desired.replicas + s.max_surge
        if rollout is not None and staged:
            want = steps.wanted(rollout, s, desired.replicas)
            limit = desired.replicas + want
        elif rollout is not None and rollout.promoted:
            limit = 2 * desired.replicas  # rule 12e: every remaining replica at once
        actions.extend(
            _starts(
                observed,
                desired,
                now,
                want,
                limit,
                len(new),
                len(live) + len(leaving),
                pending,
                wake,
            )
        )
        inflight = observed.samples[-1].inflight_of if observed.samples else _nothing
        if full:  # rule 12: nothing old goes before the target holds all the traffic
            actions.extend(
                _drains(desired, observed.serving_revision, old, new, available_new, inflight)
            )
        else:
            actions.extend(_superseded(desired, observed.serving_revision, old))

    # Rule 9: nothing serves yet that a first static rollout could wait to replace.
    placed_first = (
        desired.static
        and rollout is not None
        and rollout.from_revision is None
        and not any(r.state is ReplicaState.REQUESTED for r in new)
    )
    at_strength = not old and len(new) == desired.replicas and full
    if (
        rollout is not None
        and not paused  # a pause asked in this plan holds the rollout as it is
        and at_strength
        and (placed_first or len(available_new) == desired.replicas)
    ):
        actions.append(CompleteRollout(rollout.id))
    elif (
        rollout is None
        and at_strength
        and len(available_new) == desired.replicas
        and observed.serving_revision != target
    ):
        actions.append(MarkServing(target))  # rule 10

    ready = sum(1 for r in live if r.state is ReplicaState.READY)
    degraded: str | None = None
    # An autoscaled service on its way up is not degraded: only below its min, or when a
    # start failed (a cold start with no capacity, a crash), which the held requests hear.
    scaling = desired.scaling
    if ready < desired.replicas and (
        scaling is None or observed.backoff.failures or ready < scaling.min
    ):
        degraded = f"{ready} of {desired.replicas} replicas ready"
        if observed.backoff.failures and observed.backoff.reason:
            degraded += f": {observed.backoff.reason}"
    if degraded != observed.degraded:
        actions.append(SetDegraded(degraded))

    split = steps.split(rollout, desired, observed)
    if split != observed.split:
        actions.append(SetSplit(split))

    if wake:
        actions.append(WakeAt(min(wake)))
    return actions


def _retarget(observed: Observed, desired: Desired, rollout: Rollout | None) -> list[Action]:
    """Rule 7: the user moved the target; end the active rollout and begin one to it."""
    to = desired.revision
    kind: RolloutKind = "rollout"
    if desired.intent == "undo":
        kind = "undo"
    elif desired.intent == "abort" or to == observed.serving_revision:
        kind = "rollback"
    actions: list[Action] = []
    if rollout is not None:
        if desired.intent == "abort":
            actions.append(AbandonRollout(rollout.id, "aborted", "aborted by request"))
        else:
            article = "an" if kind == "undo" else "a"
            why = f"superseded by {article} {kind} to revision {to}"
            actions.append(AbandonRollout(rollout.id, "superseded", why))
    # A rollback returns from the target it abandons; any other rollout leaves what serves.
    since = observed.target if kind == "rollback" else observed.serving_revision
    # A first rollout has nothing to split the traffic with: it is rolling (rule 12f).
    staged = kind == "rollout" and since is not None
    strategy = desired.strategy.strategy if staged else "rolling"
    if rollout is not None and rollout.staged and desired.intent == "abort":
        actions.append(SetSplit((to, 100)))  # rule 12: the weight back to 0 at once
    actions.append(BeginRollout(since, to, kind, strategy))
    actions.extend(_undrains(observed, desired.replicas, to))
    return actions


def _pauses_on_failure(rollout: Rollout, s: RolloutStrategy) -> bool:
    """Rule 3: this rollout pauses when it fails (a rollback never does)."""
    return s.on_failure == "pause" and rollout.kind != "rollback"


def _failure(
    observed: Observed,
    rollout: Rollout,
    s: RolloutStrategy,
    now: float,
    failing: Sequence[Replica] = (),
) -> str | None:
    """Rule 3: why the rollout fails now, with the target replicas ``failing`` in this plan
    counted too; None while it does not."""
    failures = rollout.failures + len(failing)
    last = _give_up_reason(failing[-1], s) if failing else observed.backoff.reason
    if failures > s.retries:
        reason = last or "replicas of the new revision failed"
        times = "failure" if failures == 1 else "failures"
        return f"{reason} (after {failures} {times})"
    deadline = steps.deadline(rollout, s)
    if deadline is not None and now >= deadline:
        failed = f"not complete within {fmt_seconds(s.progress_deadline)}"
        if (failing or observed.backoff.failures) and last:
            failed += f"; last failure: {last}"
        return failed
    return None


def _fail(observed: Observed, desired: Desired, rollout: Rollout, reason: str) -> list[Action]:
    """Rule 3: pause the rollout, or end it failed and roll back to where it started."""
    back = rollout.from_revision
    if desired.strategy.on_failure == "pause" and rollout.kind != "rollback":
        if rollout.staged:  # rule 12: the weight back to 0 at once
            return [SetSplit((rollout.to_revision, 0)), PauseRollout(rollout.id, reason)]
        return [PauseRollout(rollout.id, reason)]
    actions: list[Action] = [FailRollout(rollout.id, reason)]
    if rollout.staged:
        actions.append(SetSplit(None if back is None else (back, 100)))
    # A failed rollback does not roll back in turn: that would return to the revision that
    # just failed, and could go back and forth for ever.
    if rollout.kind != "rollback" and back is not None:
        actions.append(BeginRollout(rollout.to_revision, back, "rollback"))
        actions.extend(_undrains(observed, desired.replicas, back))
    return actions


def _undrains(observed: Observed, replicas: int, revision: int) -> list[Action]:
    """Back to ``revision``: its replicas still draining (the rollout being left was
    replacing them) serve again, up to the desired count, newest drained first. Otherwise a
    failed rollout could leave nothing routable: the last old replica draining, the new ones
    crashing."""
    wanted = replicas - sum(1 for r in observed.replicas if r.live and r.revision == revision)
    draining = [
        r
        for r in observed.replicas
        if r.state is ReplicaState.DRAINING
        and r.revision == revision
        and r.address is not None
        and not r.drained
        and not r.failure
    ]
    draining.sort(key=lambda r: (not r.healthy, -r.since))  # healthy first, newest first
    reason = f"serves again: back to revision {revision}"
    return [Undrain(r.id, reason) for r in draining[: max(wanted, 0)]]


def _give_up_at(r: Replica, s: RolloutStrategy) -> float | None:
    if r.state in (ReplicaState.REQUESTED, ReplicaState.STARTING):
        return r.created + s.start_timeout
    if r.state is ReplicaState.UNHEALTHY:
        return r.since + s.start_timeout
    return None


def _counts(r: Replica, rollout: Rollout | None, s: RolloutStrategy) -> bool:
    """Rule 3: whether giving up ``r`` counts as a failure (of the target): not when its
    time ran out while the rollout was paused (resumed, it has its retries afresh), nor
    when its failure counted as it was kept (``KeepFailed``)."""
    if r.failure:
        return False
    deadline = _give_up_at(r, s)
    return rollout is None or deadline is None or deadline >= rollout.started


def _give_up_reason(r: Replica, s: RolloutStrategy) -> str:
    if r.state is ReplicaState.UNHEALTHY:
        reason = f"unhealthy for {fmt_seconds(s.start_timeout)}"
    else:
        reason = f"not ready within {fmt_seconds(s.start_timeout)}"
    return f"{reason}: {r.probe_failure}" if r.probe_failure else reason


def _starts(
    observed: Observed,
    desired: Desired,
    now: float,
    want: int,
    limit: int,
    new_count: int,
    occupied: int,
    pending: int,
    wake: list[float],
) -> list[Action]:
    """Starts toward ``want`` replicas of the target, with at most ``limit`` replicas live
    and leaving together."""
    s = desired.strategy
    room = limit - occupied
    count = min(want - new_count, room)
    if count <= 0:
        return []
    retry = retry_at(observed.backoff, s)
    if retry is not None:
        if now < retry:
            wake.append(retry)
            return []
        # After a failure, probe the backend with one start at a time, not a burst: a replan
        # while that start is still with the backend must not add another.
        if pending:
            return []
        count = 1
    return [Start(desired.revision) for _ in range(count)]


def _superseded(desired: Desired, serving: int | None, old: list[Replica]) -> list[Action]:
    """Rule 12: while a staged rollout holds the old revision, the replicas of any other
    (a superseded canary's) go, once the serving revision is at strength without them: the
    split's other side is the serving revision alone."""
    stable = sum(1 for r in old if r.revision == serving and r.state is ReplicaState.READY)
    if serving is None or stable < desired.replicas - desired.strategy.max_unavailable:
        return []
    why = f"replaced by revision {desired.revision}"
    return [Drain(r.id, why) for r in old if r.revision != serving]


def _nothing(replica_id: str) -> int:
    return 0


def _drains(
    desired: Desired,
    serving: int | None,
    old: list[Replica],
    new: list[Replica],
    available_new: list[Replica],
    inflight: Callable[[str], int],
) -> list[Action]:
    s = desired.strategy
    floor = desired.replicas - s.max_unavailable
    available = sum(1 for r in old if r.state is ReplicaState.READY) + len(available_new)
    budget = available - floor  # ready replicas that may be drained (rule 1)
    actions: list[Action] = []

    # Old replicas: those that serve nothing first, then those of a revision that never
    # completed (a superseded target), then the oldest revision, oldest first: the serving
    # revision goes last (rule 5).
    old_live = len(old)

    def order(r: Replica) -> tuple[bool, bool, int, float]:
        return (r.state is ReplicaState.READY, r.revision == serving, r.revision, r.created)

    for r in sorted(old, key=order):
        if old_live - 1 + len(available_new) < floor:
            break
        if r.state is ReplicaState.READY:
            if budget <= 0:
                break
            budget -= 1
        actions.append(Drain(r.id, f"replaced by revision {desired.revision}"))
        old_live -= 1

    # More target replicas than desired (a scale-down): the least useful ones, then those
    # with the fewest requests in flight, newest first (rule 11).
    excess = len(new) - desired.replicas
    # Not-ready ones first: a replica that is READY but not yet ``min_ready`` serves traffic,
    # so it must not go before one still starting (that emptied a service of READY replicas).
    for r in sorted(
        new,
        key=lambda r: (
            r.state is ReplicaState.READY,
            r in available_new,
            inflight(r.id),
            -r.created,
        ),
    ):
        if excess <= 0:
            break
        if r in available_new:
            if budget <= 0:
                continue
            budget -= 1
        actions.append(Drain(r.id, "scaled down"))
        excess -= 1
    return actions
