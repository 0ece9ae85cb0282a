"""Metric families: what a collector yields at each scrape, and the ``Collector`` it is.

A family is one metric's name, help text, type and samples. The sample names follow the
type, as both text formats write them: a counter ``x`` has samples ``x_total``; a histogram
``x_bucket{le}``, ``x_count`` and ``x_sum``; a summary ``x_count`` and ``x_sum``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

METRIC_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
TYPES: Final = frozenset({"counter", "gauge", "histogram", "summary", "unknown"})

SUFFIXES: Final[dict[str, tuple[str, ...]]] = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum", ""),
    "unknown": ("",),
}
"""The sample names of a family of each type: its name with each suffix."""


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def check_names(name: str, labelnames: Iterable[str]) -> tuple[str, ...]:
    """``labelnames`` as a tuple, once ``name`` and they are valid Prometheus names."""
    if not METRIC_NAME.match(name):
        raise ValueError(f"invalid metric name: {name!r}")
    names = tuple(labelnames)
    for label in names:
        if not LABEL_NAME.match(label) or label.startswith("__"):
            raise ValueError(f"invalid label name {label!r} of metric {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"metric {name!r} has a label name twice: {names}")
    return names


class Metric:
    """One metric family: ``name``, ``documentation`` (its help), ``type`` and ``samples``."""

    __slots__ = ("documentation", "labelnames", "name", "samples", "type")

    def __init__(
        self, name: str, documentation: str, typ: str, labels: Sequence[str] | None = None
    ) -> None:
        if typ not in TYPES:
            raise ValueError(f"metric {name!r}: unknown type {typ!r}")
        self.labelnames = check_names(name, labels or ())
        self.name = name
        self.documentation = documentation
        self.type = typ
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.samples.append(Sample(name, labels, value))

    def _labels(self, values: Sequence[str]) -> dict[str, str]:
        if len(values) != len(self.labelnames):
            raise ValueError(
                f"metric {self.name!r} has labels {self.labelnames}, given values {tuple(values)}"
            )
        return dict(zip(self.labelnames, values, strict=True))

    def sample_names(self) -> tuple[str, ...]:
        """The names of the samples a family of this name and type has."""
        return tuple(self.name + suffix for suffix in SUFFIXES[self.type])

    def __repr__(self) -> str:
        return f"<Metric {self.name} {self.type} samples={len(self.samples)}>"


class CounterMetricFamily(Metric):
    """A counter; a ``_total`` at the end of ``name`` is not part of the family's name.
    ``value`` makes its one sample, for a counter without labels."""

    __slots__ = ()

    def __init__(
        self,
        name: str,
        documentation: str,
        value: float | None = None,
        labels: Sequence[str] | None = None,
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter", labels)
        if value is not None:
            self.add_metric((), value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append(Sample(self.name + "_total", self._labels(labels), value))


class GaugeMetricFamily(Metric):
    __slots__ = ()

    def __init__(
        self,
        name: str,
        documentation: str,
        value: float | None = None,
        labels: Sequence[str] | None = None,
    ) -> None:
        super().__init__(name, documentation, "gauge", labels)
        if value is not None:
            self.add_metric((), value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append(Sample(self.name, self._labels(labels), value))


class HistogramMetricFamily(Metric):
    __slots__ = ()

    def __init__(self, name: str, documentation: str, labels: Sequence[str] | None = None) -> None:
        super().__init__(name, documentation, "histogram", labels)
        if "le" in self.labelnames:
            raise ValueError(f"histogram {name!r}: 'le' is the buckets' label")

    def add_metric(
        self, labels: Sequence[str], buckets: Sequence[tuple[str, float]], sum_value: float
    ) -> None:
        """``buckets``: (``le``, cumulative count) in order, ``+Inf`` last: its count is the
        histogram's ``_count``."""
        if not buckets or buckets[-1][0] != "+Inf":
            raise ValueError(f"histogram {self.name!r}: the last bucket must be +Inf")
        base = self._labels(labels)
        bucket = self.name + "_bucket"
        for le, count in buckets:
            self.samples.append(Sample(bucket, {**base, "le": le}, count))
        self.samples.append(Sample(self.name + "_count", base, buckets[-1][1]))
        self.samples.append(Sample(self.name + "_sum", base, sum_value))


class SummaryMetricFamily(Metric):
    """A summary without quantiles: its count and sum."""

    __slots__ = ()

    def __init__(self, name: str, documentation: str, labels: Sequence[str] | None = None) -> None:
        super().__init__(name, documentation, "summary", labels)

    def add_metric(self, labels: Sequence[str], count_value: float, sum_value: float) -> None:
        base = self._labels(labels)
        self.samples.append(Sample(self.name + "_count", base, count_value))
        self.samples.append(Sample(self.name + "_sum", base, sum_value))


class Collector(ABC):
    """What a registry collects from at each scrape."""

    @abstractmethod
    def collect(self) -> Iterable[Metric]:
        """The families as they are now."""

    def describe(self) -> Iterable[Metric]:
        """The families this collector yields, for the registry's check of names made twice
        (their samples are not read); none by default."""
        return []
