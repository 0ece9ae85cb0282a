"""Transitions: how a service's state changes. PURE; the reconciler is their only caller.

Three kinds of input change a service's ``(desired, observed)`` pair, each by a function here:

- ``decide``: a decision of the planner (a start is ``requested``, a drain is ``draining``,
  a rollout begins, fails, completes, the autoscaler moves the count);
- ``observe``: what the backend, the pool and the executor saw (a replica placed, a start
  that raised, a health verdict, a finished drain, an exit, a sample of the traffic);
- ``intend``: what the user asked (an apply, a scale, a pause, an undo, a delete).

Each returns the new pair and the journal entries that record the change; none performs
I/O, reads a clock or draws a random number: ``now`` and new ids are passed in. Failures are
counted here, once: a replica of the target revision that fails (it exits, its start raises,
or the planner gives it up or keeps it, as counting) backs off its starts and, while the
rollout to it progresses, counts against that rollout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from ..scaling import Autoscaling
from ..spec import RolloutStrategy
from .actions import (
    AbandonRollout,
    Action,
    BeginRollout,
    CompleteRollout,
    Drain,
    FailReplica,
    FailRollout,
    Forget,
    Judge,
    KeepFailed,
    MarkServing,
    NextStep,
    PauseRollout,
    Promote,
    Rescale,
    ResumeRollout,
    SetDegraded,
    SetSplit,
    SetWeight,
    Start,
    Stop,
    Undrain,
    WakeAt,
)
from .analysis import Traffic
from .autoscaler import Decision, Sample, changed, horizon, remember
from .model import (
    Backoff,
    Desired,
    EventKind,
    Intent,
    Observed,
    Replica,
    ReplicaState,
    Rollout,
    RolloutStatus,
)

KEEP_TERMINAL = 20
"""Stopped and failed replicas kept per service for status and the planner's history."""


@dataclass(frozen=True, slots=True)
class Event:
    """A journal entry to record about the service."""

    kind: EventKind
    message: str
    revision: int | None = None
    replica: str | None = None


def replica_event(kind: EventKind, replica: Replica, message: str) -> Event:
    """An entry about one replica: ``message`` follows ``replica <id>``."""
    return Event(kind, f"replica {replica.id} {message}", replica.revision, replica.id)


@dataclass(frozen=True, slots=True)
class Step:
    """The state after a transition, and what to record of it."""

    desired: Desired
    observed: Observed
    events: tuple[Event, ...] = ()


# -- observations ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placed:
    """The backend started a replica; it listens at ``address``."""

    replica_id: str
    address: str


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The backend could not start a replica (no capacity, a bad command, an error).
    ``counts``: False when its host did not answer or failed it with an error of its own, a
    fault of the host and not of the revision: the revision's starts back off, but the
    rollout does not count it (an engine stopped during a rollout must not roll a good
    revision back)."""

    replica_id: str
    reason: str
    counts: bool = True


@dataclass(frozen=True, slots=True)
class HealthChanged:
    """The replica's upstream passed (``healthy``) or failed its probes."""

    replica_id: str
    healthy: bool
    reason: str


@dataclass(frozen=True, slots=True)
class ProbeFailed:
    """A probe of a replica that does not pass failed for ``reason``: its verdict stands,
    but a give-up says what the replica answers now, not what it answered as it started."""

    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class DrainDone:
    """The replica's drain ended: every request finished (``clean``) or the timeout hit."""

    replica_id: str
    clean: bool


@dataclass(frozen=True, slots=True)
class Exited:
    """The replica's process or container ended; ``requested``: by a stop we asked for."""

    replica_id: str
    code: int | None
    reason: str
    requested: bool


@dataclass(frozen=True, slots=True)
class Sampled:
    """The service's traffic, sampled from the data plane (for the autoscaler)."""

    sample: Sample


@dataclass(frozen=True, slots=True)
class Counted:
    """The service's request counts per revision, sampled from the data plane (for the
    analysis of a staged rollout)."""

    traffic: Traffic


Observation = (
    Placed | StartFailed | HealthChanged | ProbeFailed | DrainDone | Exited | Sampled | Counted
)

MAX_SAMPLES = 10_000
"""A bound on the samples kept, whatever the autoscaler's horizon."""


