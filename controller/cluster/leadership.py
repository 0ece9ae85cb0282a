"""Leadership: what this node can vouch for about its lease and its term as leader. PURE.

The lease is valid *locally* until the last successful keepalive's send time plus the TTL,
minus a safety ``margin``. etcd received that keepalive after it was sent and expires the lease
a TTL after receiving it, so the local deadline falls before etcd's, however late the answer
came back; the margin covers clock rates and scheduling. Past the deadline the node cannot tell
whether its lease still exists, so it acts as if it did not.

Rules:
1. The node leads only while a term runs and ``now`` is before the lease's local deadline:
   ``leading(now)`` reads the clock every time, so a paused process that wakes up past the
   deadline does not lead, whatever etcd answers later.
2. A term starts only when a campaign with the current, locally valid lease won (``won``).
3. A term ends at the deadline and never comes back by itself: a renewal that arrives after the
   deadline revives the lease but not the term; the node must win a campaign again.
4. A new lease, a lease etcd says is gone, and a resignation end the term at once.
6. Each term that starts (Transition True) ends exactly once (Transition False), whatever
   ends it, so elected and deposed alternate for the driver's subscribers.
5. Renewals only move the deadline forward, and only for the current lease (an answer to a
   keepalive of an older lease, or one overtaken by a later one, changes nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of ``leading``, with the moment it was seen and why."""

    leading: bool
    at: float
    reason: str


class Leadership:
    """The lease of this node and its term as leader, fed with what etcd answered."""

    __slots__ = ("deadline", "lease", "margin", "reason", "term", "ttl")

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.lease = 0
        """The current lease's id; 0 before the first grant and after it was lost."""
        self.ttl = 0.0
        self.deadline = -math.inf
        """Monotonic time from which the lease no longer counts as held (rule 1)."""
        self.term = 0
        """The create revision of the leader key our campaign wrote, while our term runs
        (the fence of every write); 0 when no term runs."""
        self.reason = "no lease yet"
        """Why the node does not lead (empty while it leads)."""

    def leading(self, now: float) -> bool:
        """Rule 1."""
        return self.term != 0 and now < self.deadline

    def lease_valid(self, now: float) -> bool:
        return self.lease != 0 and now < self.deadline

    def granted(self, lease: int, ttl: float, sent_at: float, now: float) -> Transition | None:
        """etcd granted ``lease`` (of ``ttl`` seconds) to a request sent at ``sent_at``."""
        ended = self._end(now, "a new lease replaced the old one")  # rule 4
        self.lease = lease
        self.ttl = ttl
        self.deadline = sent_at + ttl - self.margin
        if ended is None:
            self.reason = "not elected"
        return ended

    def renewed(self, lease: int, ttl: float, sent_at: float, now: float) -> Transition | None:
        """A keepalive of ``lease`` sent at ``sent_at`` answered: ``ttl`` seconds are left
        (0: etcd no longer has the lease)."""
        if lease != self.lease or lease == 0:
            return None  # rule 5
        if ttl <= 0:
            return self.lost(lease, now)
        ended = None
        if self.term and now >= self.deadline:
            ended = self._end(now, "the lease lapsed before it was renewed")  # rule 3
        self.deadline = max(self.deadline, sent_at + ttl - self.margin)
        return ended

    def lost(self, lease: int, now: float) -> Transition | None:
        """etcd says ``lease`` is gone (expired or revoked)."""
        if lease != self.lease or lease == 0:
            return None
        self.lease = 0
        self.deadline = -math.inf
        return self._end(now, "etcd no longer has the lease")

    def won(self, lease: int, create_revision: int, now: float) -> Transition | None:
        """A campaign with ``lease`` found the leader key ours, created at ``create_revision``.

        Rule 2: nothing starts unless ``lease`` is the current lease and still valid."""
        if lease != self.lease or not self.lease_valid(now) or create_revision <= 0:
            return None
        was = self.term != 0
        self.term = create_revision
        self.reason = ""
        return None if was else Transition(True, now, "won the campaign")

    def deposed(self, now: float, reason: str) -> Transition | None:
        """The term ends: the leader key is gone or another's, or this node resigned."""
        return self._end(now, reason)

    def expire(self, now: float) -> Transition | None:
        """Called at the deadline (a timer): the term ends there if no renewal came."""
        if self.term and now >= self.deadline:
            return self._end(now, "the lease was not renewed in time")
        return None

    def _end(self, now: float, reason: str) -> Transition | None:
        """End the term, if one runs: one Transition(False) per Transition(True), even when
        ``leading`` already reads False because the deadline passed before anyone looked."""
        if not self.term:
            return None
        self.term = 0
        self.reason = reason
        return Transition(False, now, reason)

    def __repr__(self) -> str:
        return (
            f"<Leadership lease={self.lease:x} term={self.term} deadline={self.deadline:g}"
            f"{' reason=' + repr(self.reason) if self.reason else ''}>"
        )
