"""What the leader knows of the cluster's replicas: the records its feeds loaded and watch.

``Books`` holds, by name, the live nodes, their capacity records, and the placements, running,
failed and exit records (``replicas``: the keys and JSON). ``ClusterBackend`` keeps one per
term and decides from it; ``loads`` is the input of ``placement.place``; ``forgotten`` says
which running records a node gone long enough left behind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from controller.backends.base import Launch
from controller.cluster.placement import NodeLoad
from controller.cluster.replicas import (
    CapacityRecord,
    ExitRecord,
    FailedRecord,
    Placement,
    RunningRecord,
)

T = TypeVar("T")


@dataclass(eq=False)
class Books:
    nodes: set[str] = field(default_factory=set)
    capacity: dict[str, CapacityRecord] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    running: dict[str, RunningRecord] = field(default_factory=dict)
    failed: dict[str, FailedRecord] = field(default_factory=dict)
    exits: dict[str, ExitRecord] = field(default_factory=dict)

    def in_use(self, node: str) -> int:
        """Replicas on ``node``: what is placed there, or what its agent says if more."""
        placed = sum(1 for p in self.placements.values() if p.node == node)
        record = self.capacity.get(node)
        return max(placed, record.in_use if record is not None else 0)

    def loads(self, launch: Launch) -> list[NodeLoad]:
        """Each live node's load, as ``place`` weighs it for ``launch``."""
        loads = []
        for node in sorted(self.nodes):
            record = self.capacity.get(node)
            mine = [
                p.launch
                for p in self.placements.values()
                if p.node == node and p.stop is None and p.launch.service == launch.service
            ]
            loads.append(
                NodeLoad(
                    name=node,
                    capacity=record.capacity if record is not None else 0,
                    in_use=self.in_use(node),
                    agent=record is not None,
                    service_replicas=len(mine),
                    revision_replicas=sum(1 for m in mine if m.revision == launch.revision),
                )
            )
        return loads


def forgotten(
    running: Mapping[str, RunningRecord],
    nodes: set[str],
    gone_at: Mapping[str, float],
    now: float,
    grace: float,
) -> list[str]:
    """The running records (by replica) to delete at ``now``: those of a node not live that
    has been gone ``grace`` seconds or more (``gone_at``: when the leader saw it go, or, gone
    before its term, when the term began). A node with no ``gone_at`` is kept."""
    return sorted(
        rid
        for rid, record in running.items()
        if record.node not in nodes
        and record.node in gone_at
        and now - gone_at[record.node] >= grace
    )


def load_records(
    into: dict[str, T], kvs: dict[str, bytes], parse: Callable[[bytes], T | None]
) -> None:
    """Replace ``into`` with the records of a feed's load (unreadable ones left out)."""
    into.clear()
    for name, raw in kvs.items():
        parsed = parse(raw)
        if parsed is not None:
            into[name] = parsed


def change_record(
    into: dict[str, T], name: str, raw: bytes | None, parse: Callable[[bytes], T | None]
) -> None:
    """A feed's change of one record: put, or (deleted, unreadable) removed."""
    parsed = None if raw is None else parse(raw)
    if parsed is None:
        into.pop(name, None)
    else:
        into[name] = parsed
