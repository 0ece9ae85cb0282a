"""The backend protocol: start and stop replicas, and tell of their exits.

A backend has a capacity. When it is full, ``start`` raises ``NoCapacity`` (the situation of
both background reports); when a replica cannot be started at all, ``StartFailed``. Neither
is ever the fate of another replica: the controller turns them into an observation about the
one replica that was asked for.

Exits are reported through the callback given to ``set_exit_handler``, once per replica,
whether the replica crashed or was stopped. ``handle`` is a JSON-able dict the controller
persists so that ``adopt`` can take a still-running replica back after a gateway restart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..spec import ReplicaTemplate


@dataclass(frozen=True, slots=True)
class Launch:
    """What to start: one replica of one revision."""

    service: str
    revision: int
    replica_id: str
    template: ReplicaTemplate


@dataclass(frozen=True, slots=True)
class Running:
    """A started (or adopted) replica."""

    replica_id: str
    host: str
    port: int
    pid: int | None = None
    handle: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Exit:
    """A replica ended. ``code`` is its exit status, or ``-N`` for signal N, or None."""

    replica_id: str
    code: int | None
    reason: str
    requested: bool
    """True when the replica ended because ``stop`` asked it to."""


ExitHandler = Callable[[Exit], None]


class Backend(Protocol):
    name: str

    @property
    def capacity(self) -> int | None:
        """Most replicas at once, or None for no limit."""

    @property
    def in_use(self) -> int:
        """Replicas that count against the capacity now."""

    def set_exit_handler(self, handler: ExitHandler) -> None: ...

    async def start(self, launch: Launch) -> Running:
        """Start a replica; raises NoCapacity or StartFailed. Returns once it was spawned."""

    async def stop(self, replica_id: str, grace: float) -> None:
        """Stop a replica (SIGTERM, then SIGKILL after ``grace``); returns when it is gone."""

    def adopt(self, launch: Launch, handle: dict[str, Any]) -> Running | None:
        """Take back a replica started before a restart, if it still runs; else None."""

    def logs(self, replica_id: str, tail: int) -> list[str]:
        """The last ``tail`` lines of a replica's output (empty if there are none)."""

    async def close(self) -> None:
        """Stop watching; leave replicas running (a restart adopts them)."""
