"""Passive outlier detection: eject an upstream that fails real traffic. PURE.

Modelled on Envoy's outlier detection. ``consecutive_connect_failures`` connect errors or
``consecutive_5xx`` 5xx responses in a row eject an upstream for
``base_ejection_time * n`` (n = how many times it has been ejected), capped at
``max_ejection_time``. The pool refuses an ejection that would take more than
``max_ejection_percent`` of its upstreams (see ``may_eject``). An ejection ends when its time
is up *and* an active probe then passes: the probe, not the clock, readmits the upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import OutlierConfig


@dataclass(frozen=True, slots=True)
class Ejection:
    until: float
    reason: str


class OutlierState:
    """Failure streaks of one upstream in real traffic."""

    __slots__ = ("config", "connect_failures", "ejected_until", "ejections", "errors_5xx")

    def __init__(self, config: OutlierConfig) -> None:
        self.config = config
        self.connect_failures = 0
        self.errors_5xx = 0
        self.ejections = 0
        self.ejected_until: float | None = None

    def record(self, outcome: str, now: float) -> Ejection | None:
        """Record one outcome (``"ok"``, ``"connect_failure"`` or ``"5xx"``).

        Returns an ejection when a streak reached its threshold; the caller decides with
        ``may_eject`` whether it takes effect and then calls ``eject``.
        """
        if outcome == "ok":
            self.connect_failures = 0
            self.errors_5xx = 0
            return None
        if self.ejected_until is not None:
            return None
        if outcome == "connect_failure":
            self.connect_failures += 1
            if self.connect_failures >= self.config.consecutive_connect_failures:
                return self.proposed(now, f"{self.connect_failures} connect failures in a row")
        elif outcome == "5xx":
            self.errors_5xx += 1
            if self.errors_5xx >= self.config.consecutive_5xx:
                return self.proposed(now, f"{self.errors_5xx} 5xx responses in a row")
        return None

    def proposed(self, now: float, reason: str) -> Ejection:
        duration = min(
            self.config.base_ejection_time * (self.ejections + 1), self.config.max_ejection_time
        )
        return Ejection(now + duration, reason)

    def eject(self, ejection: Ejection) -> None:
        self.ejections += 1
        self.ejected_until = ejection.until
        self.connect_failures = 0
        self.errors_5xx = 0

    def probe_passed(self, now: float) -> bool:
        """An active probe passed: lift the ejection if its time is up. True if lifted."""
        if self.ejected_until is not None and now >= self.ejected_until:
            self.ejected_until = None
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"<OutlierState connect_failures={self.connect_failures} 5xx={self.errors_5xx} "
            f"ejections={self.ejections} ejected_until={self.ejected_until}>"
        )


def may_eject(ejected: int, total: int, max_percent: int) -> bool:
    """Whether one more ejection keeps the ejected share within ``max_percent``.

    One upstream of a pool may always be ejected unless ``max_percent`` is 0, so a pool of
    two with the default 50 % can still shed its broken half.
    """
    if max_percent <= 0 or total <= 0:
        return False
    return ejected == 0 or (ejected + 1) * 100 <= total * max_percent
