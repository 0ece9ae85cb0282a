"""Prometheus metrics of the data plane, on an injected ``CollectorRegistry``.

``GatewayMetrics`` is a ``PoolSubscriber`` (upstream health and state, ejections), a
``ProbeObserver`` (probe outcomes and durations) and a ``RequestObserver`` (requests,
latencies, retries). It keeps every series' label children and plain counts, and drops
them by the rules below; the series made at scrape time are built in ``scrape``, which also
serves the registry.

Invariants:
- Label sets are bounded: service, revision, upstream id, a state, a probe result, a retry
  reason or a status class / gateway error code. Never a path, a host or a client address.
- No stale series: an upstream's series go when it leaves the pool, a service's when the
  service is removed, a revision's request series when its last upstream leaves. Results for
  an upstream or a service the metrics do not know (already removed) are not recorded, so
  they cannot bring a series back.
- The hot path (``on_request``) resolves no label and takes no lock: the request series
  (``gateway_requests``, ``gateway_request_duration_seconds``, ``gateway_upstream_ttfb_seconds``)
  are plain counts (``tally.Buckets``, ``status_codes.StatusCounts``) per service and
  revision, that ``scrape.RequestCollector`` turns into metric families at scrape time;
  an instrument's own children (a lock and a Python loop over the buckets per
  ``observe``) cost several times more per request. Other label children are created once
  and cached. Even the ``code`` label of a status (its class) is worked out at scrape time.
- In-flight counts are read from the pool at scrape time, so requests pay nothing for them.
"""

from __future__ import annotations

from typing import Final

from .events import PoolEvent, ProbeResult, RequestRecord
from .pool import Pool, RequestCounts
from .prometheus import CollectorRegistry, Counter, Gauge, Histogram
from .scrape import GuardCollector, InflightCollector, RequestCollector
from .status_codes import StatusCounts
from .tally import LATENCY_BUCKETS, Buckets, Tally, latency_bucket
from .upstream import Upstream

UPSTREAM_STATES: Final[tuple[str, ...]] = ("unknown", "healthy", "unhealthy", "draining", "ejected")
"""The values of ``Upstream.state``: the one-hot ``gateway_upstream_state``."""

PROBE_RESULTS: Final[tuple[str, ...]] = ("success", "failure", "timeout")
RETRY_REASONS: Final = frozenset({"connect", "disconnect", "stale", "status"})
"""What the proxy puts in ``RequestRecord.retry_reasons``; anything else counts as ``other``."""

PROBE_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class _UpstreamSeries:
    """The cached label children of one upstream."""

    __slots__ = ("ejections", "labels", "probes", "revision", "state", "states", "up")

    def __init__(self, m: GatewayMetrics, upstream: Upstream) -> None:
        service, uid, rev = upstream.service, upstream.id, str(upstream.revision)
        self.labels = (service, rev, uid)
        self.revision = upstream.revision
        self.up = m.upstream_up.labels(service, rev, uid)
        self.states = {s: m.upstream_state.labels(service, rev, uid, s) for s in UPSTREAM_STATES}
        self.probes = {r: m.probes.labels(service, uid, r) for r in PROBE_RESULTS}
        self.ejections = m.ejections.labels(service, uid)
        self.state = ""
        self.set(upstream)

    def set(self, upstream: Upstream) -> None:
        self.up.set(1 if upstream.routable else 0)
        state = upstream.state
        if state != self.state:
            self.state = state
            for name, child in self.states.items():
                child.set(1 if name == state else 0)

    def remove(self, m: GatewayMetrics) -> None:
        service, rev, uid = self.labels
        m.upstream_up.remove(service, rev, uid)
        for state in self.states:
            m.upstream_state.remove(service, rev, uid, state)
        for result in self.probes:
            m.probes.remove(service, uid, result)
        m.ejections.remove(service, uid)


class _ServiceSeries:
    """The cached per-service children; per-revision ones live in ``revisions``.

    Each child is made on its first use and kept (in ``_<name>``). A pool service makes them
    all at once, so its counters show 0 before the first event; the no-route entry (``""``)
    only makes what it uses. (Not ``functools.cached_property``: compiled with mypyc, that is
    a plain property, made again on every use.)
    """

    def __init__(self, m: GatewayMetrics, name: str) -> None:
        self._m = m
        self.name = name
        self.retries: dict[str, Counter] = {}
        self.revisions: dict[int | None, _RevisionSeries] = {}
        self._ttfb: Buckets | None = None
        self._probe_duration: Histogram | None = None
        self._no_routable: Counter | None = None
        self._connect_failures: Counter | None = None
        if name:
            for child in _SERVICE_CHILDREN:
                getattr(self, child)

    @property
    def ttfb(self) -> Buckets:
        if self._ttfb is None:
            self._ttfb = Buckets(LATENCY_BUCKETS)
        return self._ttfb

    @property
    def probe_duration(self) -> Histogram:
        if self._probe_duration is None:
            self._probe_duration = self._m.probe_duration.labels(self.name)
        return self._probe_duration

    @property
    def no_routable(self) -> Counter:
        if self._no_routable is None:
            self._no_routable = self._m.no_routable.labels(self.name)
        return self._no_routable

    @property
    def connect_failures(self) -> Counter:
        if self._connect_failures is None:
            self._connect_failures = self._m.connect_failures.labels(self.name)
        return self._connect_failures

    def made(self, child: str) -> bool:
        """Whether ``child`` (one of ``_SERVICE_CHILDREN``) was made, so has a series."""
        return getattr(self, "_" + child) is not None

    def retry(self, reason: str) -> Counter:
        reason = reason if reason in RETRY_REASONS else "other"
        child = self.retries.get(reason)
        if child is None:
            child = self.retries[reason] = self._m.retries.labels(self.name, reason)
        return child

    def remove(self) -> None:
        m, name = self._m, self.name
        self.revisions.clear()
        for child in _SERVICE_CHILDREN:
            if child != "ttfb" and self.made(child):
                getattr(m, child).remove(name)
        for reason in self.retries:
            m.retries.remove(name, reason)


