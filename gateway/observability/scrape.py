"""The data plane's Prometheus collectors, and the ``/metrics`` exposition that serves them.

prometheus_client's custom collectors: at each scrape they read plain counts (``metrics``,
``tally``: the workers' merged in) and the pool, and yield its metric families. Nothing
here runs per request, and only the main process imports this module (a worker imports no
prometheus_client).

- ``MetricsCollector``: upstream health and state, probes, requests, latencies, retries,
  ejections, in-flight requests, auth outcomes, rate limits and the slot queue, requests by
  client protocol and gRPC statuses, from a ``GatewayMetrics`` and the pool it follows.
- ``ConnectionsCollector``: ``gateway_client_connections``, the client connections open,
  in the event loop or parked (``proxy.parking``), from the traffic listener's counts;
  ``Http2ConnectionsCollector``: ``gateway_http2_connections``, of those, the HTTP/2 ones.
- ``AccessLogCollector``: access log lines dropped.
- ``TracingCollector``: spans exported and dropped (``exporter``).
- ``LoadCollector``: the load scraper's scrapes, and the replicas' figures it holds.
- The HTTPS listeners' and the worker processes' collectors are theirs (``tls.metrics``,
  ``workers.metrics``).
- ``metrics_exposition``: a registry rendered for a scrape's ``Accept`` (the admin
  listener's ``/metrics``), in the format prometheus_client chooses for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from ..pool.events import CLIENT_TIMEOUTS
from .metrics import PROTOCOLS, UPSTREAM_STATES, GatewayMetrics

if TYPE_CHECKING:
    from ..health.load_scraper import LoadScraper
    from ..pool.pool import Pool
    from .accesslog import AccessLog
    from .exporter import SpanExporter


class MetricsCollector(Collector):
    """The series of ``metrics`` (a ``GatewayMetrics``) and of the pool it follows."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return [
            *_request_families(),
            *_token_families(),
            *_upstream_families(),
            *_service_families(),
            _inflight_family(),
            *_guard_families(),
            *_protocol_families(),
        ]

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        yield from self._requests(metrics)
        yield from self._tokens(metrics)
        yield from self._upstreams(metrics)
        yield from self._services(metrics)
        pool = metrics.pool
        yield self._inflight(pool)
        yield from self._guards(pool)
        yield from self._protocols(metrics)

    @staticmethod
    def _requests(metrics: GatewayMetrics) -> Iterator[Metric]:
        requests, duration, ttfb = _request_families()
        for name, service in list(metrics.services.items()):
            for entry in list(service.revisions.values()):
                labels = (name, entry.label)
                for code, count in entry.answers.code_counts().items():
                    requests.add_metric((*labels, code), count)
                duration.add_metric(labels, entry.duration.buckets(), entry.duration.sum)
            if name:  # no TTFB without an upstream
                ttfb.add_metric((name,), service.ttfb.buckets(), service.ttfb.sum)
        yield from (requests, duration, ttfb)

    @staticmethod
    def _tokens(metrics: GatewayMetrics) -> Iterator[Metric]:
        first_token, gaps, output = _token_families()
        for name, service in list(metrics.services.items()):
            for entry in list(service.revisions.values()):
                tokens = entry.tokens
                if tokens is None:
                    continue  # shown once a request on a model path came
                labels = (name, entry.label)
                first_token.add_metric(labels, tokens.first_token.buckets(), tokens.first_token.sum)
                gaps.add_metric(labels, tokens.gaps.buckets(), tokens.gaps.sum)
                output.add_metric(labels, tokens.output)
        yield from (first_token, gaps, output)

    @staticmethod
    def _upstreams(metrics: GatewayMetrics) -> Iterator[Metric]:
        up, state, probes, ejections = _upstream_families()
        for (service, uid), series in list(metrics.upstreams.items()):
            upstream, revision = series.upstream, str(series.revision)
            up.add_metric((service, revision, uid), 1 if upstream.routable else 0)
            for s in UPSTREAM_STATES:
                state.add_metric((service, revision, uid, s), 1 if upstream.state == s else 0)
            for result, count in series.probes.items():
                probes.add_metric((service, uid, result), count)
            ejections.add_metric((service, uid), series.ejections)
        yield from (up, state, probes, ejections)

    @staticmethod
    def _services(metrics: GatewayMetrics) -> Iterator[Metric]:
        probe_duration, retries, no_routable, connect_failures = _service_families()
        for name, service in list(metrics.services.items()):
            for reason, count in list(service.retries.items()):
                retries.add_metric((name, reason), count)
            if name:  # a service of the pool: every series from 0
                durations = service.probe_duration
                probe_duration.add_metric((name,), durations.buckets(), durations.sum)
            if name or service.no_routable:
                no_routable.add_metric((name,), service.no_routable)
            if name or service.connect_failures:
                connect_failures.add_metric((name,), service.connect_failures)
        yield from (probe_duration, retries, no_routable, connect_failures)

    @staticmethod
    def _protocols(metrics: GatewayMetrics) -> Iterator[Metric]:
        """Requests by the client's protocol (Envoy's ``downstream_rq_http1_total`` and
        ``_http2_total``, as one family), gRPC answers by status, and clients given up on for
        slowness (every series from 0)."""
        downstream, grpc, timeouts = _protocol_families()
        for protocol, count in metrics.downstream_requests().items():
            downstream.add_metric((protocol,), count)
        for (service, status), count in list(metrics.grpc.items()):
            grpc.add_metric((service, status), count)
        counted = metrics.client_timeouts
        for protocol in PROTOCOLS:
            for timeout in CLIENT_TIMEOUTS:
                timeouts.add_metric((protocol, timeout), counted.get((protocol, timeout), 0))
        yield from (downstream, grpc, timeouts)

    @staticmethod
    def _inflight(pool: Pool | None) -> Metric:
        family = _inflight_family()
        if pool is not None:
            for name, service in list(pool.services.items()):
                inflight = service.inflight_all()
                for upstream in service.snapshot.upstreams:
                    family.add_metric((name, upstream.id), inflight.get(upstream.id, 0))
        return family

    @staticmethod
    def _guards(pool: Pool | None) -> Iterator[Metric]:
        """From the pool's counters (``ServicePool.counted_all``, workers' included)."""
        auth, limited, queued, waited, timeouts = _guard_families()
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


