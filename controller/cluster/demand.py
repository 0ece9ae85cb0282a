"""Demand: what each node's traffic asks of a service, merged over the live nodes. PURE.

Each follower's report (``membership.NodeReport``) carries its ``Demand`` per service, its
workers' included: the requests in flight per upstream and held now, and the running totals
of requests completed and of those that found nothing routable. On the leader a
``DemandTable`` merges them (``merged``) into what the autoscaler adds to its own pool's
sample (``Sample.plus``). The merge rule:

1. In flight and held: summed over the nodes whose report is fresh, taken in within the
   node's ``fresh_for`` (its lease TTL; a node with requests in flight or held writes its
   report again well within it). A node that dies stops counting within its lease TTL: its
   report goes with its lease (``remove``), and by then it is stale anyway.
2. Completed and waited: totals that only grow, as the autoscaler's rates need. A node counts
   from its totals in its first report this table takes in (no jump when a node joins or
   another node begins to lead); what a node counted stays counted once it is gone; a total
   that went down (the node started again under its name) counts on from there.
3. A service that begins holding requests on a node (none held in its last fresh report) is
   the autoscaler's cue (``update`` returns it): a cold start need not wait for a sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.planning.autoscaler import Sample


@dataclass(frozen=True, slots=True)
class Demand:
    """One service's traffic on one node, every process of the node's."""

    inflight: Mapping[str, int] = field(default_factory=dict)
    """Upstream id -> requests (and streams) in flight on it, those with none left out."""
    held: int = 0
    """Requests held now for want of a routable upstream."""
    completed: int = 0
    """Requests the service's upstreams completed: a running total."""
    waited: int = 0
    """Requests that found no routable upstream (held or refused): a running total."""

    @property
    def busy(self) -> bool:
        """Requests in flight or held now."""
        return self.held > 0 or any(self.inflight.values())

    @property
    def empty(self) -> bool:
        """Nothing to say: no request now and none so far (left out of a report)."""
        return not self.busy and not self.completed and not self.waited

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"completed": self.completed, "waited": self.waited}
        if self.inflight:
            out["inflight"] = dict(sorted(self.inflight.items()))
        if self.held:
            out["held"] = self.held
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Demand:
        inflight = {str(u): int(n) for u, n in raw.get("inflight", {}).items() if int(n) > 0}
        return cls(
            inflight,
            int(raw.get("held", 0)),
            int(raw.get("completed", 0)),
            int(raw.get("waited", 0)),
        )


@dataclass(slots=True)
class _Node:
    demand: Mapping[str, Demand]
    at: float
    """When its report was taken in."""
    fresh_for: float
    """Seconds its report counts after ``at`` (0: while it is there)."""
    base: dict[str, tuple[int, int]]
    """Service -> the (completed, waited) it counts from (rule 2)."""

    def fresh(self, now: float) -> bool:
        return not self.fresh_for or now - self.at <= self.fresh_for

    def counted(self, service: str) -> tuple[int, int]:
        """What it counted of ``service`` since its base."""
        demand = self.demand.get(service)
        completed, waited = (demand.completed, demand.waited) if demand else (0, 0)
        base = self.base.get(service, (0, 0))
        return max(completed - base[0], 0), max(waited - base[1], 0)


class DemandTable:
    """The reporting nodes' demand, merged by the module's rules; ``now`` is given."""

    def __init__(self) -> None:
        self.nodes: dict[str, _Node] = {}
        self.past: dict[str, tuple[int, int]] = {}
        """Service -> what nodes gone (or started again) counted: still counted (rule 2)."""

    def update(
        self, node: str, demand: Mapping[str, Demand], now: float, fresh_for: float = 0.0
    ) -> list[str]:
        """Take ``node``'s report in; the services it began holding requests of (rule 3)."""
        old = self.nodes.get(node)
        if old is None:
            base = {s: (d.completed, d.waited) for s, d in demand.items()}
            self.nodes[node] = _Node(dict(demand), now, fresh_for, base)
            return sorted(s for s, d in demand.items() if d.held)
        began = [
            s
            for s, d in demand.items()
            if d.held and not (old.fresh(now) and s in old.demand and old.demand[s].held)
        ]
        for service in old.demand.keys() | demand.keys():
            before = old.demand.get(service)
            after = demand.get(service, Demand())
            if before is not None and (
                after.completed < before.completed or after.waited < before.waited
            ):
                self._retire(service, old.counted(service))
                old.base[service] = (after.completed, after.waited)
        old.demand, old.at, old.fresh_for = dict(demand), now, fresh_for
        return sorted(began)

    def remove(self, node: str) -> None:
        """``node`` is gone: its requests now stop counting, what it completed stays."""
        gone = self.nodes.pop(node, None)
        if gone is not None:
            for service in gone.demand:
                self._retire(service, gone.counted(service))

    def _retire(self, service: str, counted: tuple[int, int]) -> None:
        completed, waited = self.past.get(service, (0, 0))
        self.past[service] = (completed + counted[0], waited + counted[1])

    def merged(self, service: str, now: float) -> Sample:
        """``service``'s traffic over the reporting nodes as of ``now`` (``ready`` left 0)."""
        completed, waited = self.past.get(service, (0, 0))
        held = 0
        inflight: dict[str, int] = {}
        for node in self.nodes.values():
            counted = node.counted(service)
            completed += counted[0]
            waited += counted[1]
            demand = node.demand.get(service)
            if demand is None or not node.fresh(now):
                continue
            held += demand.held
            for uid, count in demand.inflight.items():
                inflight[uid] = inflight.get(uid, 0) + count
        return Sample(
            now,
            sum(inflight.values()),
            held,
            completed,
            waited,
            per_replica=tuple(sorted(inflight.items())),
        )

    def __repr__(self) -> str:
        return f"<DemandTable nodes={sorted(self.nodes)} past={len(self.past)}>"
