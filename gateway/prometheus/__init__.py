"""Prometheus metrics: metric families, the instruments that keep counts, a registry of
collectors, and the two text formats a scrape asks for.

The main process's metrics are made and served with these (``gateway.metrics``,
``gateway.scrape``, the controller's collectors); a worker process imports none of it. They
replace prometheus_client, whose package imports its HTTP server, WSGI, urllib and email
modules along with its exposition: 3.1 MiB of the main process's 46.7, for a format that
takes a page to write (see ``exposition``). The names and signatures follow
prometheus_client's, so a collector reads as one written for it.

- ``families``: ``Metric`` and the families a collector yields at scrape time;
  ``Collector``.
- ``instruments``: ``Counter``, ``Gauge``, ``Histogram``, with label children.
- ``registry``: ``CollectorRegistry``.
- ``exposition``: the text format 0.0.4 and OpenMetrics 1.0, chosen by ``Accept``.
"""

from .exposition import choose_encoder, generate_latest, generate_openmetrics
from .families import (
    Collector,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    Sample,
    SummaryMetricFamily,
)
from .instruments import Counter, Gauge, Histogram
from .registry import CollectorRegistry

__all__ = [
    "Collector",
    "CollectorRegistry",
    "Counter",
    "CounterMetricFamily",
    "Gauge",
    "GaugeMetricFamily",
    "Histogram",
    "HistogramMetricFamily",
    "Metric",
    "Sample",
    "SummaryMetricFamily",
    "choose_encoder",
    "generate_latest",
    "generate_openmetrics",
]
