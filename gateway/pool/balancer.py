"""Load-balancing policies over the routable upstreams of a snapshot. PURE.

Each policy takes the candidates (already filtered to routable, never empty), the in-flight
count per upstream id, a ``random.Random`` owned by the caller and a monotonically growing
``cursor`` the caller increments per pick. None of them reads a clock or global random.

- ``round_robin``: weighted, in proportion to ``Upstream.weight``.
- ``least_outstanding``: fewest in-flight requests per unit of weight; ties rotate.
- ``p2c``: power of two random choices (weighted draw), the one with fewer in-flight wins.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from .upstream import Upstream

Policy = Callable[[Sequence[Upstream], Mapping[str, int], random.Random, int], Upstream]


def round_robin(
    candidates: Sequence[Upstream], inflight: Mapping[str, int], rng: random.Random, cursor: int
) -> Upstream:
    total = sum(u.weight for u in candidates)
    if total == len(candidates):
        return candidates[cursor % len(candidates)]
    slot = cursor % total
    for upstream in candidates:
        slot -= upstream.weight
        if slot < 0:
            return upstream
    return candidates[-1]


def least_outstanding(
    candidates: Sequence[Upstream], inflight: Mapping[str, int], rng: random.Random, cursor: int
) -> Upstream:
    n = len(candidates)
    best = candidates[cursor % n]
    best_load = inflight.get(best.id, 0) / best.weight
    for i in range(1, n):
        upstream = candidates[(cursor + i) % n]
        load = inflight.get(upstream.id, 0) / upstream.weight
        if load < best_load:
            best, best_load = upstream, load
    return best


def p2c(
    candidates: Sequence[Upstream], inflight: Mapping[str, int], rng: random.Random, cursor: int
) -> Upstream:
    if len(candidates) == 1:
        return candidates[0]
    weights = [u.weight for u in candidates]
    a, b = rng.choices(candidates, weights=weights, k=2)
    if a is b:
        b = candidates[
            (candidates.index(a) + 1 + rng.randrange(len(candidates) - 1)) % len(candidates)
        ]
    load_a = inflight.get(a.id, 0) / a.weight
    load_b = inflight.get(b.id, 0) / b.weight
    return a if load_a <= load_b else b


POLICIES: Final[Mapping[str, Policy]] = {
    "round_robin": round_robin,
    "least_outstanding": least_outstanding,
    "p2c": p2c,
    # ``hash`` hashes a request's key in the pool (``hashring``); a request without one:
    "hash": least_outstanding,
    # ``inference`` scores replicas in the pool (``inference``); a pick among a few (a
    # preview's revision, a sticky side):
    "inference": least_outstanding,
}


def pick(
    policy: str,
    candidates: Sequence[Upstream],
    inflight: Mapping[str, int],
    rng: random.Random,
    cursor: int,
) -> Upstream | None:
    """The upstream ``policy`` chooses among ``candidates``, or None if there are none."""
    if not candidates:
        return None
    return POLICIES[policy](candidates, inflight, rng, cursor)
