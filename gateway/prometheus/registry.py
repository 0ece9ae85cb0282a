"""The collectors one ``/metrics`` serves: registered once, collected at every scrape."""

from __future__ import annotations

from collections.abc import Iterator

from .families import Collector, Metric


class CollectorRegistry:
    """Collectors in the order registered. A collector whose families (``describe``) share a
    sample name with one already registered is refused: two series of one name would make
    the scrape fail as a whole."""

    def __init__(self) -> None:
        self._collectors: dict[Collector, tuple[str, ...]] = {}
        self._names: dict[str, Collector] = {}

    def register(self, collector: Collector) -> None:
        if collector in self._collectors:
            raise ValueError(f"{collector!r} is registered already")
        names = tuple(n for family in collector.describe() for n in family.sample_names())
        taken = sorted({n for n in names if n in self._names})
        if taken:
            raise ValueError(f"duplicated timeseries in the registry: {', '.join(taken)}")
        self._collectors[collector] = names
        for name in names:
            self._names[name] = collector

    def unregister(self, collector: Collector) -> None:
        for name in self._collectors.pop(collector):
            del self._names[name]

    def collect(self) -> Iterator[Metric]:
        for collector in list(self._collectors):
            yield from collector.collect()

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of the sample ``name`` with exactly ``labels``, None if there is none
        (for tests and the command line: it collects every collector)."""
        wanted = labels or {}
        for metric in self.collect():
            for sample in metric.samples:
                if sample.name == name and sample.labels == wanted:
                    return sample.value
        return None
