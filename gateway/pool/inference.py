"""The pick of ``load_balancing: inference``: by each replica's load and the prompt's prefix.
PURE.

A replica's *load* is what it is busy with: the gateway's own in-flight count, plus what the
replica last reported running and waiting beyond what the gateway itself had in flight on it
then, past ``OTHERS_SLACK`` (``ReplicaLoad``, scraped beside the prober: other clients'
requests), plus its KV-cache use past ``KV_KNEE`` (``KV_WEIGHT`` requests at a full cache).
The gateway's own count is exact and current, a report is some tens of milliseconds old: a
report only adds what the gateway cannot see, and nothing while it agrees with the count. A
report older than its ``expires`` counts as none: the in-flight count alone.

With a prompt, the service pool says for each candidate how many leading blocks of the
prompt's prefix it was sent lately (``prefixes.Sent``: what its prefix cache likely holds, a
conversation's history or a system prompt). The request goes to the candidate with the most,
ties to the least loaded, then in turn among these, among those that, with this request, stay within
``max_load_factor`` times the mean load (bounded-load consistent hashing: Mirrokni, Thorup
and Zadimoghaddam, 2018): a conversation stays with the cache that holds its turns so far,
and a new one goes where its system prompt is, unless that replica is a hot spot. A prompt
that no candidate within the bound holds a block of goes to the least loaded, ties in turn,
as ``least_outstanding`` would place it, so prompts that share nothing are balanced as by
load alone; so does a request without a prompt, or with every holder over the bound.

Invariants: the pick is one of the candidates (routable, already filtered); with the in-flight
counts alone, a pick by prefix keeps ``load + 1 <= ceil(c * (total + 1) / n)``; a candidate
that holds more blocks than the pick's is over that bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from .upstream import Upstream, by_fields

KV_WEIGHT: Final = 4.0
"""A full KV cache weighs as much as this many requests: the replica will queue or preempt."""
KV_KNEE: Final = 0.8
"""KV-cache use up to this share weighs nothing, then rises to ``KV_WEIGHT`` at a full cache
(the Gateway API Inference Extension's endpoint picker also takes a replica under 80 % as
having room). Below it the figure only echoes the running count of the last report, and as a
tie-break among equal in-flight counts it favoured the replica that reported fewer requests:
the one that took the most since, whose requests are the newest, the furthest from ending."""
OTHERS_SLACK: Final = 1.0
"""Reported requests beyond the gateway's own count that still count as none: a request ended
or begun between the replica's answer and the reading of the count is no other client's."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica said of its load, at ``at`` (monotonic seconds)."""

    waiting: float
    """Requests queued, not begun."""
    running: float
    """Requests being served (prefill or decode)."""
    kv_cache: float
    """The share of its KV cache in use, 0 to 1."""
    at: float
    expires: float
    """When the report stops counting (``at`` plus a few scrape intervals)."""
    own: float = 0.0
    """The gateway's own requests in flight on the replica when it answered (every worker's)."""

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return by_fields(self)  # sent to worker processes (``workers.ipc.Loads``)


def load_of(inflight: int, report: ReplicaLoad | None, now: float) -> float:
    """A replica's load (the module docstring)."""
    if report is None or now >= report.expires:
        return float(inflight)
    others = max(0.0, report.running + report.waiting - report.own - OTHERS_SLACK)
    kv = min(max(report.kv_cache, 0.0), 1.0)
    return inflight + others + KV_WEIGHT * max(0.0, kv - KV_KNEE) / (1.0 - KV_KNEE)


def pick(
    candidates: Sequence[Upstream],
    inflight: Mapping[str, int],
    reports: Mapping[str, ReplicaLoad],
    now: float,
    cursor: int,
    matched: Sequence[int] = (),
    max_load_factor: float = 2.0,
) -> Upstream | None:
    """The replica for a request among ``candidates`` (None if there are none): the one
    sent most of the prompt's leading blocks (``matched``, one count per candidate) within
    the load bound, ties to the least loaded; else the least loaded (ties in turn)."""
    n = len(candidates)
    if n == 0:
        return None
    loads = [load_of(inflight.get(u.id, 0), reports.get(u.id), now) for u in candidates]
    if len(matched) == n and max(matched) > 0:
        capacity = math.ceil(max_load_factor * (sum(loads) + 1) / n)
        held, least = 0, math.inf
        for i in range(n):
            m, load = matched[i], loads[i]
            if m > 0 and load + 1 <= capacity and (m > held or (m == held and load < least)):
                held, least = m, load
        if held > 0:
            tied = [i for i in range(n) if matched[i] == held and loads[i] == least]
            return candidates[tied[cursor % len(tied)]]
    best = cursor % n
    for step in range(1, n):
        i = (cursor + step) % n
        if loads[i] < loads[best]:
            best = i
    return candidates[best]
