"""Consistent hashing of request keys onto upstreams: a ring of virtual nodes. PURE.

Each upstream is put at ``VNODES`` points of a 64-bit ring (the hash of ``"<id>#<n>"``); a
key goes to the owner of the first point at or after the key's hash, going round. Two
properties follow, and the tests hold the ring to them on pools of 2 to 50 upstreams:

- spread: each upstream owns about ``1 / n`` of the keys (with 160 points each, within a
  few tens of percent of it);
- movement: when an upstream leaves, only the keys it owned move (each to the next point's
  owner); every other key stays where it was, so warm caches stay warm. One that joins
  takes about ``1 / (n + 1)`` of the keys, and from every other upstream a little.

``lookup`` can skip upstreams (tried already, or full under a concurrency cap): the key
then goes on round the ring to the next owner not skipped, the same one every time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Container, Sequence
from typing import Final

VNODES: Final = 160
"""Points per upstream: the spread's deviation shrinks as 1 / sqrt(VNODES)."""


def key_hash(data: bytes) -> int:
    """A key's place on the ring: 64 bits of BLAKE2b (stable across processes and runs,
    unlike ``hash()``, so every worker sends a key to the same upstream)."""
    import hashlib  # here: a worker that hashes no key imports no digests

    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    """The points of ``ids`` on the ring, sorted, and who owns each."""

    __slots__ = ("ids", "owners", "points")

    def __init__(self, ids: Sequence[str], vnodes: int = VNODES) -> None:
        self.ids = tuple(ids)
        placed = sorted(
            (key_hash(f"{uid}#{n}".encode()), uid) for uid in self.ids for n in range(vnodes)
        )
        self.points = [point for point, _ in placed]
        self.owners = [uid for _, uid in placed]

    def lookup(self, key: int, skip: Container[str] = ()) -> str | None:
        """The owner of ``key`` (a ``key_hash``), the next one round not in ``skip``; None if
        every upstream is skipped (or there is none)."""
        points = self.points
        n = len(points)
        if not n:
            return None
        at = bisect_left(points, key)
        owners = self.owners
        for i in range(n):
            uid = owners[(at + i) % n]
            if uid not in skip:
                return uid
        return None

    def owners_from(self, key: int) -> list[str]:
        """Every upstream in the order ``key`` meets them going round from its place: its
        owner first (``lookup(key)``), then the owner ``lookup`` gives with that one skipped,
        and so on."""
        points = self.points
        n = len(points)
        at = bisect_left(points, key) if n else 0
        owners = self.owners
        seen: set[str] = set()
        out: list[str] = []
        total = len(self.ids)
        for i in range(n):
            uid = owners[(at + i) % n]
            if uid not in seen:
                seen.add(uid)
                out.append(uid)
                if len(out) == total:
                    break
        return out

    def __repr__(self) -> str:
        return f"<Ring upstreams={len(self.ids)} points={len(self.points)}>"
