"""Which certificate answers a TLS server name (SNI). PURE.

A certificate covers the DNS names of its subjectAltName (its subject's common name when it
has none). A name is matched exactly first, then against a wildcard one label deep
(``*.example.com`` covers ``a.example.com``, neither ``example.com`` nor ``a.b.example.com``,
as RFC 6125 section 6.4.3 has clients check). Names are compared in lower case without a
trailing dot; an IP address or an empty name matches nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


def normalise(name: str) -> str:
    return name.strip().lower().rstrip(".")


def wildcard_suffix(name: str) -> str | None:
    """``*.example.com`` -> ``example.com``; None for a name that is no wildcard."""
    if name.startswith("*.") and len(name) > 2 and "*" not in name[2:]:
        return name[2:]
    return None


@dataclass(frozen=True, slots=True)
class NameIndex(Generic[T]):
    """Certificates by the names they cover: the first to claim a name keeps it."""

    exact: Mapping[str, T] = field(default_factory=dict)
    wildcard: Mapping[str, T] = field(default_factory=dict)
    """By the suffix a wildcard covers (``example.com`` for ``*.example.com``)."""

    @classmethod
    def build(cls, entries: Iterable[tuple[Iterable[str], T]]) -> NameIndex[T]:
        exact: dict[str, T] = {}
        wildcard: dict[str, T] = {}
        for names, value in entries:
            for raw in names:
                name = normalise(raw)
                suffix = wildcard_suffix(name)
                if suffix is not None:
                    wildcard.setdefault(suffix, value)
                elif name:
                    exact.setdefault(name, value)
        return cls(exact, wildcard)

    def find(self, server_name: str | None) -> T | None:
        """The certificate for ``server_name``: exact, then wildcard; None when none covers it."""
        if not server_name:
            return None
        name = normalise(server_name)
        found = self.exact.get(name)
        if found is not None:
            return found
        _, dot, parent = name.partition(".")
        if dot and parent:
            return self.wildcard.get(parent)
        return None
