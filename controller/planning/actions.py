"""What the planner decides. PURE: plain frozen records.

The reconciler applies each decision to the service's state (``transitions``) and hands it to
the executor, which performs its I/O through the backend, the pool and the store; what then
happens (a start that raised, an exit, a finished drain) comes back as an observation.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import StrategyName
from .analysis import Outcome
from .model import AbandonedAs, RolloutKind


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
class Undrain:
    """A draining replica serves again (its revision is the target once more)."""

    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop a replica whose drain is done (SIGTERM, then SIGKILL after the grace)."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class FailReplica:
    """Give up on a replica (not ready in time): it is drained, stopped and marked failed.
    ``counts``: its failure counts against its revision's backoff and the rollout (not when
    its time ran out while the rollout was paused, nor when it counted as it was kept)."""

    replica_id: str
    reason: str
    counts: bool = True


@dataclass(frozen=True, slots=True)
class KeepFailed:
    """A replica failed (not ready in time) as its rollout pauses on that failure: it counts
    as failed, but is kept running, still unrouted, for inspection (``on_failure: pause``)."""

    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class BeginRollout:
    """Move the service to ``to_revision``: a new active rollout, its failures and the
    backoff afresh. An active rollout is ended first (``AbandonRollout``)."""

    from_revision: int | None
    to_revision: int
    kind: RolloutKind
    strategy: StrategyName = "rolling"


@dataclass(frozen=True, slots=True)
class CompleteRollout:
    """Every replica is of the target and available: the target serves."""

    rollout_id: int


@dataclass(frozen=True, slots=True)
class MarkServing:
    """The target serves at full strength with no rollout: it is what a failed rollout
    returns to from now on."""

    revision: int


@dataclass(frozen=True, slots=True)
class FailRollout:
    """The rollout spent its retries or its deadline: it ends failed with ``reason``. What
    follows (a rollback) is a decision of its own."""

    rollout_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class AbandonRollout:
    """The user's intent moved the target elsewhere: the active rollout ends ``outcome``."""

    rollout_id: int
    outcome: AbandonedAs
    reason: str


@dataclass(frozen=True, slots=True)
class PauseRollout:
    """Hold the rollout where it is: nothing is started, drained or given up."""

    rollout_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResumeRollout:
    """Go on with a paused rollout, with its retries and its deadline afresh."""

    rollout_id: int


@dataclass(frozen=True, slots=True)
class SetWeight:
    """A staged rollout's step ``step`` (of ``steps``) holds the target at ``weight`` percent
    of the traffic from now: its pause and its analysis window begin."""

    rollout_id: int
    step: int
    steps: int
    weight: int


@dataclass(frozen=True, slots=True)
class NextStep:
    """A staged rollout moves on to ``step``: its replicas start as its weight needs."""

    rollout_id: int
    step: int


@dataclass(frozen=True, slots=True)
class Judge:
    """The analysis judged the step's window (``controller.planning.analysis``)."""

    rollout_id: int
    outcome: Outcome
    reason: str


@dataclass(frozen=True, slots=True)
class Promote:
    """``rollout promote``: the rollout skips its remaining steps (a blue/green switches)."""

    rollout_id: int


@dataclass(frozen=True, slots=True)
class SetSplit:
    """Split the service's traffic by revision in the pool: (revision, weight) or None."""

    split: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Rescale:
    """The autoscaler moves the desired count to ``count``, for ``reason``."""

    count: int
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
    | Undrain
    | Stop
    | FailReplica
    | KeepFailed
    | BeginRollout
    | CompleteRollout
    | MarkServing
    | FailRollout
    | AbandonRollout
    | PauseRollout
    | ResumeRollout
    | SetWeight
    | NextStep
    | Judge
    | Promote
    | SetSplit
    | Rescale
    | SetDegraded
    | Forget
    | WakeAt
)
