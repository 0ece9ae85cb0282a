"""HealthState: the rise/fall counters of active probing. PURE (no I/O, no clock of its own).

An upstream starts ``unknown``. ``healthy_threshold`` consecutive passes make it healthy;
``unhealthy_threshold`` consecutive failures make it unhealthy (from unknown as well, so a
replica that never comes up is reported as such). A pass resets the failure streak and a
failure resets the pass streak, so a flapping upstream does not creep over a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pool.upstream import Health


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of health, with the moment it was observed."""

    old: Health
    new: Health
    at: float
    reason: str


class HealthState:
    """Counts consecutive probe results of one upstream and says when its health changes."""

    __slots__ = (
        "failures",
        "health",
        "healthy_threshold",
        "last_reason",
        "since",
        "successes",
        "unhealthy_threshold",
    )

    def __init__(self, healthy_threshold: int, unhealthy_threshold: int, now: float) -> None:
        self.healthy_threshold = healthy_threshold
        self.unhealthy_threshold = unhealthy_threshold
        self.health = Health.UNKNOWN
        self.successes = 0
        self.failures = 0
        self.since = now
        self.last_reason = ""

    def observe(self, ok: bool, now: float, reason: str = "") -> Transition | None:
        """Record one probe result; return the transition it caused, if any."""
        self.last_reason = reason
        if ok:
            self.successes += 1
            self.failures = 0
            if self.health is not Health.HEALTHY and self.successes >= self.healthy_threshold:
                return self._move(Health.HEALTHY, now, reason or "probe passed")
        else:
            self.failures += 1
            self.successes = 0
            if self.health is not Health.UNHEALTHY and self.failures >= self.unhealthy_threshold:
                return self._move(Health.UNHEALTHY, now, reason or "probe failed")
        return None

    def _move(self, new: Health, now: float, reason: str) -> Transition:
        transition = Transition(self.health, new, now, reason)
        self.health = new
        self.since = now
        return transition

    def __repr__(self) -> str:
        return (
            f"<HealthState {self.health.value} successes={self.successes} "
            f"failures={self.failures} since={self.since:g}>"
        )
