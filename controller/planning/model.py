"""The observed state of a service: replicas, the active rollout, the failure backoff. PURE.

These frozen records are what the planner reads. The reconciler builds them from what the
backend, the pool and the store report; nothing here performs I/O or reads a clock. Times are
monotonic seconds (the event loop's clock). A rollout's strategy state goes to its record and
comes back after a restart through ``strategy_state`` and ``restore_strategy``, its times
relative to when it began, so they need no clock of their own.

Replica lifecycle::

    requested -> starting -> ready -> draining -> stopping -> stopped
        \\           \\           \\
         +-> failed   +-> failed  +-> unhealthy -> (ready again | failed and replaced)

``requested``: the start was asked of the backend and has not returned. ``starting``: it runs,
probes run, no client request reaches it. ``ready``: probes passed; the pool routes to it.
``failed`` and ``stopped`` are terminal. A static replica (something else runs it) is never
failed: once its probes fail it is ``unhealthy``, from ``starting`` as from ``ready``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, get_args

from ..scaling import Autoscaling
from ..spec import RolloutStrategy, StrategyName
from .analysis import NO_TRAFFIC, Outcome, Traffic
from .autoscaler import Memory, Sample

RolloutKind = Literal["rollout", "rollback", "undo"]
"""``rollout``: to a new target (an apply); ``rollback``: back to the revision a failed or
aborted rollout started from, or an apply of the serving spec; ``undo``: asked for."""

Intent = Literal["apply", "undo", "abort"]
"""What moved the desired revision last: it sets the kind of the rollout the planner begins."""

EventKind = Literal[
    "service_created",
    "service_updated",
    "service_restored",
    "service_degraded",
    "service_recovered",
    "service_deleting",
    "service_deleted",
    "rollout_started",
    "rollout_complete",
    "rollout_failed",
    "rollout_paused",
    "rollout_resumed",
    "rollout_aborted",
    "rollout_superseded",
    "rollout_step",
    "rollout_promoted",
    "rollout_analysis",
    "replica_started",
    "replica_ready",
    "replica_unhealthy",
    "replica_failed",
    "replica_draining",
    "replica_drain_timeout",
    "replica_undrained",
    "replica_stopped",
    "upstream_drained",
    "upstream_undrained",
    "upstream_healthy",
    "upstream_unhealthy",
    "upstream_ejected",
    "upstream_ejection_ended",
    "host_unreachable",
    "host_reachable",
    "image_pulling",
    "certificate_issued",
    "certificate_renewed",
    "certificate_failed",
    "autoscaled",
    "cold_start",
]
"""Every kind of journal entry (``/api/events``' ``event`` field)."""

AbandonedAs = Literal["superseded", "aborted"]
"""How an active rollout ends when the user's intent moves the target elsewhere."""


class ReplicaState(StrEnum):
    REQUESTED = "requested"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


LIVE = frozenset(
    {ReplicaState.REQUESTED, ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY}
)
"""Replicas that count toward the desired count: running or about to, and not leaving."""

LEAVING = frozenset({ReplicaState.DRAINING, ReplicaState.STOPPING})
"""Replicas on their way out: they still hold a slot of the backend."""

TERMINAL = frozenset({ReplicaState.STOPPED, ReplicaState.FAILED})


@dataclass(frozen=True, slots=True)
class Replica:
    """One instance of one revision."""

    id: str
    revision: int
    state: ReplicaState
    created: float
    """When its start was requested."""
    since: float
    """When it entered its current state."""
    ready_since: float | None = None
    """When it last became ready (for ``min_ready``); while it drains, when its probes last
    began to pass, so that a drain taken back leaves it READY with a ``ready_since``."""
    address: str | None = None
    drained: bool = False
    """Draining only: the drain finished (cleanly or by timeout), so it may be stopped."""
    failure: str = ""
    """Why it failed, or why it is being taken down as failed; on a live replica, why it
    failed when the rollout paused on that failure and kept it (``KeepFailed``)."""
    exit_code: int | None = None
    healthy: bool = False
    """Its upstream's last probe verdict (kept while it drains: a drain may be taken back)."""
    probe_failure: str = ""
    """Why its probes last failed: the cause a give-up reports."""

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def leaving(self) -> bool:
        return self.state in LEAVING

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def available(self, now: float, min_ready: float) -> bool:
        """Ready, and ready for at least ``min_ready`` seconds."""
        return (
            self.state is ReplicaState.READY
            and self.ready_since is not None
            and now - self.ready_since >= min_ready
        )

    def replace(self, **changes: object) -> Replica:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class RolloutStatus(StrEnum):
    PROGRESSING = "progressing"
    PAUSED = "paused"
    COMPLETE = "complete"
    FAILED = "failed"
    ABORTED = "aborted"
    SUPERSEDED = "superseded"


ACTIVE_ROLLOUT = frozenset({RolloutStatus.PROGRESSING, RolloutStatus.PAUSED})


@dataclass(frozen=True, slots=True)
class Rollout:
    """The move of a service from ``from_revision`` to ``to_revision``."""

    id: int
    from_revision: int | None
    to_revision: int
    kind: RolloutKind
    """``rollout`` (an apply), ``rollback`` (after a failure), or ``undo`` (asked for)."""
    status: RolloutStatus
    started: float
    failures: int = 0
    """Target-revision replicas that failed during this rollout."""
    reason: str = ""
    strategy: StrategyName = "rolling"
    """How it moves (``controller.planning.steps``): a rollback and an undo are rolling."""
    step: int = 0
    """Canary: the index of the current step; blue/green: 0 before the switch, 1 after."""
    step_since: float | None = None
    """When the current step began, if not with the rollout (its replicas started as needed
    for its weight)."""
    holding_since: float | None = None
    """When the step's weight was set (its replicas available): its window and pause begin."""
    weight: int = 0
    """The target revision's share of the traffic, percent, as last set."""
    promoted: bool = False
    """``rollout promote`` was asked: the remaining steps are skipped."""
    baseline: Traffic = NO_TRAFFIC
    """The traffic counts when the step's weight was set: where its analysis window begins."""
    verdict: Outcome | None = None
    analysis: str = ""
    """The last analysis' reason, with its figures."""
    judged_at: float = 0.0
    begun: float | None = dataclasses.field(default=None, compare=False)
    """When it began, as its record's ``started_at`` says (``started`` moves on a resume):
    what the times of its strategy state are kept relative to. None: ``started``. Not
    compared: no decision reads it, only the record's (de)serialiser."""

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_ROLLOUT

    @property
    def anchor(self) -> float:
        """When it began (``begun``, else ``started``)."""
        return self.started if self.begun is None else self.begun

    @property
    def staged(self) -> bool:
        """Moved by steps and weights (canary, blue/green), not by replica counts."""
        return self.strategy != "rolling"

    def replace(self, **changes: object) -> Rollout:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def strategy_state(rollout: Rollout) -> str:
    """What a rollout's record keeps of how it moves (``rollouts.strategy_json``), as JSON:
    its strategy, step, weight, promotion and last analysis, and its times as seconds after
    it began (its record's ``started_at``, wall-clock): ``started`` (moved by a resume),
    ``step_since``, ``holding_since``, ``judged_at``; null where not set (``judged_at``: 0,
    never judged). Not its baseline: request counts belong to the process that counted
    them."""
    anchor = rollout.anchor

    def since(t: float | None) -> float | None:
        return None if t is None else t - anchor

    data: dict[str, Any] = {
        "strategy": rollout.strategy,
        "step": rollout.step,
        "weight": rollout.weight,
        "promoted": rollout.promoted,
        "started": since(rollout.started),
        "step_since": since(rollout.step_since),
        "holding_since": since(rollout.holding_since),
        # 0: never judged (a time on no clock), kept as such.
        "judged_at": None if rollout.judged_at == 0.0 else since(rollout.judged_at),
        "verdict": rollout.verdict,
        "analysis": rollout.analysis,
    }
    return json.dumps(data, separators=(",", ":"))


def restore_strategy(
    rollout: Rollout, text: str | None, now: float, traffic: Traffic = NO_TRAFFIC
) -> Rollout:
    """``rollout`` as read back from its record (``started`` from its ``started_at``, on the
    clock of ``now``) with the strategy state the record keeps (``strategy_state``; None:
    none kept, it stays as it is). Its times come back relative to when it began, none
    later than ``now``. The analysis window begins again at ``traffic``, the counts of the
    process now running (those of the one that wrote the record are gone); a step's pause
    goes on where it was. ``ValueError`` for a state that cannot be read."""
    if text is None:
        return rollout
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"a rollout's strategy state is a JSON object, not {text[:40]!r}")
    anchor = rollout.anchor

    def at(key: str) -> float | None:
        value = data.get(key)
        return None if value is None else min(now, anchor + float(value))

    strategy = data.get("strategy", "rolling")
    if strategy not in get_args(StrategyName):
        raise ValueError(f"unknown rollout strategy {strategy!r}")
    verdict = data.get("verdict")
    if verdict is not None and verdict not in get_args(Outcome):
        raise ValueError(f"unknown analysis verdict {verdict!r}")
    started = at("started")
    judged = at("judged_at")
    return rollout.replace(
        begun=anchor,
        started=rollout.started if started is None else started,
        strategy=strategy,
        step=int(data.get("step", 0)),
        weight=int(data.get("weight", 0)),
        promoted=bool(data.get("promoted", False)),
        step_since=at("step_since"),
        holding_since=at("holding_since"),
        judged_at=0.0 if judged is None else judged,
        verdict=verdict,
        analysis=str(data.get("analysis", "")),
        baseline=traffic,
    )


