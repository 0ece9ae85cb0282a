"""One service's control state: what the user asked, what was observed, and its loop's handles.

The reconciler is the only writer of ``desired`` and ``observed``: it passes them through the
pure transitions (``controller.planning.transitions``) and stores what they return. Everything else
(the admin API, metrics, the executor) reads them. Mutated only on the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .planning.model import Desired, Observed, Replica
from .spec import ServiceSpec


@dataclass(eq=False)
class ServiceState:
    """The control state of one service."""

    name: str
    spec: ServiceSpec
    """The newest applied spec: its routing, strategy and count are in force; its template is
    the target revision's."""
    revisions: dict[int, ServiceSpec]
    desired: Desired
    observed: Observed = field(default_factory=Observed)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    wake_at: float | None = None
    forgotten: bool = False
    task: asyncio.Task[None] | None = None

    def replica(self, replica_id: str) -> Replica | None:
        for r in self.observed.replicas:
            if r.id == replica_id:
                return r
        return None

    def __repr__(self) -> str:
        live = sum(1 for r in self.observed.replicas if r.live)
        return (
            f"<ServiceState {self.name} target=r{self.desired.revision} "
            f"serving={self.observed.serving_revision} live={live}/{self.desired.replicas}>"
        )
