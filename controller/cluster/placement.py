"""Placement in a cluster: which node runs the next replica. PURE: no I/O, no clock.

Rules, in order:

1. Only a live node (its key under ``nodes/`` exists) whose agent publishes its capacity, and
   that has a free slot (``in_use < capacity``; a capacity of None has no limit), can take a
   replica.
2. Among those, spread: the node holding the fewest replicas of the launch's revision, then
   of its service (a service keeps serving on the rest when one node dies), then the fewest
   replicas in use, then the first name in sort order.
3. None can: ``NoRoom`` with a reason naming every node, e.g.
   ``no capacity on any node (a: 2 of 2, b: 1 of 1, c: no agent)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What placement needs to know of one node now."""

    name: str
    capacity: int | None
    """Most replicas at once (None: no limit)."""
    in_use: int
    agent: bool = True
    """The node's agent publishes its capacity (False: the node runs no replicas now)."""
    service_replicas: int = 0
    """Replicas of the service being placed that the node holds (of any revision)."""
    revision_replicas: int = 0
    """Those of them that are of the revision being placed."""

    @property
    def free(self) -> bool:
        return self.agent and (self.capacity is None or self.in_use < self.capacity)

    def describe(self) -> str:
        if not self.agent:
            return f"{self.name}: no agent"
        limit = "unlimited" if self.capacity is None else str(self.capacity)
        return f"{self.name}: {self.in_use} of {limit}"


@dataclass(frozen=True, slots=True)
class NoRoom:
    reason: str


def place(nodes: Sequence[NodeLoad]) -> str | NoRoom:
    """The name of the node for the next replica, or why there is none (rules 1 to 3)."""
    candidates = [
        (n.revision_replicas, n.service_replicas, n.in_use, n.name) for n in nodes if n.free
    ]
    if candidates:
        return min(candidates)[-1]
    if not nodes:
        return NoRoom("no capacity: no node is live")
    what = ", ".join(n.describe() for n in sorted(nodes, key=lambda n: n.name))
    return NoRoom(f"no capacity on any node ({what})")


__all__ = ["NoRoom", "NodeLoad", "place"]
