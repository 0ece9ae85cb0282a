"""The route table: which service a request belongs to. PURE.

A route matches by Host (exact names and ``*.suffix`` wildcards, case-insensitive, port
ignored) and/or by path prefix on segment boundaries (``/api`` matches ``/api`` and
``/api/x``, not ``/apix``). Among matching routes: an exact host beats a wildcard, a longer
wildcard beats a shorter one, a host match beats a route with no hosts, and then the longest
path prefix wins. Paths are normalised (``.``/``..`` segments resolved, ``//`` folded) before
matching, and the same normalised path is what ``forward_path`` forwards, so a prefix can
never be escaped with ``/svc/../admin``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import quote, unquote, unquote_to_bytes

from ..config import RouteConfig


@dataclass(frozen=True, slots=True)
class Route:
    service: str
    config: RouteConfig


_Candidates = tuple[tuple[str | None, Route], ...]
"""The routes a host matches, best first, each with the path prefix it asks for."""
HOSTS_CACHED: Final = 1024
"""Host header values whose candidate routes a table keeps (then it starts over)."""


@dataclass(frozen=True, slots=True)
class RouteTable:
    routes: tuple[Route, ...] = ()
    _by_host: dict[str, _Candidates] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Candidates per Host header value as it came: a table is immutable (a change makes a
    new one), so what a host matches is worked out once, not per request."""

    @classmethod
    def build(cls, routes: Iterable[Route]) -> RouteTable:
        return cls(tuple(routes))

    def candidates(self, host: str) -> _Candidates:
        """The routes ``host`` (a Host header value) matches, best first; ties in table
        order. A route matches a path if it has no prefix or ``prefix_matches`` it."""
        found = self._by_host.get(host)
        if found is None:
            name = strip_host(host)
            ranked = []
            for route in self.routes:
                rank = _host_rank(route.config.hosts, name)
                if rank is not None:
                    prefix = route.config.path_prefix
                    ranked.append(((rank, len(prefix) if prefix else 0), prefix, route))
            ranked.sort(key=lambda item: item[0], reverse=True)  # stable: ties keep order
            found = tuple((prefix, route) for _, prefix, route in ranked)
            if len(self._by_host) >= HOSTS_CACHED:
                self._by_host.clear()
            self._by_host[host] = found
        return found


_BAD_PERCENT: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")


def path_problem(raw_path: str) -> str | None:
    """Why the raw request target's path must be refused with 400, or None."""
    path = raw_path.partition("?")[0].partition("#")[0]
    if _BAD_PERCENT.search(path):
        return "a '%' in the path is not followed by two hex digits"
    try:
        decoded = unquote_to_bytes(path).decode()
    except UnicodeDecodeError:
        return "the path's percent-encoded bytes are not UTF-8"
    if "\\" in decoded:
        return "the path holds a backslash"
    if any(c < " " or c == "\x7f" for c in decoded):
        return "the path holds a control character"
    return None


_SAFE: Final = "/:@!$&'()*+,;=~"
"""Kept as they are when a decoded path is quoted again (yarl's choice for paths)."""


def split_target(target: str) -> tuple[str, str, bool]:
    """A request target -> (normalised, percent-decoded path; raw query; ``plain``).

    ``plain``: the raw path was already normal and held no escape, so it can be forwarded as
    it came (the hot path skips decoding and quoting). An absolute-form target
    (``http://host/path``) is reduced to its path.
    """
    if not target.startswith("/"):
        if "://" in target:
            rest = target.partition("://")[2]
            slash = rest.find("/")
            target = rest[slash:] if slash != -1 else "/"
    path, _, query = target.partition("?")
    path = path.partition("#")[0]
    if (
        path.startswith("/")
        and "%" not in path
        and "/." not in path
        and "//" not in path
        and "\\" not in path
    ):
        return path, query, True
    return normalize_path(unquote(path)), query, False


def quote_path(path: str) -> str:
    """A decoded path as it goes on the wire."""
    return quote(path, safe=_SAFE)


def normalize_path(path: str) -> str:
    """Resolve dot segments and fold repeated slashes; keep a trailing slash."""
    if not path.startswith("/"):
        path = "/" + path
    normal = posixpath.normpath(path)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    if path.endswith("/") and normal != "/":
        normal += "/"
    return normal


def _host_rank(hosts: tuple[str, ...], host: str) -> int | None:
    """How well ``host`` matches: higher is better, None is no match. No hosts: rank 0."""
    if not hosts:
        return 0
    best: int | None = None
    for pattern in hosts:
        if pattern.startswith("*."):
            suffix = pattern[1:]
            if host.endswith(suffix) and len(host) > len(suffix):
                rank = 1 + len(suffix)
                best = rank if best is None else max(best, rank)
        elif pattern == host:
            return 10_000
    return best


def _prefix_matches(prefix: str, path: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def strip_host(host: str) -> str:
    """The Host header without port and trailing dot, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end != -1 else host
    return host.rsplit(":", 1)[0].rstrip(".") if ":" in host else host.rstrip(".")


def resolve(table: RouteTable, host: str, path: str) -> Route | None:
    """The best route for ``host`` and the normalised ``path``, or None."""
    for prefix, route in table.candidates(host):
        if prefix is None or _prefix_matches(prefix, path):
            return route
    return None


def forward_path(route: Route, path: str) -> str:
    """The path sent upstream: ``path`` (normalised) with the prefix stripped if asked."""
    prefix = route.config.path_prefix
    if not route.config.strip_prefix or prefix is None or prefix == "/":
        return path
    rest = path[len(prefix) :]
    return rest if rest.startswith("/") else "/" + rest