def observe(desired: Desired, observed: Observed, seen: Observation, now: float) -> Step:
    """The state once ``seen`` is taken in. A replica the state no longer tracks (or one
    already terminal) is left alone."""
    if isinstance(seen, Sampled):
        return Step(desired, _sampled(desired, observed, seen.sample))
    if isinstance(seen, Counted):
        return Step(desired, observed.replace(traffic=seen.traffic))
    r = _find(observed, seen.replica_id)
    if r is None or r.terminal:
        return Step(desired, observed)
    match seen:
        case Placed(address=address):
            if r.state is ReplicaState.REQUESTED:
                started = r.replace(state=ReplicaState.STARTING, since=now, address=address)
                event = Event(
                    "replica_started",
                    f"replica {r.id} of revision {r.revision} started at {address}",
                    r.revision,
                    r.id,
                )
                return Step(desired, _put(observed, started), (event,))
            # Drained or given up while the backend started it: nothing was ever routed to
            # it, so it may be stopped at once.
            return Step(desired, _put(observed, r.replace(address=address, drained=True)))
        case StartFailed(reason=reason, counts=counts):
            failure = r.failure or reason
            failed = r.replace(state=ReplicaState.FAILED, since=now, failure=failure)
            out = _put(observed, failed)
            if not r.failure and r.state is ReplicaState.REQUESTED:
                out = _count_failure(desired, out, r, reason, now, against_rollout=counts)
            return Step(desired, out, (replica_event("replica_failed", r, f"failed: {reason}"),))
        case HealthChanged(healthy=healthy, reason=reason):
            return _health(desired, observed, r, healthy, reason, now)
        case ProbeFailed(reason=reason):
            if r.healthy or not reason:  # a passing replica's one failure is no verdict
                return Step(desired, observed)
            return Step(desired, _put(observed, r.replace(probe_failure=reason)))
        case DrainDone(clean=clean):
            if r.state is not ReplicaState.DRAINING:
                return Step(desired, observed)
            events: tuple[Event, ...] = ()
            if not clean:
                message = "drain timeout, in-flight requests were cut off"
                events = (replica_event("replica_drain_timeout", r, message),)
            return Step(desired, _put(observed, r.replace(drained=True)), events)
        case Exited(code=code, reason=reason, requested=requested):
            if r.state is ReplicaState.STOPPING or requested:
                final = ReplicaState.FAILED if r.failure else ReplicaState.STOPPED
                stopped = r.replace(state=final, since=now, exit_code=code)
                event = replica_event("replica_stopped", r, "stopped")
                return Step(desired, _put(observed, stopped), (event,))
            failure = f"replica {reason}"
            failed = r.replace(
                state=ReplicaState.FAILED, since=now, failure=failure, exit_code=code
            )
            out = _count_failure(desired, _put(observed, failed), r, failure, now)
            event = replica_event("replica_failed", r, f"failed: {failure}")
            return Step(desired, out, (event,))


def _sampled(desired: Desired, observed: Observed, sample: Sample) -> Observed:
    """Keep ``sample`` (and those the autoscaler still reads); the autoscaler remembers it."""
    scaling = desired.scaling
    if scaling is None:
        return observed.replace(samples=(sample,))
    since = sample.at - horizon(scaling)
    kept = tuple(s for s in observed.samples if s.at > since and s.at < sample.at)
    samples = (*kept[-(MAX_SAMPLES - 1) :], sample)
    memory = remember(observed.scaler, samples, desired.replicas, scaling)
    return observed.replace(samples=samples, scaler=memory)


