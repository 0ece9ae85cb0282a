"""The static backend: replicas that another system runs, at addresses given in the spec.

Starting a replica hands it an address of its template; stopping it gives the address back.
Nothing is run and nothing exits on its own: whether a static replica serves is for the probes
to find out.

Invariant: an address (host and port, as ``gateway.parse_address`` reads it) is held by at most
one live replica of a service, whatever its revision, so no upstream is ever in a pool twice.
Services do not compete for addresses: two services may route to one upstream (one with
auth, one rate limited), each through a replica of its own. Capacity is per service and
template, not per backend: ``capacity`` is None, and ``start`` raises NoCapacity when every
address of the launch's template is held by the service's other replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway import parse_address

from ..errors import NoCapacity, StartFailed
from .base import Exit, ExitHandler, Launch, Running

if TYPE_CHECKING:
    from .base import Backend

NO_CAPACITY_RETRY_AFTER = 5.0
"""An address comes free only when a replica is stopped; there is no hurry to ask again."""

_Address = tuple[str, int]
_Held = tuple[str, _Address]
"""A service and one of its addresses."""


def _conforms(backend: StaticBackend) -> Backend:  # pragma: no cover - checked by mypy
    return backend


class StaticBackend:
    """Hands out the addresses of ``ReplicaTemplate.addresses``, one live replica of a
    service each."""

    name: str = "static"

    def __init__(self) -> None:
        self._holders: dict[_Held, str] = {}
        self._replicas: dict[str, _Held] = {}
        self._exit_handler: ExitHandler | None = None

    @property
    def capacity(self) -> int | None:
        """None: the limit is each template's own addresses."""
        return None

    @property
    def in_use(self) -> int:
        return len(self._replicas)

    def set_exit_handler(self, handler: ExitHandler) -> None:
        self._exit_handler = handler

    async def start(self, launch: Launch) -> Running:
        """The first address of the template that no live replica of the service holds."""
        rid = launch.replica_id
        if rid in self._replicas:
            raise StartFailed(f"replica {rid} is already running")
        addresses = _addresses(launch)
        if not addresses:
            raise StartFailed("the template has no static addresses")
        for address, text in addresses.items():
            if (launch.service, address) not in self._holders:
                return self._hold(rid, (launch.service, address), text)
        raise NoCapacity(
            f"no capacity: all {len(addresses)} static addresses in use",
            retry_after=NO_CAPACITY_RETRY_AFTER,
        )

    async def stop(self, replica_id: str, grace: float) -> None:
        """Give the address back and report the replica's end (``released``)."""
        held = self._replicas.pop(replica_id, None)
        if held is None:
            return
        del self._holders[held]
        if self._exit_handler is not None:
            self._exit_handler(Exit(replica_id, code=None, reason="released", requested=True))

    def adopt(self, launch: Launch, handle: dict[str, Any]) -> Running | None:
        """The replica's address again, if its template still lists it and no other live
        replica of its service holds it (None otherwise)."""
        rid = launch.replica_id
        text = handle.get("address")
        if not isinstance(text, str):
            return None
        try:
            wanted = parse_address(text)
        except ValueError:
            return None
        addresses = _addresses(launch)
        if wanted not in addresses:
            return None
        held = (launch.service, wanted)
        holder = self._holders.get(held)
        if holder is not None and holder != rid:
            return None
        if rid in self._replicas and self._replicas[rid] != held:
            return None
        return self._hold(rid, held, addresses[wanted])

    def logs(self, replica_id: str, tail: int) -> list[str]:
        """Another system runs the replica: no output here."""
        return []

    async def close(self) -> None:
        """Nothing to watch."""

    def __repr__(self) -> str:
        return f"<StaticBackend in_use={self.in_use} capacity=None>"

    def _hold(self, rid: str, held: _Held, text: str) -> Running:
        self._holders[held] = rid
        self._replicas[rid] = held
        _, (host, port) = held
        return Running(replica_id=rid, host=host, port=port, handle={"address": text})


def _addresses(launch: Launch) -> dict[_Address, str]:
    """The template's addresses, parsed, in order, without repeats (the first spelling wins)."""
    found: dict[_Address, str] = {}
    for text in launch.template.addresses:
        found.setdefault(parse_address(text), text)
    return found