def _request_families() -> tuple[CounterMetricFamily, HistogramMetricFamily, HistogramMetricFamily]:
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


def _protocol_families() -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
    return (
        CounterMetricFamily(
            "gateway_downstream_requests",
            "Requests by the client's protocol: http/1.1 (HTTP/1.0's too) or h2 (h2 or h2c).",
            labels=("protocol",),
        ),
        CounterMetricFamily(
            "gateway_grpc_responses",
            "Answers to gRPC requests by the gRPC status they carried (upstream's or gateway's).",
            labels=("service", "grpc_status"),
        ),
        CounterMetricFamily(
            "gateway_client_timeouts",
            "Clients given up on for slowness, by protocol and timeout: header (no request head"
            " in time), body (body_timeout or body_min_rate), send (an answer left unread).",
            labels=("protocol", "timeout"),
        ),
    )


def _token_families() -> tuple[HistogramMetricFamily, HistogramMetricFamily, CounterMetricFamily]:
    return (
        HistogramMetricFamily(
            "gateway_model_time_to_first_token_seconds",
            "Time from a request's arrival to the first content chunk of its streamed answer"
            " (model paths).",
            labels=("service", "revision"),
        ),
        HistogramMetricFamily(
            "gateway_model_inter_token_latency_seconds",
            "Time between the content chunks of a streamed answer (model paths).",
            labels=("service", "revision"),
        ),
        CounterMetricFamily(
            "gateway_model_output_tokens",
            "Output tokens of answers on model paths: usage.completion_tokens when given,"
            " else one per content chunk of a stream.",
            labels=("service", "revision"),
        ),
    )


