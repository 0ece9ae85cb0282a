"""Where a request goes: its service, its normalised path and the target sent upstream.

``Routes.resolve`` applies ``router`` to a Host and a request target and keeps what it found
for the route table it found it in: most traffic asks for the same few targets again and
again. A target that cannot be served raises ``Unroutable``: the 400 or 404 it gets, and
the path its record names.
"""

from __future__ import annotations

from typing import Final

from ..errors import BadRequest, GatewayError, NoRoute
from ..pool import router

ROUTED_CACHED: Final = 4096
"""(Host, target) pairs whose route ``Routes`` keeps (then it starts over)."""
ROUTED_TARGET_MAX: Final = 512
"""Longer targets are routed anew each time: the cache stays small."""

Routed = tuple[str, str, bytes]
"""(service, normalised path, request target sent upstream)."""


class Unroutable(Exception):
    """A request target that cannot be served: ``error`` is its answer, ``path`` its path as
    far as it was read."""

    def __init__(self, error: GatewayError, path: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.path = path


def no_route(host: bytes, path: str) -> NoRoute:
    name = host.decode("latin-1")
    return NoRoute(f"no route for host {name!r} and path {path!r}", host=name, path=path)


def route(routes: router.RouteTable, host: bytes, target: bytes) -> Routed:
    """Where ``target`` on ``host`` goes, by ``routes``; raises ``Unroutable``."""
    text = target.decode("latin-1")
    path, query, plain = router.split_target(text)
    problem = None if plain else router.path_problem(text)
    if problem is not None:
        raise Unroutable(BadRequest(f"the request is refused: {problem}"), path)
    found = router.resolve(routes, host.decode("latin-1"), path)
    if found is None:
        raise Unroutable(no_route(host, path), path)
    forward = router.forward_path(found, path)
    if not plain:
        forward = router.quote_path(forward)
    wire = (f"{forward}?{query}" if query else forward).encode("latin-1")
    return found.service, path, wire


class Routes:
    """``route`` with a memory of recent answers, for one route table at a time."""

    __slots__ = ("_for", "_routed")

    def __init__(self) -> None:
        self._routed: dict[tuple[bytes, bytes], Routed] = {}
        self._for: router.RouteTable | None = None

    def resolve(self, routes: router.RouteTable, host: bytes, target: bytes) -> Routed:
        """Where ``target`` on ``host`` goes; raises ``Unroutable``."""
        if routes is not self._for:
            self._routed.clear()  # a new route table: what was worked out may differ
            self._for = routes
        key = (host, target)
        routed = self._routed.get(key)
        if routed is None:
            routed = route(routes, host, target)
            if len(target) <= ROUTED_TARGET_MAX:
                if len(self._routed) >= ROUTED_CACHED:
                    self._routed.clear()
                self._routed[key] = routed
        return routed
