"""Placement: which host gets the next replica. Pure: no I/O, no clock.

Rules, in order:

1. Only a reachable host with a free slot (``in_use < capacity``) and, for a replica that
   asks for GPUs, as many GPUs free as it needs (at least one: ``all`` on a host without
   GPUs is no room) can take a replica.
2. Among those, the one holding the fewest replicas of the launch's revision, then of its
   service (a revision's replicas spread over hosts, also while a rollout replaces the
   previous one), then the one with the most free slots, then the first listed.
3. None can: ``NoRoom`` with a reason naming every host, e.g.
   ``no capacity: 2 of 2 hosts full (a: 2 of 2, b: 1 of 1)``; an unreachable host reads
   ``b: unreachable`` (``b: unreachable from n2`` in a cluster: the node that talks to the
   engines, its leader, could not reach it), one short of GPUs
   ``b: 1 of 4 GPUs free, 2 needed`` (and the count reads ``hosts full or short of GPUs``);
   one without the very devices asked for ``b: GPU 1 not free`` (held, or not a device of
   the host).
4. GPUs are tracked per device: a replica holds device ids (``gpus_for``), the lowest free
   ids for a count, every id for ``all``, the ids it names otherwise; they are free again
   once its container is gone.
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
    gpus: int = 0
    """The host's GPUs."""
    gpus_in_use: int = 0
    gpus_needed: int = 0
    """GPUs the replica being placed would hold here (0: it asks for none)."""
    gpus_free: tuple[str, ...] | None = None
    """The ids of the host's free GPUs (None: placement counts them only)."""
    gpus_asked: tuple[str, ...] = ()
    """The device ids the replica names (empty: any ``gpus_needed`` of them)."""

    @property
    def room(self) -> int:
        return self.capacity - self.in_use if self.reachable else 0

    @property
    def gpus_short(self) -> bool:
        if self.gpus_free is not None and self.gpus_needed:
            return gpus_for(self.gpus_free, self.gpus_needed, self.gpus_asked) is None
        return self.gpus_needed > self.gpus - self.gpus_in_use

    def describe(self, node: str | None = None) -> str:
        """The host's word in a no-capacity reason; ``node``: the one that reaches it."""
        if not self.reachable:
            return f"{self.name}: unreachable" + (f" from {node}" if node else "")
        if self.room > 0 and self.gpus_short and self.gpus_asked and self.gpus_free is not None:
            taken = ", ".join(g for g in self.gpus_asked if g not in self.gpus_free)
            return f"{self.name}: GPU {taken} not free"
        if self.room > 0 and self.gpus_short:
            free = self.gpus - self.gpus_in_use
            return f"{self.name}: {free} of {self.gpus} GPUs free, {self.gpus_needed} needed"
        return f"{self.name}: {self.in_use} of {self.capacity}"


@dataclass(frozen=True, slots=True)
class NoRoom:
    reason: str


def gpus_for(free: Sequence[str], needed: int, asked: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The device ids a replica gets of a host's ``free`` ones (in the host's order): those it
    ``asked`` for if each is free, else the first ``needed``; None: not enough free (rule 4)."""
    if asked:
        return tuple(asked) if all(g in free for g in asked) else None
    return tuple(free[:needed]) if needed <= len(free) else None


def place(hosts: Sequence[HostLoad], node: str | None = None) -> str | NoRoom:
    """The name of the host for the next replica, or why there is none (rules 1 to 3);
    ``node``: the cluster node that talks to the engines (None: a gateway of its own)."""
    candidates = [
        (h.revision_replicas, h.service_replicas, -h.room, i, h.name)
        for i, h in enumerate(hosts)
        if h.room > 0 and not h.gpus_short
    ]
    if candidates:
        return min(candidates)[-1]
    full = sum(1 for h in hosts if h.reachable)
    what = [h.describe(node) for h in hosts]
    short = any(h.room > 0 and h.gpus_short for h in hosts)
    counted = f"{full} of {len(hosts)} hosts full" + (" or short of GPUs" if short else "")
    if full < len(hosts):
        counted += f", {len(hosts) - full} unreachable"
    return NoRoom(f"no capacity: {counted} ({', '.join(what)})")


__all__ = ["HostLoad", "NoRoom", "gpus_for", "place"]