@dataclass(frozen=True, slots=True)
class Backoff:
    """Consecutive failures to start or keep a replica of the target revision.

    Reset when a target-revision replica becomes ready. Drives the crash-loop and no-capacity
    backoff, and the reason a degraded service gives.
    """

    failures: int = 0
    last_failure_at: float = 0.0
    reason: str = ""

    def failed(self, now: float, reason: str) -> Backoff:
        return Backoff(self.failures + 1, now, reason)


@dataclass(frozen=True, slots=True)
class Observed:
    """Everything the planner knows of one service at one moment."""

    replicas: tuple[Replica, ...] = ()
    serving_revision: int | None = None
    """The revision that last completed a rollout: what a failed rollout returns to."""
    rollout: Rollout | None = None
    """The active rollout, if any."""
    backoff: Backoff = Backoff()
    degraded: str | None = None
    """The condition as last set (the planner only emits a change)."""
    target: int | None = None
    """The revision the last rollout begun went to: the one the service holds or moves to.
    The planner begins a rollout when the desired revision differs from it."""
    samples: tuple[Sample, ...] = ()
    """The service's traffic, oldest first, as far back as its autoscaler reads (the latest
    only, for a fixed count)."""
    scaler: Memory = dataclasses.field(default_factory=Memory)
    """What the autoscaler remembers between decisions."""
    traffic: Traffic = NO_TRAFFIC
    """The latest sample of the request counts per revision (a staged rollout's analysis)."""
    split: tuple[int, int] | None = None
    """The traffic split by revision as last set in the pool: (revision, weight percent)."""

    def replace(self, **changes: object) -> Observed:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Desired:
    """What the user asked for: the target revision at ``replicas`` strength.

    Written from the user's intents (apply, scale, pause, undo, delete) and by the decisions
    that move the service on its own (a rollback to the serving revision)."""

    revision: int
    replicas: int
    strategy: RolloutStrategy
    paused: bool = False
    deleting: bool = False
    intent: Intent = "apply"
    """What set ``revision``: the kind of the next rollout, and how an active one ends."""
    static: bool = False
    """The target's replicas are static addresses that something else runs (rule 9)."""
    scaling: Autoscaling | None = None
    """The autoscaler's range and settings; None: ``replicas`` is a fixed count."""
    promote: bool = False
    """``rollout promote`` asked, not yet taken by the active rollout."""

    def replace(self, **changes: object) -> Desired:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
