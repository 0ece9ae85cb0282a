"""Prometheus metrics of the data plane, on an injected ``CollectorRegistry``.

``GatewayMetrics`` is a ``PoolSubscriber`` (upstream health and state, ejections), a
``ProbeObserver`` (probe outcomes and durations) and a ``RequestObserver`` (requests,
latencies, retries). ``metrics_handler`` serves a registry on the admin listener.

Invariants:
- Label sets are bounded: service, revision, upstream id, a state, a probe result, a retry
  reason or a status class / gateway error code. Never a path, a host or a client address.
- No stale series: an upstream's series go when it leaves the pool, a service's when the
  service is removed, a revision's request series when its last upstream leaves. Results for
  an upstream or a service the metrics do not know (already removed) are not recorded, so
  they cannot bring a series back.
- The hot path (``on_request``) resolves no label and takes no lock: the request series
  (``gateway_requests``, ``gateway_request_duration_seconds``, ``gateway_upstream_ttfb_seconds``)
  are plain counts (``tally.Buckets``) and dicts, per service and revision, that
  ``_RequestCollector`` turns into metric families at scrape time; ``prometheus_client``'s
  own children (a lock and a Python loop over the buckets per ``observe``) cost several
  times more per request. Other label children are created once and cached. Even the
  ``code`` label of a status (its class) is worked out at scrape time.
- In-flight counts are read from the pool at scrape time, so requests pay nothing for them.

Longer than most modules: every kind of series follows the same no-stale-series rules, kept
in one place.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Final

from aiohttp import web
from mypy_extensions import i64
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from .errors import GatewayError
from .events import PoolEvent, ProbeResult, RequestRecord
from .pool import Pool, RequestCounts
from .tally import LATENCY_BUCKETS, Buckets, Tally, latency_bucket
from .upstream import Upstream

UPSTREAM_STATES: Final[tuple[str, ...]] = ("unknown", "healthy", "unhealthy", "draining", "ejected")
"""The values of ``Upstream.state``: the one-hot ``gateway_upstream_state``."""

PROBE_RESULTS: Final[tuple[str, ...]] = ("success", "failure", "timeout")
RETRY_REASONS: Final = frozenset({"connect", "disconnect", "status"})
"""What the proxy puts in ``RequestRecord.retry_reasons``; anything else counts as ``other``."""

PROBE_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


def _gateway_statuses() -> dict[str, int]:
    """Error code -> status of every answer the gateway makes itself."""
    out: dict[str, int] = {}
    todo: list[type[GatewayError]] = [GatewayError]
    while todo:
        cls = todo.pop()
        out[cls.code] = cls.status
        todo.extend(cls.__subclasses__())
    out["cancelled"] = 499  # the client went away before an answer (proxy.handle)
    return out


_GATEWAY_STATUS: Final = _gateway_statuses()
_CLASS: Final = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}


def code_label(status: int, error: str | None) -> str:
    """The ``code`` label: the exact status of an answer the gateway made, else its class.

    An error code alone does not make the answer the gateway's: a body that broke off after
    the upstream's status line keeps the upstream's status (and so its class).
    """
    if error is not None and _GATEWAY_STATUS.get(error) == status:
        return str(status)
    if status < 100:
        return "500"  # the handler raised before any status: aiohttp answered 500
    return _CLASS.get(status // 100) or str(status)


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


class _RevisionSeries:
    """The request counts of one revision of a service; its series go with it."""

    __slots__ = ("_run", "_status", "codes", "duration", "label", "service", "ttfb")

    def __init__(self, service: _ServiceSeries, revision: int | None) -> None:
        self.service = service
        self.label = "" if revision is None else str(revision)
        self.duration = Buckets(LATENCY_BUCKETS)
        self.ttfb = service.ttfb
        """The service's (TTFB is per service), here to save ``on_request`` a look-up."""
        self.codes: dict[int | str, int] = {}
        """Answers by ``code`` label to be: an int is a status whose label (its class) is
        worked out at scrape time, saving ``on_request`` the work; a str is the exact code of
        an answer the gateway made. In order of first appearance, as the series are shown.
        Read through ``settled``: the run of one status being counted is not in it."""
        self._status: i64 = -1
        self._run: i64 = 0
        """Consecutive answers with status ``_status`` not yet in ``codes``: counted as a
        machine integer (an int past 256 in the dict is an object made at every increment)."""

    def answered(self, status: i64) -> None:
        """One more answer with ``status`` (that the proxy made: ``GatewayMetrics._count``)."""
        if status == self._status:
            self._run += 1
            return
        codes = self.settled()
        self._status = status
        self._run = 1
        if status not in codes:
            codes[status] = 0  # its place, in order of first appearance

    def settled(self) -> dict[int | str, int]:
        """``codes``, with the run being counted in them."""
        run = self._run
        codes = self.codes
        if run:
            status = self._status
            codes[status] = codes.get(status, 0) + run
            self._run = 0
        return codes

    def code_counts(self) -> dict[str, int]:
        """The counts by ``code`` label, each label where its first status appeared."""
        out: dict[str, int] = {}
        for key, count in list(self.settled().items()):
            code = key if isinstance(key, str) else code_label(key, None)
            out[code] = out.get(code, 0) + count
        return out


