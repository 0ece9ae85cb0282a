"""Leadership: what this node can vouch for by its own clock: its lease, and its term. PURE.

**The lease** (``LeaseClock``) is valid *locally* until the last successful keepalive's send
time plus the TTL, minus a safety ``margin``: etcd received the keepalive after it was sent, so
the local deadline falls before etcd's however late the answer came. The lease is the node's
liveness (its registration is bound to it); leadership does not depend on it.

**The term** (``Leadership``) rests on the *leader record*, one key whose value (``Record``:
the leader's name, its term, its TTL and its lease as a tag of the holder) stays the same
through a term. The leader rewrites it every TTL/3 by a compare-and-swap on the record's mod
revision; every other node watches it. Nobody reads another node's clock: as in Kubernetes'
leader election, a follower takes over once *its own* monotonic clock says the record's mod
revision has not changed for the record's TTL plus the margin, by a compare-and-swap on that
mod revision, whether or not etcd has expired any lease.

Rules:
1. The node leads only while a term runs and ``now`` is before the term's deadline: the send
   time of its last successful write of the record plus the TTL minus the margin.
   ``leading(now)`` reads the clock every time: a paused process that wakes up past the
   deadline does not lead, whatever etcd answers later.
2. A follower campaigns when the record is absent, or when its mod revision was first seen
   the record's ``ttl`` + ``margin`` ago and has not changed since; or at once when the record
   is the last one this node wrote (its own term ended by its clock and nobody took over). The
   write compares the mod revision it saw (0: absent), so two nodes never both win one record.
3. A new term's number is the revision the record was seen at (its mod revision, or where it
   was seen absent), greater than every earlier term; the fence compares the record's value.
4. Safety: a renewal commits after it was sent, and a follower sees it after it commits, so the
   follower's earliest takeover (seen + TTL + margin) falls after the leader's deadline (sent +
   TTL - margin), each on its own clock.
5. A term ends at the deadline (``expire``), when the record is seen to be another's or absent,
   or on resignation; it never comes back by itself: the node must win a campaign again. Each
   term that starts (Transition True) ends exactly once (Transition False).
6. Observations only move forward: one of an older revision than the last seen is ignored;
   renewals only move the deadline forward.
7. A renewal waits for its answer no longer than TTL/3, nor past the deadline; then a new one
   is sent. A write can be lost in etcd (sent to a member as its raft leader dies, it is
   answered only at etcd's request timeout, seconds later): waiting on it must not use up the
   term, whose slack (TTL - TTL/3 - margin) holds more than one renewal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of ``leading``, with the moment it was seen and why."""

    leading: bool
    at: float
    reason: str


# --- the lease ------------------------------------------------------------------------------


class LeaseClock:
    """This node's lease and its local deadline, fed with what etcd answered."""

    __slots__ = ("deadline", "lease", "margin", "ttl")

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.lease = 0
        """The current lease's id; 0 before the first grant and after it was lost."""
        self.ttl = 0.0
        self.deadline = -math.inf
        """Monotonic time from which the lease no longer counts as held."""

    def valid(self, now: float) -> bool:
        return self.lease != 0 and now < self.deadline

    def granted(self, lease: int, ttl: float, sent_at: float) -> None:
        """etcd granted ``lease`` (of ``ttl`` seconds) to a request sent at ``sent_at``."""
        self.lease = lease
        self.ttl = ttl
        self.deadline = sent_at + ttl - self.margin

    def renewed(self, lease: int, ttl: float, sent_at: float) -> None:
        """A keepalive of ``lease`` sent at ``sent_at`` answered ``ttl`` seconds left (0: etcd
        no longer has it). An answer for an older lease, or overtaken by a later one, changes
        nothing."""
        if lease != self.lease or lease == 0:
            return
        if ttl <= 0:
            self.lost(lease)
        else:
            self.deadline = max(self.deadline, sent_at + ttl - self.margin)

    def lost(self, lease: int) -> bool:
        """etcd says ``lease`` is gone; True if it was the current one."""
        if lease != self.lease or lease == 0:
            return False
        self.lease = 0
        self.deadline = -math.inf
        return True

    def __repr__(self) -> str:
        return f"<LeaseClock lease={self.lease:x} deadline={self.deadline:g}>"