def _upstream_families() -> tuple[
    GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily
]:
    return (
        GaugeMetricFamily(
            "gateway_upstream_up",
            "1 if the upstream is routable (healthy, active, not ejected), else 0.",
            labels=("service", "revision", "upstream"),
        ),
        GaugeMetricFamily(
            "gateway_upstream_state",
            "The upstream's state, one-hot: " + ", ".join(UPSTREAM_STATES) + ".",
            labels=("service", "revision", "upstream", "state"),
        ),
        CounterMetricFamily(
            "gateway_probe",
            "Active probe rounds by result (success, failure, timeout).",
            labels=("service", "upstream", "result"),
        ),
        CounterMetricFamily(
            "gateway_ejections",
            "Passive ejections of an upstream (failure streaks on real traffic).",
            labels=("service", "upstream"),
        ),
    )


def _service_families() -> tuple[
    HistogramMetricFamily, CounterMetricFamily, CounterMetricFamily, CounterMetricFamily
]:
    return (
        HistogramMetricFamily(
            "gateway_probe_duration_seconds",
            "Time one probe round took.",
            labels=("service",),
        ),
        CounterMetricFamily(
            "gateway_retries",
            "Attempts made again, by reason: on another upstream (connect, disconnect, status),"
            " or on a new connection to the same one (stale: a kept connection it had closed).",
            labels=("service", "reason"),
        ),
        CounterMetricFamily(
            "gateway_no_routable_upstream",
            "Requests answered 503 because no upstream was routable.",
            labels=("service",),
        ),
        CounterMetricFamily(
            "gateway_upstream_connect_failures",
            "Attempts that could not connect to an upstream or were reset before an answer.",
            labels=("service",),
        ),
    )


def _inflight_family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "gateway_inflight_requests",
        "Requests (and streams, WebSockets) in flight on the upstream.",
        labels=("service", "upstream"),
    )


def _guard_families() -> tuple[
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


class ConnectionsCollector(Collector):
    """``gateway_client_connections``, by ``state``: ``in_loop`` (busy, or idle for less than
    their ``park_after``) and ``parked``. ``counts``: (open, of which parked), the traffic
    listener's (the workers' as last reported), None before it started."""

    def __init__(self, counts: Callable[[], tuple[int, int] | None]) -> None:
        self._counts = counts

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        counts = self._counts()
        if counts is not None:
            open_, parked = counts
            family.add_metric(("in_loop",), open_ - parked)
            family.add_metric(("parked",), parked)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "gateway_client_connections",
            "Client connections open: in the event loop, or parked (idle, their socket alone "
            "held until the client sends again).",
            labels=("state",),
        )


class Http2ConnectionsCollector(Collector):
    """``gateway_http2_connections``: of the client connections open, those that speak HTTP/2
    (h2c or h2; a family of its own: ``gateway_client_connections``' series stay as they
    were). ``count``: the traffic listener's (the workers' as last reported), None before it
    started."""

    def __init__(self, count: Callable[[], int | None]) -> None:
        self._count = count

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        count = self._count()
        if count is not None:
            family.add_metric((), count)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "gateway_http2_connections",
            "Client connections open that speak HTTP/2 (h2 by ALPN, or h2c by prior knowledge).",
        )


class AccessLogCollector(Collector):
    """``gateway_access_log_dropped_total``: an ``AccessLog``'s lines dropped (its queue was
    full) or lost (a write failed)."""

    def __init__(self, log: AccessLog) -> None:
        self._log = log

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        family.add_metric((), self._log.dropped + self._log.lost)
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "gateway_access_log_dropped",
            "Access log lines dropped because the writer fell behind or could not write.",
            labels=(),
        )


