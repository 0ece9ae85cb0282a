"""Placement: which host gets the next replica. Pure: no I/O, no clock.

Rules, in order:

1. Only a reachable host with a free slot (``in_use < capacity``) can take a replica.
2. Among those, the one holding the fewest replicas of the launch's revision, then of its
   service (a revision's replicas spread over hosts, also while a rollout replaces the
   previous one), then the one with the most free slots, then the first listed.
3. None can: ``NoRoom`` with a reason naming every host, e.g.
   ``no capacity: 2 of 2 hosts full (a: 2 of 2, b: 1 of 1)``; an unreachable host reads
   ``b: unreachable``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostLoad:
    """What placement needs to know of one host now."""

    name: str
    capacity: int
    in_use: int
    reachable: bool
    service_replicas: int
    """Replicas of the service being placed that the host holds (of any revision)."""
    revision_replicas: int = 0
    """Those of them that are of the revision being placed."""

    @property
    def room(self) -> int:
        return self.capacity - self.in_use if self.reachable else 0


@dataclass(frozen=True, slots=True)
class NoRoom:
    reason: str


def place(hosts: Sequence[HostLoad]) -> str | NoRoom:
    """The name of the host for the next replica, or why there is none (rules 1 to 3)."""
    candidates = [
        (h.revision_replicas, h.service_replicas, -h.room, i, h.name)
        for i, h in enumerate(hosts)
        if h.room > 0
    ]
    if candidates:
        return min(candidates)[-1]
    full = sum(1 for h in hosts if h.reachable)
    what = [
        f"{h.name}: {h.in_use} of {h.capacity}" if h.reachable else f"{h.name}: unreachable"
        for h in hosts
    ]
    counted = f"{full} of {len(hosts)} hosts full"
    if full < len(hosts):
        counted += f", {len(hosts) - full} unreachable"
    return NoRoom(f"no capacity: {counted} ({', '.join(what)})")