# --- the leader record ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """The leader record's value: the same bytes from the start of a term to its end."""

    name: str
    term: int
    ttl: float
    """The leader's promise: it rewrites the record at least this often (seconds)."""
    lease: int = 0
    """The holder's lease when its term began: tells a restarted process from the one that
    led under the same name."""

    def encode(self) -> bytes:
        fields = {"name": self.name, "term": self.term, "ttl": self.ttl, "lease": self.lease}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        """The record in ``raw``; anything else (a bare name, as older versions wrote, bound to
        their leader's lease) is a record of that name with no TTL: one never taken over by
        time, only once etcd deletes it."""
        try:
            data = json.loads(raw)
            return cls(str(data["name"]), int(data["term"]), float(data["ttl"]), int(data["lease"]))
        except (ValueError, TypeError, KeyError):
            return cls(raw.decode(errors="replace"), 0, 0.0)


StepKind = Literal["wait", "campaign", "renew"]


@dataclass(frozen=True, slots=True)
class Step:
    """What the driver does next: write ``record`` if the record's mod revision is still
    ``revision`` (0: absent), waiting ``within`` seconds at most for the answer (rule 7; inf:
    as long as the etcd client does), or wait until ``at`` (or until something is observed)."""

    kind: StepKind
    at: float = math.inf
    revision: int = 0
    record: Record | None = None
    within: float = math.inf


