"""Prometheus series of the worker processes, read from a ``Supervisor`` at scrape time
(``WorkersCollector``; the main process's only, as ``gateway.observability.scrape``).

    gateway_workers                    worker processes serving now
    gateway_worker_restarts_total      worker processes started again after one exited
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .supervisor import Supervisor


class WorkersCollector(Collector):
    """``gateway_workers`` (serving now) and ``gateway_worker_restarts_total`` of a
    ``Supervisor``'s worker processes."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        restarts, serving = self._families()
        restarts.add_metric((), self._supervisor.restarted)
        serving.add_metric((), self._supervisor.serving)
        yield from (restarts, serving)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "gateway_worker_restarts",
                "Worker processes started again after one exited.",
                labels=(),
            ),
            GaugeMetricFamily("gateway_workers", "Worker processes serving traffic.", labels=()),
        )
