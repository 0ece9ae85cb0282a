"""Request counts as plain data: latency buckets, and a worker's tally of its requests.

``Buckets`` counts observations per latency bucket, read at scrape time by ``metrics``
(which turns them into Prometheus families) and sent as plain data by a worker: its
``RequestTally`` counts what ``GatewayMetrics`` would and hands a ``Tally`` to the
controller's process now and then (``workers.ipc``). No Prometheus here, no lock: only the
event loop counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from mypy_extensions import i64

from ..pool.events import ClientTimeout, RequestRecord, Tokens
from ..pool.upstream import by_fields

LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


def latency_bucket(value: float) -> int:
    """``bisect_left(LATENCY_BUCKETS, value)``: the index of the first bucket that holds
    ``value`` (``le``), ``len(LATENCY_BUCKETS)`` for +Inf.

    Written out, compiled it compares machine floats: ``bisect_left`` was a look-up of its
    name in the module's dict and a float boxed, at each call, twice a request. From the
    smallest bound up, not halving: a proxied request's latency is most often in the first
    buckets (one comparison for one under a millisecond, where halving made four)."""
    i = 0
    for bound in LATENCY_BUCKETS:
        if not bound < value:  # as bisect_left compares: NaN is in the first bucket
            return i
        i += 1
    return i


class Buckets:
    """Observations counted per bucket, read at scrape time (``metrics``' module docstring).

    The request observers count into it with ``count`` (the bucket, ``latency_bucket``:
    value <= bound, and the value). Consecutive observations in one bucket, as under steady
    load, are counted as a machine integer (``_run``) and added to ``counts`` when another
    bucket comes or the counts are read (``settled``): an int past 256 in the list is an
    object made at every increment. Only the event loop writes it; a scrape on the same
    loop reads a consistent state.
    """

    __slots__ = ("_at", "_run", "bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        """Per bucket, but for the run being counted: read them through ``settled``."""
        self.sum = 0.0
        self._at: i64 = 0
        """The bucket of the run of observations not yet in ``counts``."""
        self._run: i64 = 0

    def count(self, bucket: i64, value: float) -> None:
        """One observation of ``value``, in ``bucket``."""
        if bucket == self._at:
            self._run += 1
        else:
            run = self._run
            if run:
                self.counts[self._at] += run
            self._at = bucket
            self._run = 1
        self.sum += value

    def settled(self) -> list[int]:
        """``counts``, with the run being counted in them."""
        run = self._run
        if run:
            self.counts[self._at] += run
            self._run = 0
        return self.counts

    def counted(self) -> tuple[tuple[int, ...], float]:
        """The counts per bucket and the sum, as plain data to send."""
        return tuple(self.settled()), self.sum

    def merge(self, taken: tuple[tuple[int, ...], float]) -> None:
        """Add what ``counted`` gave (from a histogram with the same bounds)."""
        counts, total = taken
        mine = self.counts
        for i, count in enumerate(counts):
            mine[i] += count
        self.sum += total

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts per ``le``, +Inf last, as HistogramMetricFamily wants them."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.settled(), strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


TokensTaken = tuple[tuple[tuple[int, ...], float], tuple[tuple[int, ...], float], int]
"""A revision's token counts as plain data: times to first token and inter-token latencies
(``Buckets.counted``), output tokens."""


Outcome = tuple[str, int | None, int, str | None, tuple[str, ...]]
"""(service, revision, status, error, retry reasons): requests alike for every series."""


def outcome(r: RequestRecord) -> Outcome:
    """A record's ``Outcome``."""
    return (r.service, r.revision, r.status, r.error, r.retry_reasons)


@dataclass(frozen=True, slots=True)
class Tally:
    """A worker's request counts since its last report, as plain data to send."""

    outcomes: dict[Outcome, int]
    durations: dict[tuple[str, int | None], tuple[tuple[int, ...], float]]
    ttfb: dict[str, tuple[tuple[int, ...], float]]
    tokens: dict[tuple[str, int | None], TokensTaken]
    h2: int = 0
    """Of the requests in ``outcomes``, those that came over HTTP/2."""
    grpc: dict[tuple[str, str], int] = field(default_factory=dict)
    """gRPC answers by (service, gRPC status)."""
    timeouts: dict[tuple[str, str], int] = field(default_factory=dict)
    """Clients given up on for slowness by (protocol, ``ClientTimeout``)."""

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return by_fields(self)

    def __bool__(self) -> bool:
        return bool(self.outcomes or self.timeouts)


class TokenTally:
    """The token counts of one revision's requests on a model path (``Tokens``): a
    worker's, sent as ``counted``, and the main process's (``RevisionSeries.tokens``)."""

    __slots__ = ("first_token", "gaps", "output")

    def __init__(self) -> None:
        self.first_token = Buckets(LATENCY_BUCKETS)
        self.gaps = Buckets(LATENCY_BUCKETS)
        self.output = 0

    def count(self, tokens: Tokens) -> None:
        ttft = tokens.ttft
        if ttft is not None:
            self.first_token.count(latency_bucket(ttft), ttft)
        gaps = tokens.gaps
        if gaps is not None:
            self.gaps.merge(gaps)
        output = tokens.output
        if output is not None:
            self.output += output

    def counted(self) -> TokensTaken:
        """The counts as plain data to send."""
        return self.first_token.counted(), self.gaps.counted(), self.output

    def merge(self, taken: TokensTaken) -> None:
        """Add what ``counted`` gave."""
        first_token, gaps, output = taken
        self.first_token.merge(first_token)
        self.gaps.merge(gaps)
        self.output += output


class RequestTally:
    """A ``RequestObserver`` for a worker process: counts what ``GatewayMetrics`` would.

    The controller's process serves ``/metrics``; each worker counts its requests here and
    sends ``take()`` to it now and then, where ``GatewayMetrics.merge`` adds them. The series
    rules (no stale series, no series brought back) are applied there, once.
    """

    __slots__ = ("durations", "grpc", "h2", "outcomes", "timeouts", "tokens", "ttfb")

    def __init__(self) -> None:
        self.outcomes: dict[Outcome, int] = {}
        self.durations: dict[tuple[str, int | None], Buckets] = {}
        self.ttfb: dict[str, Buckets] = {}
        self.h2 = 0
        self.grpc: dict[tuple[str, str], int] = {}
        self.tokens: dict[tuple[str, int | None], TokenTally] = {}
        self.timeouts: dict[tuple[str, str], int] = {}

    def on_request(self, record: RequestRecord) -> None:
        if record.http_version == "2":
            self.h2 += 1
            status = record.grpc_status
            if status is not None:
                grpc = self.grpc
                answers = (record.service, status)
                grpc[answers] = grpc.get(answers, 0) + 1
        key = outcome(record)
        outcomes = self.outcomes
        outcomes[key] = outcomes.get(key, 0) + 1
        series = (record.service, record.revision)
        histogram = self.durations.get(series)
        if histogram is None:
            histogram = self.durations[series] = Buckets(LATENCY_BUCKETS)
        duration = record.duration
        histogram.count(latency_bucket(duration), duration)
        ttfb = record.ttfb
        if ttfb is not None:
            histogram = self.ttfb.get(record.service)
            if histogram is None:
                histogram = self.ttfb[record.service] = Buckets(LATENCY_BUCKETS)
            histogram.count(latency_bucket(ttfb), ttfb)

    def on_model_request(self, record: RequestRecord, tokens: Tokens) -> None:
        self.on_request(record)
        series = (record.service, record.revision)
        tally = self.tokens.get(series)
        if tally is None:
            tally = self.tokens[series] = TokenTally()
        tally.count(tokens)

    def on_client_timeout(self, protocol: str, timeout: ClientTimeout) -> None:
        key = (protocol, timeout)
        self.timeouts[key] = self.timeouts.get(key, 0) + 1

    def take(self) -> Tally:
        """The counts since the last ``take``; counting starts again from zero."""
        tally = Tally(
            self.outcomes,
            {key: h.counted() for key, h in self.durations.items()},
            {key: h.counted() for key, h in self.ttfb.items()},
            {key: t.counted() for key, t in self.tokens.items()},
            self.h2,
            self.grpc,
            self.timeouts,
        )
        self.outcomes, self.durations, self.ttfb, self.tokens = {}, {}, {}, {}
        self.h2, self.grpc, self.timeouts = 0, {}, {}
        return tally

    def __repr__(self) -> str:
        return f"<RequestTally outcomes={len(self.outcomes)}>"