class Leadership:
    """This node's view of the leader record and its own term, fed with what etcd answered
    and the time (monotonic seconds); ``decide`` says what to do next."""

    __slots__ = (
        "deadline",
        "margin",
        "mine",
        "name",
        "ours",
        "reason",
        "renewed_at",
        "revision",
        "seen",
        "seen_at",
        "ttl",
        "wrote",
    )

    def __init__(self, name: str, ttl: float, margin: float) -> None:
        self.name = name
        self.ttl = float(ttl)
        self.margin = margin
        self.seen: Record | None = None
        """The record as last observed (None: absent, or not read yet)."""
        self.revision = -1
        """Its mod revision, or the revision it was seen absent at (-1: not read yet)."""
        self.seen_at = -math.inf
        """When this node first saw ``revision`` (rules 2 and 4)."""
        self.ours: Record | None = None
        """Our record while our term runs (the fence compares it)."""
        self.wrote: Record | None = None
        """The last record this node wrote or tried to write (rule 2: taken back at once)."""
        self.mine = 0
        """The mod revision of our last write of ``ours``: the renewal compares it."""
        self.renewed_at = -math.inf
        """Send time of our last successful write of ``ours``."""
        self.deadline = -math.inf
        """Rule 1: the term's end by this node's clock."""
        self.reason = "not elected"
        """Why the node does not lead (empty while it leads)."""

    # --- what it knows ------------------------------------------------------------------------

    def leading(self, now: float) -> bool:
        """Rule 1."""
        return self.ours is not None and now < self.deadline

    @property
    def term(self) -> int:
        """Our term's number while it runs (by the last event, not the clock); 0 otherwise."""
        return self.ours.term if self.ours is not None else 0

    def takeover_at(self) -> float:
        """When this node may take over the record as seen (rule 2)."""
        if self.revision < 0:
            return math.inf
        if self.seen is None or self.seen == self.wrote:
            return -math.inf
        if self.seen.ttl <= 0:
            return math.inf  # an older version's key: its holder renews a lease, not the key
        return self.seen_at + self.seen.ttl + self.margin

    def leader(self, now: float) -> str | None:
        """Who leads as this node sees it: None if nobody, if that is not known, or if the
        record has been silent past its takeover time (its holder is gone, or cut off)."""
        if self.leading(now):
            return self.name
        if self.seen is None or self.seen == self.wrote or now >= self.takeover_at():
            return None
        return self.seen.name

    # --- what to do ---------------------------------------------------------------------------

    def decide(self, now: float, lease: int) -> Step:
        """The next step at ``now``; ``lease`` is this node's valid lease (0: none, so no
        campaign). Call ``expire`` first: a term past its deadline is not renewed."""
        if self.ours is not None:
            due = self.renewed_at + self.ttl / 3
            if now >= due:
                within = min(self.ttl / 3, self.deadline - now)  # rule 7
                return Step("renew", revision=self.mine, record=self.ours, within=within)
            return Step("wait", at=min(due, self.deadline))
        if lease == 0:
            return Step("wait")
        at = self.takeover_at()
        if now < at:
            return Step("wait", at=at)
        record = Record(self.name, self.revision, self.ttl, lease)  # rule 3
        return Step("campaign", revision=0 if self.seen is None else self.revision, record=record)

    # --- being told ---------------------------------------------------------------------------

    def observed(self, record: Record | None, revision: int, now: float) -> Transition | None:
        """The record as read or watched: ``record`` at mod revision ``revision``, or None if
        absent at ``revision``. Ends our term if it is no longer ours (rule 5)."""
        if revision < self.revision:
            return None  # rule 6
        if revision > self.revision:
            self.seen_at = now
        self.revision = revision
        self.seen = record
        if self.ours is None:
            return None
        if record == self.ours:
            self.mine = max(self.mine, revision)
            return None
        if record is None:
            return self._end(now, "the leader record was deleted")
        return self._end(now, f"{record.name} took over (term {record.term})")

    def trying(self, record: Record) -> None:
        """A campaign is about to write ``record`` (it may be applied even if no answer
        comes: seen later, it is taken back at once, rule 2)."""
        self.wrote = record

    def won(self, record: Record, revision: int, sent_at: float, now: float) -> Transition | None:
        """A campaign sent at ``sent_at`` wrote ``record``, at mod revision ``revision``."""
        self.wrote = record
        self.observed(record, revision, now)
        if self.ours is not None or sent_at + self.ttl - self.margin <= now:
            return None  # already leading; or too late: the next step campaigns again
        self.ours = record
        self.mine = revision
        self.renewed_at = sent_at
        self.deadline = sent_at + self.ttl - self.margin
        self.reason = ""
        return Transition(True, now, "won the campaign")

    def renewed(self, revision: int, sent_at: float, now: float) -> Transition | None:
        """A renewal sent at ``sent_at`` rewrote our record, at mod revision ``revision``."""
        if self.ours is None:
            return None
        self.observed(self.ours, revision, now)
        if now >= self.deadline:
            return self._end(now, "the record was renewed past the term's deadline")
        self.mine = max(self.mine, revision)
        if sent_at > self.renewed_at:
            self.renewed_at = sent_at
            self.deadline = max(self.deadline, sent_at + self.ttl - self.margin)
        return None

    def expire(self, now: float) -> Transition | None:
        """Called at the deadline (a timer, each step): the term ends there (rule 1)."""
        if self.ours is not None and now >= self.deadline:
            return self._end(now, "the leader record was not renewed in time")
        return None

    def resigned(self, now: float) -> Transition | None:
        return self._end(now, "resigned")

    def _end(self, now: float, reason: str) -> Transition | None:
        """End the term, if one runs: one Transition(False) per Transition(True), even when
        ``leading`` already reads False because the deadline passed before anyone looked."""
        self.reason = reason
        if self.ours is None:
            return None
        self.ours = None
        self.mine = 0
        self.deadline = -math.inf
        return Transition(False, now, reason)

    def __repr__(self) -> str:
        seen = "absent" if self.seen is None else f"{self.seen.name}/{self.seen.term}"
        return (
            f"<Leadership {self.name} term={self.term} deadline={self.deadline:g} "
            f"seen={seen}@{self.revision} since={self.seen_at:g}"
            f"{' reason=' + repr(self.reason) if self.reason else ''}>"
        )
