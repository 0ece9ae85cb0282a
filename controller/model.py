"""The observed state of a service: replicas, the active rollout, the failure backoff. PURE.

These frozen records are what the planner reads. The reconciler builds them from what the
backend, the pool and the store report; nothing here performs I/O or reads a clock. Times are
monotonic seconds (the event loop's clock).

Replica lifecycle::

    requested -> starting -> ready -> draining -> stopping -> stopped
        \\           \\           \\
         +-> failed   +-> failed  +-> unhealthy -> (ready again | failed and replaced)

``requested``: the start was asked of the backend and has not returned. ``starting``: it runs,
probes run, no client request reaches it. ``ready``: probes passed; the pool routes to it.
``failed`` and ``stopped`` are terminal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from .analysis import NO_TRAFFIC, Outcome, Traffic
from .autoscaler import Memory, Sample
from .scaling import Autoscaling
from .spec import RolloutStrategy, StrategyName

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
    """When it last became ready (for ``min_ready``)."""
    address: str | None = None
    drained: bool = False
    """Draining only: the drain finished (cleanly or by timeout), so it may be stopped."""
    failure: str = ""
    """Why it failed, or why it is being taken down as failed."""
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
    """How it moves (``controller.steps``): a rollback and an undo are rolling."""
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

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_ROLLOUT

    @property
    def staged(self) -> bool:
        """Moved by steps and weights (canary, blue/green), not by replica counts."""
        return self.strategy != "rolling"

    def replace(self, **changes: object) -> Rollout:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


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