def _health(
    desired: Desired, observed: Observed, r: Replica, healthy: bool, reason: str, now: float
) -> Step:
    if not healthy and reason:
        r = r.replace(probe_failure=reason)
    if not r.live:  # a draining replica's verdict is kept, should its drain be taken back
        if healthy and not r.healthy:  # and when it began to pass, for ``min_ready`` then
            r = r.replace(ready_since=now)
        return Step(desired, _put(observed, r.replace(healthy=healthy)))
    if healthy and r.state in (ReplicaState.STARTING, ReplicaState.UNHEALTHY):
        # A replica kept after it failed (``KeepFailed``) that comes up has failed no more.
        ready = r.replace(
            state=ReplicaState.READY, since=now, ready_since=now, healthy=True, failure=""
        )
        out = _put(observed, ready)
        if r.revision == desired.revision:
            out = out.replace(backoff=Backoff())
        events = [replica_event("replica_ready", r, f"ready at {r.address}")]
        cold = out.scaler.cold_start
        if cold is not None:
            took = now - cold
            message = f"cold start: replica {r.id} ready {took:.2f} s after the scale from zero"
            events.append(Event("cold_start", message, r.revision, r.id))
            memory = dataclasses.replace(
                out.scaler,
                cold_start=None,
                cold_starts=out.scaler.cold_starts + 1,
                last_cold_start=took,
            )
            out = out.replace(scaler=memory)
        return Step(desired, out, tuple(events))
    # A replica that starts may fail its probes until it is up: it is ``starting`` until its
    # start_timeout. A static one was not started by us and is never given up (rule 9):
    # failing, it is as unhealthy as one that served before.
    if not healthy and (
        r.state is ReplicaState.READY or (r.state is ReplicaState.STARTING and desired.static)
    ):
        sick = r.replace(state=ReplicaState.UNHEALTHY, since=now, healthy=False)
        event = replica_event("replica_unhealthy", r, f"unhealthy: {reason}")
        return Step(desired, _put(observed, sick), (event,))
    return Step(desired, _put(observed, r.replace(healthy=healthy)))


# -- decisions -------------------------------------------------------------------------------


