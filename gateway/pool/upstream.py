"""An upstream: the data plane's view of one replica. PURE.

Invariant: an upstream is *routable* iff it is healthy, active (not draining) and not ejected.
No request ever goes to an upstream that is not routable; a new upstream starts ``unknown``
and so receives nothing until its probes pass (health-gated admission).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..config import ProbeConfig


class Health(StrEnum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class AdminState(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"


def by_fields(record: Any) -> tuple[type, tuple[object, ...]]:
    """``__reduce__`` of a frozen dataclass sent between processes: its class, then its
    fields in order. Compiled with mypyc, the default unpickling sets each attribute, which
    the frozen ``__setattr__`` refuses."""
    fields = dataclasses.fields(record)
    return type(record), tuple(getattr(record, f.name) for f in fields if f.init)


def address_of(host: str, port: int) -> str:
    """``host:port`` as an authority writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class Upstream:
    """One address of one service. Immutable: every change makes a new object."""

    id: str
    service: str
    host: str
    port: int
    revision: int = 0
    weight: int = 1
    health: Health = Health.UNKNOWN
    admin: AdminState = AdminState.ACTIVE
    ejected: bool = False
    probes: tuple[ProbeConfig, ...] = ()
    """Probes of this upstream's revision; empty means the service's probes."""
    address: str = dataclasses.field(init=False, repr=False, compare=False)
    """``host:port`` (``address_of``), made with the upstream: the key of the connections
    kept to it (``Connector.idle``), which a request looks up without making one."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", address_of(self.host, self.port))

    @property
    def routable(self) -> bool:
        return (
            self.health is Health.HEALTHY and self.admin is AdminState.ACTIVE and not self.ejected
        )

    @property
    def state(self) -> str:
        """One word for metrics and status: draining and ejected win over health."""
        if self.admin is AdminState.DRAINING:
            return "draining"
        if self.ejected:
            return "ejected"
        return self.health.value

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return by_fields(self)

    def replace(self, **changes: object) -> Upstream:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
