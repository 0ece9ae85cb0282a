"""What a service's pool publishes: a frozen ``PoolSnapshot`` of its upstreams (the routable
ones precomputed for the hot path), and the traffic ``Split`` by revision a canary sets.

Every change to a pool builds a new snapshot and swaps one reference, so readers need no lock
and a snapshot crosses to a worker process as it is (``__reduce__``: by fields).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .upstream import Upstream, by_fields


@dataclass(frozen=True, slots=True)
class Split:
    """Traffic split by revision (a canary, a blue/green switch): ``weight`` percent of the
    requests go to the routable upstreams of ``revision`` (``chosen``), the rest to the other
    routable ones (``rest``), whatever the replica counts; then the service's policy picks
    among them. A side with nothing routable gives its share to the other: a weight never
    makes a 503. Both sides are worked out once per snapshot, so a pick only draws."""

    revision: int
    weight: int
    chosen: tuple[Upstream, ...] = ()
    rest: tuple[Upstream, ...] = ()
    threshold: float = 0.0
    """``weight / 100``: a draw in [0, 1) below it takes ``chosen``."""

    @classmethod
    def of(cls, revision: int, weight: int, routable: Iterable[Upstream] = ()) -> Split:
        chosen: list[Upstream] = []
        rest: list[Upstream] = []
        for upstream in routable:
            (chosen if upstream.revision == revision else rest).append(upstream)
        return cls(revision, weight, tuple(chosen), tuple(rest), weight / 100)

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return by_fields(self)

    def group(self, draw: float) -> tuple[Upstream, ...]:
        """The upstreams a request with ``draw`` (uniform in [0, 1)) goes to."""
        if draw < self.threshold:
            return self.chosen or self.rest
        return self.rest or self.chosen


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A service's upstreams at one moment. ``routable`` is precomputed for the hot path."""

    service: str
    version: int
    upstreams: tuple[Upstream, ...] = ()
    routable: tuple[Upstream, ...] = ()
    failure: str = ""
    """Why the service has nothing to route to, as the controller said (a cold start that
    failed): while it stands and nothing is routable, requests get 503 with it at once."""
    split: Split | None = None
    """The traffic split by revision the controller set; None: by the policy alone."""

    @classmethod
    def of(
        cls,
        service: str,
        version: int,
        upstreams: Iterable[Upstream],
        failure: str = "",
        split: tuple[int, int] | None = None,
    ) -> PoolSnapshot:
        """``split``: (revision, weight) to split the routable upstreams by."""
        ups = tuple(upstreams)
        routable = tuple(u for u in ups if u.routable)
        by = None if split is None else Split.of(split[0], split[1], routable)
        return cls(service, version, ups, routable, failure, by)

    @property
    def weights(self) -> tuple[int, int] | None:
        """(revision, weight) of the split, or None."""
        split = self.split
        return None if split is None else (split.revision, split.weight)

    def of_revision(self, revision: int) -> tuple[Upstream, ...]:
        """The routable upstreams of ``revision`` (a preview route's)."""
        return tuple(u for u in self.routable if u.revision == revision)

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return by_fields(self)

    def get(self, upstream_id: str) -> Upstream | None:
        for upstream in self.upstreams:
            if upstream.id == upstream_id:
                return upstream
        return None

    def counts(self) -> dict[str, int]:
        """How many upstreams are in each state (for 503 bodies and status)."""
        out: dict[str, int] = {}
        for upstream in self.upstreams:
            out[upstream.state] = out.get(upstream.state, 0) + 1
        return out