class GatewayMetrics:
    """The data plane's metrics on ``registry``; call ``attach(pool)`` to follow a pool.

    Requests that matched no route are counted under ``service=""``.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        registry.register(_RequestCollector(self))
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
            "Attempts retried on another upstream, by reason (connect, disconnect, status).",
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
        self._services: dict[str, _ServiceSeries] = {"": _ServiceSeries(self, "")}
        self._live: dict[tuple[str, int], int] = {}
        """(service, revision) -> upstreams of it in the pool."""
        self._requests: dict[tuple[str, int | None], _RevisionSeries] = {}
        self._sweep: set[str] = set()
        """Services with a revision series but no upstream of that revision left."""
        self.unrecorded = 0
        """Records of services no longer in the pool, not recorded (they would be stale)."""
        registry.register(_InflightCollector(self))
        registry.register(_GuardCollector(self))

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
        code: int | str = status  # its class, at scrape time (``_RevisionSeries.codes``)
        if error is not None and _GATEWAY_STATUS.get(error) == status:
            code = str(status)
        codes = entry.codes
        codes[code] = codes.get(code, 0) + n
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


class _RequestCollector(Collector):
    """The request series, made from the plain counts of ``on_request`` at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        requests, duration, ttfb = self._families()
        for name, service in list(self._metrics._services.items()):
            for entry in list(service.revisions.values()):
                labels = (name, entry.label)
                for code, count in entry.code_counts().items():
                    requests.add_metric((*labels, code), count)
                duration.add_metric(labels, entry.duration.buckets(), entry.duration.sum)
            if name and service.made("ttfb"):
                ttfb.add_metric((name,), service.ttfb.buckets(), service.ttfb.sum)
        yield from (requests, duration, ttfb)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, HistogramMetricFamily, HistogramMetricFamily]:
        return (
            CounterMetricFamily(
                "gateway_requests",
                "Requests answered, by status class (2xx...) or exact status of a gateway error.",
                labels=("service", "revision", "code"),
            ),
            HistogramMetricFamily(
                "gateway_request_duration_seconds",
                "Time from the request's arrival to the end of its answer.",
                labels=("service", "revision"),
            ),
            HistogramMetricFamily(
                "gateway_upstream_ttfb_seconds",
                "Time from the request's arrival to the upstream's response headers.",
                labels=("service",),
            ),
        )


class _InflightCollector(Collector):
    """``gateway_inflight_requests``, read from the pool's lease counts at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        pool = self._metrics._pool
        if pool is not None:
            for name, service in list(pool.services.items()):
                inflight = service.inflight_all()
                for upstream in service.snapshot.upstreams:
                    family.add_metric((name, upstream.id), inflight.get(upstream.id, 0))
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "gateway_inflight_requests",
            "Requests (and streams, WebSockets) in flight on the upstream.",
            labels=("service", "upstream"),
        )


class _GuardCollector(Collector):
    """Auth outcomes, rate-limited requests and the slot queue, read from the pool's
    counters (``ServicePool.counted_all``, workers' included) at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        auth, limited, queued, waited, timeouts = self._families()
        pool = self._metrics._pool
        if pool is not None:
            for name, sp in list(pool.services.items()):
                routing = sp.routing
                counts = sp.counted_all()
                if routing.auth is not None:
                    for outcome in ("ok", "missing", "wrong"):
                        auth.add_metric((name, outcome), counts.get(f"auth_{outcome}", 0))
                if routing.rate_limits:
                    limited.add_metric((name,), counts.get("rate_limited", 0))
                if routing.limits.max_in_flight_per_replica:
                    queued.add_metric((name,), sp.queued_all())
                    waited.add_metric(
                        (name,), int(counts.get("queued", 0)), counts.get("queue_wait_seconds", 0.0)
                    )
                    timeouts.add_metric(
                        (name,), counts.get("queue_timeout", 0) + counts.get("queue_full", 0)
                    )
        yield from (auth, limited, queued, waited, timeouts)

    @staticmethod
    def _families() -> tuple[
        CounterMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        SummaryMetricFamily,
        CounterMetricFamily,
    ]:
        return (
            CounterMetricFamily(
                "gateway_auth_requests",
                "Requests to a service with auth, by outcome: ok, missing or wrong token.",
                labels=("service", "outcome"),
            ),
            CounterMetricFamily(
                "gateway_rate_limited_requests",
                "Requests refused with 429 by a rate limit of the service.",
                labels=("service",),
            ),
            GaugeMetricFamily(
                "gateway_service_queued_requests",
                "Requests waiting for a slot under max_in_flight_per_replica.",
                labels=("service",),
            ),
            SummaryMetricFamily(
                "gateway_service_queue_wait_seconds",
                "Time requests waited for a slot under max_in_flight_per_replica.",
                labels=("service",),
            ),
            CounterMetricFamily(
                "gateway_service_queue_rejected_requests",
                "Requests answered 503 by the slot queue: full, or no slot within queue_timeout.",
                labels=("service",),
            ),
        )


def metrics_handler(
    registry: CollectorRegistry,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler serving ``registry`` (text format, or OpenMetrics if asked for)."""

    async def handle(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    return handle