def decide(
    desired: Desired,
    observed: Observed,
    action: Action,
    now: float,
    *,
    new_id: str = "",
    rollout_id: int = 0,
) -> Step:
    """The state once the planner's ``action`` is taken: ``new_id`` names the replica a
    ``Start`` requests, ``rollout_id`` the record a ``BeginRollout`` was given."""
    match action:
        case Start(revision=revision):
            replica = Replica(new_id, revision, ReplicaState.REQUESTED, created=now, since=now)
            return Step(desired, _put(observed, replica))
        case Drain(replica_id=rid, reason=reason):
            return _drain(desired, observed, rid, reason, now)
        case FailReplica(replica_id=rid, reason=reason, counts=counts):
            r = _find(observed, rid)
            if r is None or not r.live:
                return Step(desired, observed)
            out = _put(observed, r.replace(failure=reason))
            if counts:
                out = _count_failure(desired, out, r, reason, now)
            failed = replica_event("replica_failed", r, f"failed: {reason}")
            step = _drain(desired, out, rid, reason, now)
            return Step(step.desired, step.observed, (failed, *step.events))
        case KeepFailed(replica_id=rid, reason=reason):
            r = _find(observed, rid)
            if r is None or not r.live or r.failure:
                return Step(desired, observed)
            out = _count_failure(desired, _put(observed, r.replace(failure=reason)), r, reason, now)
            message = f"failed: {reason}; kept for inspection"
            return Step(desired, out, (replica_event("replica_failed", r, message),))
        case Undrain(replica_id=rid, reason=reason):
            r = _find(observed, rid)
            if r is None or r.state is not ReplicaState.DRAINING:
                return Step(desired, observed)
            state = ReplicaState.READY if r.healthy else ReplicaState.UNHEALTHY
            # A READY replica without a ``ready_since`` is never available, so never
            # completes a rollout nor serves (``_health`` sets it for a draining replica
            # whose probes began to pass; this guards the invariant).
            ready_since = now if r.ready_since is None else r.ready_since
            back = r.replace(state=state, since=now, ready_since=ready_since)
            event = replica_event("replica_undrained", r, reason)
            return Step(desired, _put(observed, back), (event,))
        case Stop(replica_id=rid):
            r = _find(observed, rid)
            if r is None or r.state is not ReplicaState.DRAINING:
                return Step(desired, observed)
            if r.address is None:  # never placed: nothing runs
                final = ReplicaState.FAILED if r.failure else ReplicaState.STOPPED
                return Step(desired, _put(observed, r.replace(state=final, since=now)))
            return Step(desired, _put(observed, r.replace(state=ReplicaState.STOPPING, since=now)))
        case BeginRollout(from_revision=since, to_revision=to, kind=kind, strategy=strategy):
            begun = Rollout(
                rollout_id,
                since,
                to,
                kind,
                RolloutStatus.PROGRESSING,
                now,
                strategy=strategy,
            )
            message = f"{kind} {rollout_id}: {_move(since, to)}"
            if strategy != "rolling":
                message += f" ({strategy.replace('_', '/')})"
            event = Event("rollout_started", message, to)
            return Step(
                desired.replace(revision=to, paused=False, promote=False),
                observed.replace(rollout=begun, target=to, backoff=Backoff()),
                (event,),
            )
        case CompleteRollout(rollout_id=rid):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            to = rollout.to_revision
            message = f"{rollout.kind} {rollout.id} complete: revision {to} serving"
            return Step(
                desired.replace(paused=False),
                observed.replace(rollout=None, serving_revision=to),
                (Event("rollout_complete", message, to),),
            )
        case MarkServing(revision=revision):
            return Step(desired, observed.replace(serving_revision=revision))
        case FailRollout(rollout_id=rid, reason=reason):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            to = rollout.to_revision
            message = f"{rollout.kind} {rollout.id} to revision {to} failed: {reason}"
            failed = Event("rollout_failed", message, to)
            return Step(desired.replace(paused=False), observed.replace(rollout=None), (failed,))
        case AbandonRollout(rollout_id=rid, outcome=outcome, reason=reason):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            ended: EventKind = "rollout_aborted" if outcome == "aborted" else "rollout_superseded"
            event = Event(ended, f"rollout {rollout.id} {reason}", rollout.to_revision)
            return Step(desired.replace(paused=False), observed.replace(rollout=None), (event,))
        case PauseRollout(rollout_id=rid, reason=reason):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            paused = rollout.replace(status=RolloutStatus.PAUSED, reason=reason)
            message = f"rollout {rollout.id} paused"
            if reason != "paused by request":
                message += f" on failure: {reason}"
            return Step(
                desired.replace(paused=True),
                observed.replace(rollout=paused),
                (Event("rollout_paused", message, rollout.to_revision),),
            )
        case ResumeRollout(rollout_id=rid):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            # A rollout paused by its own failure gets its retries afresh on resume; a staged
            # one holds its step's weight again once its replicas are available, with a
            # fresh window.
            # ``begun`` keeps when it began: its record's times are relative to that.
            resumed = rollout.replace(
                status=RolloutStatus.PROGRESSING,
                reason="",
                failures=0,
                started=now,
                begun=rollout.anchor,
            )
            if rollout.staged:
                resumed = resumed.replace(step_since=now, holding_since=None)
            event = Event("rollout_resumed", f"rollout {rollout.id} resumed", rollout.to_revision)
            return Step(desired, observed.replace(rollout=resumed, backoff=Backoff()), (event,))
        case SetWeight(rollout_id=rid, step=index, steps=steps, weight=weight):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            held = rollout.replace(
                step=index,
                weight=weight,
                holding_since=now,
                baseline=observed.traffic,
                judged_at=now,
                verdict=None,
                analysis="",
            )
            to = rollout.to_revision
            share = "no traffic but preview" if weight == 0 else f"{weight}% of the traffic"
            message = (
                f"{rollout.kind} {rid}: revision {to} takes {share} (step {index + 1} of {steps})"
            )
            return Step(
                desired,
                observed.replace(rollout=held),
                (Event("rollout_step", message, to),),
            )
        case NextStep(rollout_id=rid, step=index):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            moved = rollout.replace(step=index, step_since=now, holding_since=None)
            return Step(desired, observed.replace(rollout=moved))
        case Judge(rollout_id=rid, outcome=outcome, reason=reason):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired, observed)
            judged = rollout.replace(verdict=outcome, analysis=reason, judged_at=now)
            message = f"{rollout.kind} {rid}: {outcome}: {reason}"
            event = Event("rollout_analysis", message, rollout.to_revision)
            return Step(desired, observed.replace(rollout=judged), (event,))
        case Promote(rollout_id=rid):
            rollout = _active(observed, rid)
            if rollout is None:
                return Step(desired.replace(promote=False), observed)
            promoted = rollout.replace(promoted=True)
            event = Event("rollout_promoted", f"{rollout.kind} {rid} promoted", rollout.to_revision)
            return Step(
                desired.replace(promote=False), observed.replace(rollout=promoted), (event,)
            )
        case SetSplit(split=split):
            return Step(desired, observed.replace(split=split))
        case Rescale(count=count, reason=reason):
            before = desired.replicas
            memory = changed(observed.scaler, now, before, Decision(count, reason))
            event = Event("autoscaled", reason or f"{before} -> {count}", desired.revision)
            return Step(desired.replace(replicas=count), observed.replace(scaler=memory), (event,))
        case SetDegraded(reason=reason):
            event = (
                Event("service_recovered", "all replicas ready")
                if reason is None
                else Event("service_degraded", f"degraded: {reason}")
            )
            return Step(desired, observed.replace(degraded=reason), (event,))
        case Forget():
            return Step(desired, observed, (Event("service_deleted", "service deleted"),))
        case WakeAt():
            return Step(desired, observed)


