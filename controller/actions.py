"""What the planner asks the executor to do. PURE: plain frozen records.

The executor performs each one through the backend, the pool and the store, and turns what
happens (a start that raised, an exit, a finished drain) into observations for the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Start:
    """Start one replica of ``revision``."""

    revision: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop routing to a replica; its in-flight requests finish or hit the drain timeout."""

    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop a replica whose drain is done (SIGTERM, then SIGKILL after the grace)."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class FailReplica:
    """Give up on a replica (not ready in time): it is drained, stopped and marked failed."""

    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class CompleteRollout:
    rollout_id: int


@dataclass(frozen=True, slots=True)
class FailRollout:
    """The rollout spent its retries or its deadline. The executor records it and, per
    ``on_failure``, returns the service to the previous revision or pauses."""

    rollout_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class SetDegraded:
    """Set (reason) or clear (None) the service's degraded condition."""

    reason: str | None


@dataclass(frozen=True, slots=True)
class Forget:
    """A deleted service has no replica left: forget it."""


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Plan again at ``at`` even if nothing happens before."""

    at: float


Action = (
    Start
    | Drain
    | Stop
    | FailReplica
    | CompleteRollout
    | FailRollout
    | SetDegraded
    | Forget
    | WakeAt
)