_SERVICE_CHILDREN: Final[tuple[str, ...]] = (
    "ttfb",
    "probe_duration",
    "no_routable",
    "connect_failures",
)
"""The per-service children, each named as its metric's attribute on ``GatewayMetrics``."""


class _RevisionSeries(StatusCounts):
    """The request counts of one revision of a service; its series go with it."""

    __slots__ = ("duration", "label", "service", "ttfb")

    def __init__(self, service: _ServiceSeries, revision: int | None) -> None:
        super().__init__()
        self.service = service
        self.label = "" if revision is None else str(revision)
        self.duration = Buckets(LATENCY_BUCKETS)
        self.ttfb = service.ttfb
        """The service's (TTFB is per service), here to save ``on_request`` a look-up."""


class GatewayMetrics:
    """The data plane's metrics on ``registry``; call ``attach(pool)`` to follow a pool.

    Requests that matched no route are counted under ``service=""``.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self._services: dict[str, _ServiceSeries] = {"": _ServiceSeries(self, "")}
        registry.register(RequestCollector(self._services))
        self.upstream_up = Gauge(
            "gateway_upstream_up",
            "1 if the upstream is routable (healthy, active, not ejected), else 0.",
            ("service", "revision", "upstream"),
            registry=r,
        )
        self.upstream_state = Gauge(
            "gateway_upstream_state",
            "The upstream's state, one-hot: " + ", ".join(UPSTREAM_STATES) + ".",
            ("service", "revision", "upstream", "state"),
            registry=r,
        )
        self.probes = Counter(
            "gateway_probe",
            "Active probe rounds by result (success, failure, timeout).",
            ("service", "upstream", "result"),
            registry=r,
        )
        self.probe_duration = Histogram(
            "gateway_probe_duration_seconds",
            "Time one probe round took.",
            ("service",),
            buckets=PROBE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "gateway_retries",
            "Attempts made again, by reason: on another upstream (connect, disconnect, status),"
            " or on a new connection to the same one (stale: a kept connection it had closed).",
            ("service", "reason"),
            registry=r,
        )
        self.no_routable = Counter(
            "gateway_no_routable_upstream",
            "Requests answered 503 because no upstream was routable.",
            ("service",),
            registry=r,
        )
        self.ejections = Counter(
            "gateway_ejections",
            "Passive ejections of an upstream (failure streaks on real traffic).",
            ("service", "upstream"),
            registry=r,
        )
        self.connect_failures = Counter(
            "gateway_upstream_connect_failures",
            "Attempts that could not connect to an upstream or were reset before an answer.",
            ("service",),
            registry=r,
        )
        self._pool: Pool | None = None
        self._upstreams: dict[tuple[str, str], _UpstreamSeries] = {}
        self._live: dict[tuple[str, int], int] = {}
        """(service, revision) -> upstreams of it in the pool."""
        self._requests: dict[tuple[str, int | None], _RevisionSeries] = {}
        self._sweep: set[str] = set()
        """Services with a revision series but no upstream of that revision left."""
        self.unrecorded = 0
        """Records of services no longer in the pool, not recorded (they would be stale)."""
        registry.register(InflightCollector(lambda: self._pool))
        registry.register(GuardCollector(lambda: self._pool))

    def attach(self, pool: Pool) -> None:
        """Follow ``pool``: take in what is in it now, subscribe, report its in-flight counts."""
        self._pool = pool
        for name, service in pool.services.items():
            self._service(name)
            for upstream in service.snapshot.upstreams:
                self._add(upstream)
        pool.subscribe(self)
        pool.request_counts = self.revision_counts

    def revision_counts(self, service: str) -> RequestCounts:
        """``service``'s requests so far per revision (the workers' as last merged): the
        counts a canary's analysis reads (``Pool.request_counts``)."""
        entry = self._services.get(service)
        out: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        if entry is None or not service:
            return LATENCY_BUCKETS, out
        for revision, series in list(entry.revisions.items()):
            if revision is None:
                continue
            total = errors = 0
            for key, count in series.settled().items():
                total += count
                if int(key) >= 500:
                    errors += count
            out[revision] = (total, errors, tuple(series.duration.settled()))
        return LATENCY_BUCKETS, out

    # -- the pool -----------------------------------------------------------------------------

    def on_pool_event(self, event: PoolEvent) -> None:
        kind, upstream = event.kind, event.upstream
        if kind == "changed" and upstream is not None:
            series = self._upstreams.get((event.service, upstream.id))
            if series is not None:
                series.set(upstream)
                if upstream.ejected and event.previous is not None and not event.previous.ejected:
                    series.ejections.inc()
        elif kind == "added" and upstream is not None:
            self._service(event.service)
            self._add(upstream)
        elif kind == "removed" and upstream is not None:
            self._remove(event.service, upstream.id)
        elif kind == "service_set":
            self._service(event.service)
        elif kind == "service_removed":
            service = self._services.pop(event.service, None)
            if service is not None:
                service.remove()
                for revision in list(service.revisions):
                    self._requests.pop((event.service, revision), None)
            self._sweep.discard(event.service)
            for key in [k for k in self._upstreams if k[0] == event.service]:
                self._remove(*key)
        if event.service in self._sweep:
            self._sweep_revisions(event.service)

    def _service(self, name: str) -> _ServiceSeries:
        service = self._services.get(name)
        if service is None:
            service = self._services[name] = _ServiceSeries(self, name)
        return service

    def _add(self, upstream: Upstream) -> None:
        key = (upstream.service, upstream.id)
        if key in self._upstreams:
            return
        self._upstreams[key] = _UpstreamSeries(self, upstream)
        live = (upstream.service, upstream.revision)
        self._live[live] = self._live.get(live, 0) + 1

    def _remove(self, service: str, upstream_id: str) -> None:
        series = self._upstreams.pop((service, upstream_id), None)
        if series is None:
            return
        series.remove(self)
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

    def _sweep_revisions(self, service: str) -> None:
        """Drop revision series recreated by requests that ended after their upstream left."""
        self._sweep.discard(service)
        entry = self._services.get(service)
        if entry is None:
            return
        for revision in list(entry.revisions):
            if revision is not None and (service, revision) not in self._live:
                self._drop_revision(service, revision)

    # -- probes -------------------------------------------------------------------------------

    def on_probe(self, result: ProbeResult) -> None:
        series = self._upstreams.get((result.service, result.upstream_id))
        if series is None:
            return  # not (or no longer) in the pool
        series.probes[result.outcome].inc()
        service = self._services.get(result.service)
        if service is not None:
            service.probe_duration.observe(result.duration)

    # -- requests (hot path) ------------------------------------------------------------------

    def on_request(self, record: RequestRecord) -> None:
        entry = self._requests.get((record.service, record.revision))
        if entry is None:
            entry = self._revision(record.service, record.revision)
            if entry is None:
                self.unrecorded += 1
                return
        error, reasons = record.error, record.retry_reasons
        if error is None and not reasons:
            # Most requests: only their status to count (``_count`` does the same, slower).
            entry.answered(record.status)
        else:
            self._count(entry, record.status, error, reasons, 1)
        duration = record.duration
        entry.duration.count(latency_bucket(duration), duration)
        ttfb = record.ttfb
        if ttfb is not None:
            entry.ttfb.count(latency_bucket(ttfb), ttfb)

    def _count(
        self,
        entry: _RevisionSeries,
        status: int,
        error: str | None,
        retry_reasons: tuple[str, ...],
        n: int,
    ) -> None:
        """Count ``n`` answers of one kind: their code, retries and gateway errors."""
        entry.add(status, error, n)
        service = entry.service
        if retry_reasons:
            for reason in retry_reasons:
                service.retry(reason).inc(n)
                if reason == "connect" or reason == "disconnect":
                    service.connect_failures.inc(n)
        if error is not None:
            if error == "no_routable_upstream":
                service.no_routable.inc(n)
            elif error == "upstream_connect_error":
                service.connect_failures.inc(n)

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
            service = self._services.get(name)
            if service is not None and name:
                service.ttfb.merge(counts)

    def _entry(self, name: str, revision: int | None) -> _RevisionSeries | None:
        """A revision's request series (made on first use), or None for an unknown service."""
        return self._requests.get((name, revision)) or self._revision(name, revision)

    def _revision(self, name: str, revision: int | None) -> _RevisionSeries | None:
        service = self._services.get(name)
        if service is None:
            return None
        entry = service.revisions.get(revision)
        if entry is None:
            entry = service.revisions[revision] = _RevisionSeries(service, revision)
            if revision is not None and (name, revision) not in self._live:
                self._sweep.add(name)
        self._requests[(name, revision)] = entry
        return entry

    def __repr__(self) -> str:
        return (
            f"<GatewayMetrics services={len(self._services) - 1} "
            f"upstreams={len(self._upstreams)} revisions={len(self._requests)} "
            f"unrecorded={self.unrecorded}>"
        )
