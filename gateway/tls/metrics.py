"""Prometheus series of the HTTPS listeners, read from a ``Termination`` at scrape time
(``TlsCollector``; the main process's only, as ``gateway.observability.scrape``).

    gateway_tls_handshakes_total{outcome="ok"|"resumed", version}
    gateway_tls_handshake_failures_total{reason}     (``handshake.FAILURE_REASONS``)
    gateway_tls_certificate_expiry_timestamp_seconds{name}
    gateway_tls_certificate_reload_failures_total

Labels are bounded: a TLS version, a reason from a fixed list, a certificate's first name
(one series per certificate loaded; it goes when the certificate does).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import Termination
from .handshake import FAILURE_REASONS


class TlsCollector(Collector):
    """The handshakes, failures and certificates of ``tls``."""

    def __init__(self, tls: Termination) -> None:
        self.tls = tls

    def describe(self) -> Iterable[Metric]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        tally, store = self.tls.tally, self.tls.store
        handshakes = CounterMetricFamily(
            "gateway_tls_handshakes",
            "TLS handshakes completed, full (ok) or resumed, by TLS version.",
            labels=["outcome", "version"],
        )
        for outcome, counts in (("ok", tally.ok), ("resumed", tally.resumed)):
            for version, count in sorted(counts.items()):
                handshakes.add_metric([outcome, version], count)
        yield handshakes
        failures = CounterMetricFamily(
            "gateway_tls_handshake_failures",
            "TLS handshakes that failed: timeout, plain_http, unknown_name, protocol, closed.",
            labels=["reason"],
        )
        for reason in FAILURE_REASONS:
            failures.add_metric([reason], tally.failed.get(reason, 0))
        yield failures
        expiry = GaugeMetricFamily(
            "gateway_tls_certificate_expiry_timestamp_seconds",
            "When each certificate serving expires (seconds since the epoch), by its first name.",
            labels=["name"],
        )
        for certificate in store.loaded.values():
            expiry.add_metric([certificate.name], certificate.not_after)
        yield expiry
        yield CounterMetricFamily(
            "gateway_tls_certificate_reload_failures",
            "Certificate files refused by a load or reload (the one loaded before kept serving).",
            value=store.reload_failures,
        )
