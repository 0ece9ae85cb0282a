"""The data plane's metrics as plain counts: what ``/metrics`` shows of the data plane.

``GatewayMetrics`` is a ``PoolSubscriber`` (upstream health and state, ejections), a
``ProbeObserver`` (probe outcomes and durations) and a ``RequestObserver`` (requests,
latencies, retries, requests by client protocol, gRPC statuses, clients given up on for
slowness). It keeps every series'
counts as plain ints and ``tally.Buckets``, and drops them by the rules below. No Prometheus
here: ``scrape.MetricsCollector`` turns the counts into metric families at scrape time, in
the main process only (a worker counts in a ``tally.RequestTally``, merged here).

Invariants:
- Label sets are bounded: service, revision, upstream id, a state, a probe result, a retry
  reason, a status class / gateway error code, a protocol or a gRPC code (0 to 16). Never a
  path, a host or a client address.
- No stale series: an upstream's series go when it leaves the pool, a service's when the
  service is removed, a revision's request series when its last upstream leaves. Results for
  an upstream or a service the metrics do not know (already removed) are not recorded, so
  they cannot bring a series back.
- Requests by client protocol are counted for HTTP/2 only (``h2_requests``); HTTP/1.x's are
  the rest of every request counted (``downstream_requests``), so that an HTTP/1.1 request
  pays one comparison for them, not a count of its own.
- The hot path (``on_request``) resolves no label and takes no lock: it bumps the counts of
  the revision's and the service's entries, found by one dict look-up. Even the ``code``
  label of a status (its class) is worked out at scrape time.
- What is not a count is read at scrape time: an upstream's up and state from the upstream
  as last heard of (the pool's events keep it), the in-flight counts from the pool.
"""

from __future__ import annotations

import bisect
from typing import Final

from ..pool.events import ClientTimeout, PoolEvent, ProbeResult, RequestRecord, Tokens
from ..pool.pool import Pool, RequestCounts
from ..pool.upstream import Upstream
from .status_codes import StatusCounts
from .tally import LATENCY_BUCKETS, Buckets, Tally, TokenTally, latency_bucket

UPSTREAM_STATES: Final[tuple[str, ...]] = ("unknown", "healthy", "unhealthy", "draining", "ejected")
"""The values of ``Upstream.state``: the one-hot ``gateway_upstream_state``."""

PROBE_RESULTS: Final[tuple[str, ...]] = ("success", "failure", "timeout")
PROTOCOLS: Final[tuple[str, ...]] = ("http/1.1", "h2")
"""The client's protocols, as the ``protocol`` label says them (HTTP/1.0 counts as 1.1)."""
RETRY_REASONS: Final = frozenset({"connect", "disconnect", "refused", "stale", "status"})
"""What the proxy puts in ``RequestRecord.retry_reasons``; anything else counts as ``other``."""

PROBE_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class UpstreamSeries:
    """The counts of one upstream in the pool, and the upstream as last heard of."""

    __slots__ = ("ejections", "probes", "revision", "upstream")

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        """Its ``routable`` and ``state`` are read at scrape time."""
        self.revision = upstream.revision
        self.probes: dict[str, int] = dict.fromkeys(PROBE_RESULTS, 0)
        self.ejections = 0


