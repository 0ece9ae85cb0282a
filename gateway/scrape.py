"""The data plane's series made at scrape time, and the ``/metrics`` handler that serves them.

Nothing here runs per request: the collectors read plain counts and the pool only when the
registry is collected.

- ``RequestCollector``: the request series (``gateway_requests``,
  ``gateway_request_duration_seconds``, ``gateway_upstream_ttfb_seconds``) from the plain
  counts that ``GatewayMetrics.on_request`` keeps per service and revision.
- ``InflightCollector``: ``gateway_inflight_requests``, from the pool's lease counts.
- ``GuardCollector``: auth outcomes, rate-limited requests and the slot queue, from the
  pool's counters.
- ``ConnectionsCollector``: ``gateway_client_connections``, the client connections open,
  in the event loop or parked (``proxy.parking``), from the traffic listener's counts.
- ``metrics_exposition``: a registry rendered for a scrape's ``Accept`` (the admin
  listener's ``/metrics``).

The collectors know ``GatewayMetrics`` only through what they read (``ServiceRequests``, a
pool getter), so the dependency runs one way: ``metrics`` registers them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from .pool import Pool
from .prometheus import (
    Collector,
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
    choose_encoder,
)
from .tally import Buckets


class RevisionRequests(Protocol):
    """What ``RequestCollector`` reads of one revision's request counts."""

    @property
    def label(self) -> str:
        """The ``revision`` label."""
        ...

    @property
    def duration(self) -> Buckets: ...

    def code_counts(self) -> dict[str, int]: ...


class ServiceRequests(Protocol):
    """What ``RequestCollector`` reads of one service's request counts."""

    @property
    def revisions(self) -> Mapping[int | None, RevisionRequests]: ...

    @property
    def ttfb(self) -> Buckets: ...

    def made(self, child: str) -> bool:
        """Whether ``child`` (``"ttfb"`` here) was made, so has a series."""
        ...


class RequestCollector(Collector):
    """The request series, made from the plain counts of ``on_request`` at scrape time.

    ``services``: service name -> its request counts (``""``: requests that matched no route),
    read as it is at each scrape.
    """

    def __init__(self, services: Mapping[str, ServiceRequests]) -> None:
        self._services = services

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        requests, duration, ttfb = self._families()
        for name, service in list(self._services.items()):
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


class InflightCollector(Collector):
    """``gateway_inflight_requests``, read from the pool's lease counts at scrape time.

    ``pool``: the pool followed, None before there is one.
    """

    def __init__(self, pool: Callable[[], Pool | None]) -> None:
        self._pool = pool

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        pool = self._pool()
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


class GuardCollector(Collector):
    """Auth outcomes, rate-limited requests and the slot queue, read from the pool's
    counters (``ServicePool.counted_all``, workers' included) at scrape time.

    ``pool``: the pool followed, None before there is one.
    """

    def __init__(self, pool: Callable[[], Pool | None]) -> None:
        self._pool = pool

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        auth, limited, queued, waited, timeouts = self._families()
        pool = self._pool()
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


Exposition = Callable[[str], tuple[bytes, str]]
"""A scrape's ``Accept`` header to the body and its content type."""


def metrics_exposition(registry: CollectorRegistry) -> Exposition:
    """``registry`` in the text format, or OpenMetrics if the scrape asks for it."""

    def render(accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(registry), content_type

    return render
