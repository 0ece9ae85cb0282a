"""The admin API's routes: a method and a path template to a handler.

A template is literal segments and ``{name}`` segments, each of which matches one whole
non-empty segment of the request's path (percent-decoded, so ``%2F`` stays inside its
segment) and is handed to the handler in ``match_info``. No template may match the same paths
as another with the same method: the table is checked when a route is added.

A path no template matches is ``HTTPError`` 404; one that matches only with another method is
405 with ``Allow`` naming the methods it takes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from .web import Handler, HTTPError

_PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    template: str
    handler: Handler
    segments: tuple[str | None, ...]
    """Each segment of the template: its literal text, or None for a parameter."""
    names: tuple[str, ...]

    def match(self, segments: list[str]) -> dict[str, str] | None:
        if len(segments) != len(self.segments):
            return None
        values = []
        for mine, theirs in zip(self.segments, segments, strict=True):
            if mine is None:
                if not theirs:
                    return None
                values.append(unquote(theirs))
            elif unquote(theirs) != mine:
                return None
        return dict(zip(self.names, values, strict=True))


def _compile(method: str, template: str, handler: Handler) -> Route:
    if not template.startswith("/"):
        raise ValueError(f"a route's path starts with '/': {template!r}")
    segments: list[str | None] = []
    names: list[str] = []
    for part in template[1:].split("/"):
        parameter = _PARAMETER.fullmatch(part)
        if parameter is not None:
            segments.append(None)
            names.append(parameter.group(1))
        elif "{" in part or "}" in part:
            raise ValueError(f"a route's parameter is a whole segment: {template!r}")
        else:
            segments.append(part)
    return Route(method.upper(), template, handler, tuple(segments), tuple(names))


class Router:
    """The route table, in the order routes were added."""

    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add_route(self, method: str, template: str, handler: Handler) -> Route:
        route = _compile(method, template, handler)
        for other in self._routes:
            if other.method == route.method and other.segments == route.segments:
                raise ValueError(f"two routes for {route.method} {template}")
        self._routes.append(route)
        return route

    def routes(self) -> list[Route]:
        return list(self._routes)

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """The handler of ``method`` on ``path`` (as sent: still percent-encoded) and the
        values of its parameters."""
        segments = path[1:].split("/") if path.startswith("/") else [path]
        allowed: list[str] = []
        for route in self._routes:
            values = route.match(segments)
            if values is None:
                continue
            if route.method == method:
                return route.handler, values
            allowed.append(route.method)
        shown = unquote(path)
        if allowed:
            methods = ", ".join(sorted(set(allowed)))
            raise HTTPError(
                405,
                f"{method} is not allowed on {shown} (allowed: {methods})",
                headers={"Allow": methods},
            )
        raise HTTPError(404, f"no route {method} {shown}")