class TracingCollector(Collector):
    """``gateway_tracing_spans_exported_total`` and ``gateway_tracing_spans_dropped_total``:
    a ``SpanExporter``'s spans the collector accepted, and those dropped (a buffer was full,
    in this process or a worker's, or their export failed)."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        exported, dropped = self._families()
        exported.add_metric((), self._exporter.exported)
        dropped.add_metric((), self._exporter.buffer.dropped)
        yield from (exported, dropped)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily]:
        return (
            CounterMetricFamily(
                "gateway_tracing_spans_exported",
                "Spans the OTLP collector accepted.",
                labels=(),
            ),
            CounterMetricFamily(
                "gateway_tracing_spans_dropped",
                "Spans dropped because the collector was slow or down (a queue was full, or "
                "their export failed or timed out).",
                labels=(),
            ),
        )


class LoadCollector(Collector):
    """The load scraper's series (``load_balancing: inference`` with ``load_metrics``):
    ``gateway_load_scrapes_total`` by service and result (``ok``: figures read; ``error``: no
    answer, not 200, or a figure missing), and from each replica's report that the pool holds
    its age, then while it still counts (``max_age``) its figures: requests waiting and
    running, and the KV-cache use. ``now``: the loop's clock, which stamps the reports."""

    def __init__(self, scraper: LoadScraper, pool: Pool, now: Callable[[], float]) -> None:
        self._scraper = scraper
        self._pool = pool
        self._now = now

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        scrapes, age, requests, kv_cache = self._families()
        for service, (ok, error) in list(self._scraper.results.items()):
            scrapes.add_metric((service, "ok"), ok)
            scrapes.add_metric((service, "error"), error)
        now = self._now()
        for service, sp in list(self._pool.services.items()):
            for upstream, report in list(sp.reports.items()):
                labels = (service, upstream)
                age.add_metric(labels, max(0.0, now - report.at))
                if now < report.expires:
                    requests.add_metric((*labels, "waiting"), report.waiting)
                    requests.add_metric((*labels, "running"), report.running)
                    kv_cache.add_metric(labels, report.kv_cache)
        yield from (scrapes, age, requests, kv_cache)

    @staticmethod
    def _families() -> tuple[
        CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily
    ]:
        return (
            CounterMetricFamily(
                "gateway_load_scrapes",
                "Scrapes of the replicas' load metrics (load_metrics), by result: ok (figures "
                "read) or error (no answer, not 200, a figure missing).",
                labels=("service", "result"),
            ),
            GaugeMetricFamily(
                "gateway_load_report_age_seconds",
                "Age of the replica's last load figures read (they count until max_age).",
                labels=("service", "upstream"),
            ),
            GaugeMetricFamily(
                "gateway_upstream_reported_requests",
                "Requests the replica reported waiting or running (all clients'), while its "
                "figures count.",
                labels=("service", "upstream", "state"),
            ),
            GaugeMetricFamily(
                "gateway_upstream_kv_cache_usage_ratio",
                "The replica's KV-cache use it reported (0 to 1), while its figures count.",
                labels=("service", "upstream"),
            ),
        )


Exposition = Callable[[str], tuple[bytes, str]]
"""A scrape's ``Accept`` header to the body and its content type."""


def metrics_exposition(registry: CollectorRegistry) -> Exposition:
    """``registry`` in the format the scrape's ``Accept`` asks for, as prometheus_client
    chooses it (``choose_encoder``): OpenMetrics if named, else the text format 0.0.4, also
    for an ``Accept`` the library cannot read (the endpoint is open to anyone)."""

    def render(accept: str) -> tuple[bytes, str]:
        try:
            encoder, content_type = choose_encoder(accept)
        except (TypeError, ValueError):  # a version it cannot read ("version=x") raises
            encoder, content_type = choose_encoder("")  # as for a scrape that names none
        return encoder(registry), content_type

    return render