def _drain(desired: Desired, observed: Observed, rid: str, reason: str, now: float) -> Step:
    r = _find(observed, rid)
    if r is None or not r.live:
        return Step(desired, observed)
    draining = r.replace(state=ReplicaState.DRAINING, since=now)
    event = replica_event("replica_draining", r, f"draining: {reason}")
    return Step(desired, _put(observed, draining), (event,))


def _move(since: int | None, to: int) -> str:
    return f"new service, revision {to}" if since is None else f"revision {since} -> {to}"


# -- intents ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Retarget:
    """Move the service to ``revision`` (an apply of a new template, an undo, an abort)."""

    revision: int
    intent: Intent


@dataclass(frozen=True, slots=True)
class Configure:
    """Replica count, rollout strategy, whether the target's replicas are static, and the
    autoscaler's settings (with them, the count the service has is kept, within the range:
    ``replicas`` only counts for a fixed count)."""

    replicas: int
    strategy: RolloutStrategy
    static: bool = False
    scaling: Autoscaling | None = None


@dataclass(frozen=True, slots=True)
class SetPaused:
    paused: bool


@dataclass(frozen=True, slots=True)
class Delete:
    pass


@dataclass(frozen=True, slots=True)
class AskPromote:
    """``rollout promote``: the active rollout skips its remaining steps."""


Change = Retarget | Configure | SetPaused | Delete | AskPromote


def intend(desired: Desired, observed: Observed, changes: Iterable[Change]) -> Step:
    """The state once the user's ``changes`` are recorded. They move only what is desired:
    what follows from it is the planner's to decide."""
    events: list[Event] = []
    for change in changes:
        match change:
            case Retarget(revision=revision, intent=intent):
                desired = desired.replace(revision=revision, intent=intent)
            case Configure(replicas=replicas, strategy=strategy, static=static, scaling=scaling):
                if scaling is not None:
                    replicas = scaling.clamp(desired.replicas)
                desired = desired.replace(
                    replicas=replicas, strategy=strategy, static=static, scaling=scaling
                )
            case SetPaused(paused=paused):
                desired = desired.replace(paused=paused)
            case AskPromote():
                desired = desired.replace(promote=True)
            case Delete():
                desired = desired.replace(deleting=True)
                events.append(Event("service_deleting", "deleting: draining every replica"))
    return Step(desired, observed, tuple(events))


# -- helpers ---------------------------------------------------------------------------------


def _find(observed: Observed, replica_id: str) -> Replica | None:
    for r in observed.replicas:
        if r.id == replica_id:
            return r
    return None


def _active(observed: Observed, rollout_id: int) -> Rollout | None:
    rollout = observed.rollout
    if rollout is None or rollout.id != rollout_id or not rollout.active:
        return None
    return rollout


def _put(observed: Observed, replica: Replica) -> Observed:
    """Add or replace a replica record, keeping only the newest terminal ones."""
    replicas = [*(r for r in observed.replicas if r.id != replica.id), replica]
    terminal = [r for r in replicas if r.terminal]
    if len(terminal) > KEEP_TERMINAL:
        drop = {r.id for r in sorted(terminal, key=lambda r: r.since)[:-KEEP_TERMINAL]}
        replicas = [r for r in replicas if r.id not in drop]
    return observed.replace(replicas=tuple(replicas))


def _count_failure(
    desired: Desired,
    observed: Observed,
    r: Replica,
    reason: str,
    now: float,
    *,
    against_rollout: bool = True,
) -> Observed:
    """A replica failed: back off its revision's starts; count it against the rollout
    (unless ``against_rollout`` is False: its host failed, not the revision)."""
    if r.revision != desired.revision:
        return observed
    observed = observed.replace(backoff=observed.backoff.failed(now, reason))
    rollout = observed.rollout
    if (
        against_rollout
        and rollout is not None
        and rollout.status is RolloutStatus.PROGRESSING
        and rollout.to_revision == r.revision
    ):
        observed = observed.replace(rollout=rollout.replace(failures=rollout.failures + 1))
    return observed
