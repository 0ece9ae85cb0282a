"""Counters, gauges and histograms that keep their own counts, with label children.

An instrument made with label names is a parent: ``labels(*values)`` gives the child of those
values (made on first use, kept until ``remove``), and only children count. One made without
labels counts itself. Given a ``registry``, the instrument registers itself as a collector.

Not for a request's hot path: ``gateway.metrics`` counts requests in plain counts
(``tally``) that a collector reads at scrape time. These count rarer things: probes,
ejections, restarts.
"""

from __future__ import annotations

import bisect
import math
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from ..tally import Buckets
from .exposition import float_text
from .families import (
    Collector,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    check_names,
)

if TYPE_CHECKING:
    from .registry import CollectorRegistry

DEFAULT_BUCKETS: Final[tuple[float, ...]] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
"""prometheus_client's default buckets (seconds)."""

_I = TypeVar("_I", bound="_Instrument[Any]")


class _Instrument(Collector, Generic[_I]):
    """A parent (with label names) or a counting instrument (without, or a child)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = check_names(name, labelnames)
        self._children: dict[tuple[str, ...], _I] = {}
        self._value = 0.0
        """A counter's or a gauge's value (a histogram counts in buckets)."""
        if registry is not None:
            registry.register(self)

    def labels(self, *values: object) -> _I:
        """The child counting for the label ``values``, in ``labelnames``' order."""
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if not self.labelnames:
                raise ValueError(f"metric {self.name!r} has no labels")
            if len(key) != len(self.labelnames):
                raise ValueError(
                    f"metric {self.name!r} has labels {self.labelnames}, given values {key}"
                )
            child = self._children[key] = self._child()
        return child

    def remove(self, *values: object) -> None:
        """Forget the child of the label ``values`` (its series goes); none is no error."""
        self._children.pop(tuple(str(v) for v in values), None)

    def clear(self) -> None:
        """Forget every child."""
        self._children.clear()

    @abstractmethod
    def _child(self) -> _I:
        """A new child: an instrument of the same kind, without labels."""

    def _counting(self) -> None:
        if self.labelnames:
            raise ValueError(f"metric {self.name!r} counts in its children: use labels()")

    def _series(self) -> list[tuple[tuple[str, ...], _I]]:
        """(label values, what counts them), every child, or the instrument itself."""
        if self.labelnames:
            return list(self._children.items())
        return [((), self)]  # type: ignore[list-item]  # an unlabelled instrument is its own _I

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    @abstractmethod
    def _family(self) -> Metric:
        """The family, empty, that ``collect`` fills."""


class Counter(_Instrument["Counter"]):
    """A count that only goes up; ``name`` without its ``_total``, which the samples get."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _child(self) -> Counter:
        return Counter(self.name, self.documentation)

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name!r} only goes up (given {amount})")
        self._counting()
        self._value += amount

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, child in self._series():
            family.add_metric(values, child._value)
        return [family]


class Gauge(_Instrument["Gauge"]):
    """A value that goes up and down, set, or read from a function at each scrape."""

    _function: Callable[[], float] | None = None

    def _child(self) -> Gauge:
        return Gauge(self.name, self.documentation)

    def set(self, value: float) -> None:
        self._counting()
        self._value = float(value)

    def inc(self, amount: float = 1) -> None:
        self._counting()
        self._value += amount

    def dec(self, amount: float = 1) -> None:
        self._counting()
        self._value -= amount

    def set_function(self, function: Callable[[], float]) -> None:
        """Report ``function()`` at each scrape instead of a value set."""
        self._counting()
        self._function = function

    def value(self) -> float:
        return float(self._function()) if self._function is not None else self._value

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, child in self._series():
            family.add_metric(values, child.value())
        return [family]


class Histogram(_Instrument["Histogram"]):
    """Observations counted in buckets of upper bounds (``le``, inclusive), with their sum."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        registry: CollectorRegistry | None = None,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] == math.inf:
            bounds.pop()
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(f"histogram {name!r}: buckets must be increasing, given {buckets}")
        if "le" in labelnames:
            raise ValueError(f"histogram {name!r}: 'le' is the buckets' label")
        super().__init__(name, documentation, labelnames, registry)
        self._les = (*(float_text(b) for b in bounds), "+Inf")
        self._buckets = Buckets(tuple(bounds))
        """Its bounds, the observations per bucket and their sum (the data plane's
        ``tally.Buckets``)."""

    def _child(self) -> Histogram:
        return Histogram(self.name, self.documentation, buckets=self._buckets.bounds)

    def observe(self, amount: float) -> None:
        self._counting()
        buckets = self._buckets
        buckets.count(bisect.bisect_left(buckets.bounds, amount), amount)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, child in self._series():
            total = 0
            cumulative: list[tuple[str, float]] = []
            for le, count in zip(self._les, child._buckets.settled(), strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric(values, cumulative, child._buckets.sum)
        return [family]
