"""The analysis of a canary: a window of the gateway's own counts judged. PURE.

The reconciler samples the data plane's running totals per revision (requests answered,
5xx answers, requests per latency bucket) as a ``Traffic``; a step's window is the difference
between the sample taken when its weight was set and the latest one. ``judge`` reads the new
revision's error rate, and its p99 latency against the stable revision's over the same
window:

- fewer than ``min_requests`` of the new revision is ``wait`` (not enough data yet): never
  a pass;
- an error rate over ``max_error_rate``, a p99 over ``max_latency_ratio`` times the
  stable one's, or a p99 time to first token (streamed answers on model paths, same buckets)
  over ``max_ttft_ratio`` times the stable one's, is ``fail``, with the figures in the reason;
- anything else is ``pass``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..spec import AnalysisConfig

Outcome = Literal["pass", "fail", "wait"]


@dataclass(frozen=True, slots=True)
class Counts:
    """One revision's requests so far (running totals)."""

    requests: int = 0
    errors: int = 0
    """Answers with a 5xx status: the revision's own and the gateway's (502, 504)."""
    latency: tuple[int, ...] = ()
    """Requests per latency bucket of ``Traffic.bounds``, +Inf last."""
    ttft: tuple[int, ...] = ()
    """Streamed answers on model paths per time-to-first-token bucket of ``Traffic.bounds``;
    empty: none."""

    def since(self, before: Counts) -> Counts:
        """The requests counted after ``before``."""
        return Counts(
            self.requests - before.requests,
            self.errors - before.errors,
            _since(self.latency, before.latency),
            _since(self.ttft, before.ttft),
        )


def _since(now: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    """Bucket counts ``now`` less those ``before`` (of the same buckets)."""
    if before and len(before) == len(now):
        return tuple(a - b for a, b in zip(now, before, strict=True))
    return now


NOTHING = Counts()


@dataclass(frozen=True, slots=True)
class Traffic:
    """A sample of a service's request counts per revision, taken at ``at``."""

    at: float = 0.0
    bounds: tuple[float, ...] = ()
    """The upper bounds of the latency buckets (seconds)."""
    revisions: tuple[tuple[int, Counts], ...] = ()

    def of(self, revision: int | None) -> Counts:
        for rev, counts in self.revisions:
            if rev == revision:
                return counts
        return NOTHING


NO_TRAFFIC = Traffic()


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    reason: str
    """``analysis: error rate 7.5% > 1% over 412 requests at weight 25``."""
    requests: int = 0
    error_rate: float | None = None
    latency_ratio: float | None = None
    ttft_ratio: float | None = None


def _p99s(
    new: tuple[int, ...], old: tuple[int, ...], bounds: tuple[float, ...]
) -> tuple[float, float] | None:
    """The new and the stable revision's p99 of one histogram, if both have one and the
    stable one's is above 0 (a ratio to it means something)."""
    mine = quantile(new, bounds, 0.99)
    theirs = quantile(old, bounds, 0.99)
    if mine is None or theirs is None or theirs <= 0:
        return None
    return mine, theirs


def quantile(latency: tuple[int, ...], bounds: tuple[float, ...], q: float) -> float | None:
    """The ``q`` quantile of requests counted per bucket, interpolated within its bucket (as
    Prometheus' ``histogram_quantile``); None with no request. Beyond the last bound: that
    bound."""
    total = sum(latency)
    if total <= 0 or not bounds:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(latency):
        if count and seen + count >= rank:
            if i >= len(bounds):
                return bounds[-1]
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / count
        seen += count
    return bounds[-1]


def percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%".replace(".0%", "%")


def judge(
    config: AnalysisConfig,
    since: Traffic,
    now: Traffic,
    revision: int,
    stable: int | None,
    weight: int,
) -> Verdict:
    """The new ``revision`` judged over the window from ``since`` to ``now``, against
    ``stable`` (the revision the rollout started from; None: no latency comparison)."""
    new = now.of(revision).since(since.of(revision))
    n = new.requests
    where = f"over {n} requests at weight {weight}"
    if n < config.min_requests:
        return Verdict(
            "wait", f"analysis: not enough data yet ({n} of {config.min_requests} requests)", n
        )
    rate = new.errors / n
    limit = percent(config.max_error_rate)
    if rate > config.max_error_rate:
        return Verdict("fail", f"analysis: error rate {percent(rate)} > {limit} {where}", n, rate)
    old = now.of(stable).since(since.of(stable)) if stable is not None else None
    ratio: float | None = None
    if config.max_latency_ratio is not None and old is not None:
        p99s = _p99s(new.latency, old.latency, now.bounds)
        if p99s is not None:
            mine, theirs = p99s
            ratio = mine / theirs
            if ratio > config.max_latency_ratio:
                return Verdict(
                    "fail",
                    f"analysis: p99 latency {mine * 1000:.0f} ms is {ratio:.2f}x the stable "
                    f"revision's {theirs * 1000:.0f} ms > {config.max_latency_ratio:g}x {where}",
                    n,
                    rate,
                    ratio,
                )
    first: float | None = None
    if config.max_ttft_ratio is not None and old is not None:
        p99s = _p99s(new.ttft, old.ttft, now.bounds)
        if p99s is not None:
            mine, theirs = p99s
            first = mine / theirs
            if first > config.max_ttft_ratio:
                return Verdict(
                    "fail",
                    f"analysis: p99 time to first token {mine * 1000:.0f} ms is {first:.2f}x "
                    f"the stable revision's {theirs * 1000:.0f} ms > "
                    f"{config.max_ttft_ratio:g}x {where}",
                    n,
                    rate,
                    ratio,
                    first,
                )
    figures = f"error rate {percent(rate)} <= {limit}"
    if ratio is not None:
        figures += f", p99 {ratio:.2f}x the stable revision's"
    if first is not None:
        figures += f", p99 time to first token {first:.2f}x the stable revision's"
    return Verdict("pass", f"analysis: {figures} {where}", n, rate, ratio, first)