class ServiceSeries:
    """The counts of one service; per-revision ones live in ``revisions``.

    A pool service's series are all shown from the start, at 0. The no-route entry (``""``)
    shows only what counted something: no TTFB nor probes, and its counters once above 0.
    """

    __slots__ = (
        "connect_failures",
        "name",
        "no_routable",
        "probe_duration",
        "retries",
        "revisions",
        "ttfb",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.revisions: dict[int | None, RevisionSeries] = {}
        self.retries: dict[str, int] = {}
        """Attempts made again, by reason (made on first use)."""
        self.ttfb = Buckets(LATENCY_BUCKETS)
        self.probe_duration = Buckets(PROBE_BUCKETS)
        self.no_routable = 0
        self.connect_failures = 0

    def retry(self, reason: str, n: int) -> None:
        reason = reason if reason in RETRY_REASONS else "other"
        retries = self.retries
        retries[reason] = retries.get(reason, 0) + n


class RevisionSeries:
    """The request counts of one revision of a service; its series go with it."""

    __slots__ = ("answers", "duration", "label", "service", "tokens", "ttfb")

    def __init__(self, service: ServiceSeries, revision: int | None) -> None:
        self.answers = StatusCounts()
        """Its answers by ``code`` label to be."""
        self.service = service
        self.label = "" if revision is None else str(revision)
        self.duration = Buckets(LATENCY_BUCKETS)
        self.ttfb = service.ttfb
        """The service's (TTFB is per service), here to save ``on_request`` a look-up."""
        self.tokens: TokenTally | None = None
        """Its token counts, once a request on a model path came (only then shown)."""

    def token_series(self) -> TokenTally:
        tokens = self.tokens
        if tokens is None:
            tokens = self.tokens = TokenTally()
        return tokens


class GatewayMetrics:
    """The data plane's counts; call ``attach(pool)`` to follow a pool.

    Requests that matched no route are counted under ``service=""``.
    """

    def __init__(self) -> None:
        self.services: dict[str, ServiceSeries] = {"": ServiceSeries("")}
        """Service name -> its counts, in order of appearance (read at scrape time)."""
        self.upstreams: dict[tuple[str, str], UpstreamSeries] = {}
        """(service, upstream id) -> the counts of each upstream in the pool."""
        self.pool: Pool | None = None
        """The pool followed, None before ``attach``."""
        self._live: dict[tuple[str, int], int] = {}
        """(service, revision) -> upstreams of it in the pool."""
        self._requests: dict[tuple[str, int | None], RevisionSeries] = {}
        self._sweep: set[str] = set()
        """Services with a revision series but no upstream of that revision left."""
        self.unrecorded = 0
        """Records of services no longer in the pool, not recorded (they would be stale)."""
        self.retired = 0
        """Requests counted in revision series since dropped (``downstream_requests``)."""
        self.h2_requests = 0
        """Requests that came over HTTP/2, every one (recorded or not)."""
        self.grpc: dict[tuple[str, str], int] = {}
        """gRPC answers by (service, gRPC status), for the services in the pool."""
        self.client_timeouts: dict[tuple[str, str], int] = {}
        """Clients given up on for slowness by (protocol, ``ClientTimeout``)."""

    def attach(self, pool: Pool) -> None:
        """Follow ``pool``: take in what is in it now, subscribe, report its in-flight counts."""
        self.pool = pool
        for name, service in pool.services.items():
            self._service(name)
            for upstream in service.snapshot.upstreams:
                self._add(upstream)
        pool.subscribe(self)
        pool.request_counts = self.revision_counts

    def revision_counts(self, service: str) -> RequestCounts:
        """``service``'s requests so far per revision (the workers' as last merged): the
        counts a canary's analysis reads (``Pool.request_counts``)."""
        entry = self.services.get(service)
        out: dict[int, tuple[int, int, tuple[int, ...], tuple[int, ...]]] = {}
        if entry is None or not service:
            return LATENCY_BUCKETS, out
        for revision, series in list(entry.revisions.items()):
            if revision is None:
                continue
            total = errors = 0
            for key, count in series.answers.settled().items():
                total += count
                if int(key) >= 500:
                    errors += count
            tokens = series.tokens
            first_token = () if tokens is None else tuple(tokens.first_token.settled())
            out[revision] = (total, errors, tuple(series.duration.settled()), first_token)
        return LATENCY_BUCKETS, out

    # -- the pool -----------------------------------------------------------------------------

    def on_pool_event(self, event: PoolEvent) -> None:
        kind, upstream = event.kind, event.upstream
        if kind == "changed" and upstream is not None:
            series = self.upstreams.get((event.service, upstream.id))
            if series is not None:
                series.upstream = upstream
                if upstream.ejected and event.previous is not None and not event.previous.ejected:
                    series.ejections += 1
        elif kind == "added" and upstream is not None:
            self._service(event.service)
            self._add(upstream)
        elif kind == "removed" and upstream is not None:
            self._remove(event.service, upstream.id)
        elif kind == "service_set":
            self._service(event.service)
        elif kind == "service_removed":
            service = self.services.pop(event.service, None)
            if service is not None:
                for revision, entry in list(service.revisions.items()):
                    self._requests.pop((event.service, revision), None)
                    self.retired += sum(entry.answers.settled().values())
            for key in [k for k in self.grpc if k[0] == event.service]:
                del self.grpc[key]
            self._sweep.discard(event.service)
            for key in [k for k in self.upstreams if k[0] == event.service]:
                self._remove(*key)
        if event.service in self._sweep:
            self._sweep_revisions(event.service)

    def _service(self, name: str) -> ServiceSeries:
        service = self.services.get(name)
        if service is None:
            service = self.services[name] = ServiceSeries(name)
        return service

    def _add(self, upstream: Upstream) -> None:
        key = (upstream.service, upstream.id)
        if key in self.upstreams:
            return
        self.upstreams[key] = UpstreamSeries(upstream)
        live = (upstream.service, upstream.revision)
        self._live[live] = self._live.get(live, 0) + 1

    def _remove(self, service: str, upstream_id: str) -> None:
        series = self.upstreams.pop((service, upstream_id), None)
        if series is None:
            return
        live = (service, series.revision)
        left = self._live.get(live, 0) - 1
        if left > 0:
            self._live[live] = left
            return
        self._live.pop(live, None)
        self._drop_revision(service, series.revision)

    def _drop_revision(self, service: str, revision: int) -> None:
        entry = self._requests.pop((service, revision), None)
        if entry is not None:
            entry.service.revisions.pop(revision, None)
            self.retired += sum(entry.answers.settled().values())

    def _sweep_revisions(self, service: str) -> None:
        """Drop revision series recreated by requests that ended after their upstream left."""
        self._sweep.discard(service)
        entry = self.services.get(service)
        if entry is None:
            return
        for revision in list(entry.revisions):
            if revision is not None and (service, revision) not in self._live:
                self._drop_revision(service, revision)

    # -- probes -------------------------------------------------------------------------------

    def on_probe(self, result: ProbeResult) -> None:
        series = self.upstreams.get((result.service, result.upstream_id))
        if series is None:
            return  # not (or no longer) in the pool
        series.probes[result.outcome] += 1
        service = self.services.get(result.service)
        if service is not None:
            duration = result.duration
            bucket = bisect.bisect_left(PROBE_BUCKETS, duration)
            service.probe_duration.count(bucket, duration)

    # -- requests (hot path) ------------------------------------------------------------------

    def on_request(self, record: RequestRecord) -> None:
        if record.http_version == "2":
            self._h2(record.service, record.grpc_status)
        entry = self._requests.get((record.service, record.revision))
        if entry is None:
            entry = self._revision(record.service, record.revision)
            if entry is None:
                self.unrecorded += 1
                return
        error, reasons = record.error, record.retry_reasons
        if error is None and not reasons:
            # Most requests: only their status to count (``_count`` does the same, slower).
            entry.answers.answered(record.status)
        else:
            self._count(entry, record.status, error, reasons, 1)
        duration = record.duration
        entry.duration.count(latency_bucket(duration), duration)
        ttfb = record.ttfb
        if ttfb is not None:
            entry.ttfb.count(latency_bucket(ttfb), ttfb)

    def _h2(self, service: str, grpc_status: str | None) -> None:
        """One more request over HTTP/2, with the gRPC status of its answer if any."""
        self.h2_requests += 1
        if grpc_status is not None and service in self.services:
            grpc = self.grpc
            series = (service, grpc_status)
            grpc[series] = grpc.get(series, 0) + 1

    def downstream_requests(self) -> dict[str, int]:
        """Requests by the client's protocol: ``h2``, and ``http/1.1`` (HTTP/1.0's too), the
        rest of every request counted: the revision series' answers, those of series since
        dropped, and those not recorded."""
        total = self.retired + self.unrecorded
        for service in list(self.services.values()):
            for entry in list(service.revisions.values()):
                total += sum(entry.answers.settled().values())
        return {"http/1.1": total - self.h2_requests, "h2": self.h2_requests}

    def on_client_timeout(self, protocol: str, timeout: ClientTimeout) -> None:
        key = (protocol, timeout)
        self.client_timeouts[key] = self.client_timeouts.get(key, 0) + 1

    def on_model_request(self, record: RequestRecord, tokens: Tokens) -> None:
        self.on_request(record)
        entry = self._requests.get((record.service, record.revision))
        if entry is not None and record.service:
            entry.token_series().count(tokens)

    def _count(
        self,
        entry: RevisionSeries,
        status: int,
        error: str | None,
        retry_reasons: tuple[str, ...],
        n: int,
    ) -> None:
        """Count ``n`` answers of one kind: their code, retries and gateway errors."""
        entry.answers.add(status, error, n)
        service = entry.service
        if retry_reasons:
            for reason in retry_reasons:
                service.retry(reason, n)
                if reason == "connect" or reason == "disconnect":
                    service.connect_failures += n
        if error is not None:
            if error == "no_routable_upstream":
                service.no_routable += n
            elif error == "upstream_connect_error":
                service.connect_failures += n

    def merge(self, tally: Tally) -> None:
        """Add a worker's counts (``RequestTally.take``) as if its requests were served here."""
        for (name, revision, status, error, reasons), n in tally.outcomes.items():
            entry = self._entry(name, revision)
            if entry is None:
                self.unrecorded += n
                continue
            self._count(entry, status, error, reasons, n)
        for (name, revision), counts in tally.durations.items():
            entry = self._entry(name, revision)
            if entry is not None:
                entry.duration.merge(counts)
        for name, counts in tally.ttfb.items():
            service = self.services.get(name)
            if service is not None and name:
                service.ttfb.merge(counts)
        self.h2_requests += tally.h2
        grpc = self.grpc
        for series, n in tally.grpc.items():
            if series[0] in self.services:
                grpc[series] = grpc.get(series, 0) + n
        timeouts = self.client_timeouts
        for key, n in tally.timeouts.items():
            timeouts[key] = timeouts.get(key, 0) + n
        for (name, revision), taken in tally.tokens.items():
            entry = self._entry(name, revision)
            if entry is not None and name:
                entry.token_series().merge(taken)

    def _entry(self, name: str, revision: int | None) -> RevisionSeries | None:
        """A revision's request series (made on first use), or None for an unknown service."""
        return self._requests.get((name, revision)) or self._revision(name, revision)

    def _revision(self, name: str, revision: int | None) -> RevisionSeries | None:
        service = self.services.get(name)
        if service is None:
            return None
        entry = service.revisions.get(revision)
        if entry is None:
            entry = service.revisions[revision] = RevisionSeries(service, revision)
            if revision is not None and (name, revision) not in self._live:
                self._sweep.add(name)
        self._requests[(name, revision)] = entry
        return entry

    def __repr__(self) -> str:
        return (
            f"<GatewayMetrics services={len(self.services) - 1} "
            f"upstreams={len(self.upstreams)} revisions={len(self._requests)} "
            f"unrecorded={self.unrecorded}>"
        )
