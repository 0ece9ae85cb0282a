"""``gateway.prometheus``: instruments, families, the registry and both text formats.

What it writes is read back with prometheus_client's parsers (the reference ones, a test
dependency), and compared line for line with what prometheus_client writes for the same
instruments: a scrape reads the same as before the gateway wrote its own.
"""

from __future__ import annotations

import math

import prometheus_client
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import gateway.prometheus as ours_module
from gateway.prometheus import (
    Collector,
    CollectorRegistry,
    Counter,
    CounterMetricFamily,
    Gauge,
    GaugeMetricFamily,
    Histogram,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
    choose_encoder,
    generate_latest,
    generate_openmetrics,
)
from gateway.prometheus.exposition import float_text

PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
"""What Prometheus 2 sends when it scrapes."""

AWKWARD = 'a "quoted" back\\slash\nand a new line'


def fill(module: object, registry: object) -> None:
    """The same instruments, counting the same things, from ``module`` (ours or
    prometheus_client) on ``registry``."""
    counter = module.Counter(  # type: ignore[attr-defined]
        "demo_requests_total", "Requests.\nTwo lines, a \\.", ("service", "code"),
        registry=registry,
    )  # fmt: skip
    counter.labels("web", "2xx").inc()
    counter.labels("web", "2xx").inc(2)
    counter.labels(AWKWARD, "5xx").inc(0.5)
    plain = module.Counter("demo_restarts", "Restarts.", registry=registry)  # type: ignore[attr-defined]
    plain.inc(3)
    gauge = module.Gauge("demo_up", "Up.", ("upstream",), registry=registry)  # type: ignore[attr-defined]
    gauge.labels("a").set(1)
    gauge.labels("b").set(0)
    gauge.labels("c").inc(2.5)
    gauge.labels("c").dec()
    gauge.remove("b")
    workers = module.Gauge("demo_workers", "Workers.", registry=registry)  # type: ignore[attr-defined]
    workers.set_function(lambda: 2)
    histogram = module.Histogram(  # type: ignore[attr-defined]
        "demo_seconds", "Durations.", ("service",), buckets=(0.005, 0.1, 1.0, 2_500_000.0),
        registry=registry,
    )  # fmt: skip
    for value in (0.005, 0.0051, 0.3, 7.0, 3_000_000.0):
        histogram.labels("web").observe(value)
    module.Histogram("demo_unused_seconds", "None yet.", ("service",), registry=registry)  # type: ignore[attr-defined]


def without_created(text: str) -> list[str]:
    """prometheus_client's lines without its ``_created`` stamps (when a series was made),
    which the gateway does not write."""
    out, skip = [], False
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            skip = line.split()[2].endswith("_created")
        if not skip and "_created{" not in line and "_created " not in line:
            out.append(line)
    return out


def test_the_text_format_is_prometheus_clients_line_for_line() -> None:
    ours, theirs = CollectorRegistry(), prometheus_client.CollectorRegistry()
    fill(prometheus_client, theirs)
    fill(ours_module, ours)
    assert generate_latest(ours).decode().splitlines() == without_created(
        prometheus_client.generate_latest(theirs).decode()
    )


def test_openmetrics_is_prometheus_clients_line_for_line() -> None:
    from prometheus_client.openmetrics.exposition import generate_latest as theirs_om

    ours, theirs = CollectorRegistry(), prometheus_client.CollectorRegistry()
    fill(prometheus_client, theirs)
    fill(ours_module, ours)
    text = generate_openmetrics(ours).decode()
    assert text.endswith("# EOF\n")
    assert text.splitlines() == without_created(theirs_om(theirs).decode())


class Families(Collector):
    """One family of each kind, as a collector made at scrape time yields them."""

    def collect(self) -> list[Metric]:
        requests = CounterMetricFamily("f_requests", "Requests.", labels=("service", "code"))
        requests.add_metric(("web", "2xx"), 7)
        requests.add_metric((AWKWARD, "5xx"), 1)
        up = GaugeMetricFamily("f_up", "Up.", labels=("upstream",))
        up.add_metric(("a",), 1)
        duration = HistogramMetricFamily("f_seconds", "Durations.", labels=("service",))
        duration.add_metric(("web",), [("0.1", 2), ("1.0", 3), ("+Inf", 4)], 2.5)
        wait = SummaryMetricFamily("f_wait_seconds", "Waits.", labels=("service",))
        wait.add_metric(("web",), 4, 0.25)
        failures = CounterMetricFamily("f_failures_total", "Failures.", value=2)
        return [requests, up, duration, wait, failures]


def samples(families: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families  # type: ignore[attr-defined]
        for s in f.samples
    }


def test_both_formats_read_back_with_the_reference_parsers() -> None:
    registry = CollectorRegistry()
    registry.register(Families())
    want = samples(registry.collect())
    assert want[("f_requests_total", (("code", "5xx"), ("service", AWKWARD)))] == 1
    assert want[("f_failures_total", ())] == 2
    assert want[("f_seconds_count", (("service", "web"),))] == 4
    text = generate_latest(registry).decode()
    assert samples(text_string_to_metric_families(text)) == want
    parsed = list(openmetrics_families(generate_openmetrics(registry).decode()))
    assert samples(parsed) == want
    types = {f.name: f.type for f in parsed}
    assert types == {
        "f_requests": "counter",
        "f_up": "gauge",
        "f_seconds": "histogram",
        "f_wait_seconds": "summary",
        "f_failures": "counter",
    }
    assert "# HELP f_requests_total Requests.\n# TYPE f_requests_total counter\n" in text


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        (PROMETHEUS_ACCEPT, True),
        ("application/openmetrics-text", True),
        ("text/plain;version=0.0.4", False),
        ("*/*", False),
        ("", False),
        (None, False),
    ],
)
def test_the_format_is_the_one_the_scrape_accepts(accept: str | None, openmetrics: bool) -> None:
    registry = CollectorRegistry()
    Counter("c", "A counter.", registry=registry).inc()
    encoder, content_type = choose_encoder(accept)
    body = encoder(registry)
    if openmetrics:
        assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
        assert body == b"# HELP c A counter.\n# TYPE c counter\nc_total 1.0\n# EOF\n"
    else:
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        assert body == b"# HELP c_total A counter.\n# TYPE c_total counter\nc_total 1.0\n"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1, "1.0"),
        (0.005, "0.005"),
        (-2.5, "-2.5"),
        (123456.0, "123456.0"),
        (1_000_000.0, "1e+06"),
        (2_500_000.0, "2.5e+06"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (math.nan, "NaN"),
    ],
)
def test_numbers_are_written_as_go_writes_them(value: float, text: str) -> None:
    assert float_text(value) == text


def test_a_histogram_bucket_holds_its_bound() -> None:
    registry = CollectorRegistry()
    h = Histogram("h_seconds", "H.", buckets=(0.1, 1.0), registry=registry)
    for value in (0.1, 0.100001, 1.0, 1.5):
        h.observe(value)
    get = registry.get_sample_value
    assert get("h_seconds_bucket", {"le": "0.1"}) == 1
    assert get("h_seconds_bucket", {"le": "1.0"}) == 3
    assert get("h_seconds_bucket", {"le": "+Inf"}) == 4
    assert get("h_seconds_count") == 4
    assert get("h_seconds_sum") == pytest.approx(2.700001)


def test_a_removed_child_has_no_series_and_comes_back_at_zero() -> None:
    registry = CollectorRegistry()
    c = Counter("c", "C.", ("service",), registry=registry)
    c.labels("web").inc(5)
    c.remove("web")
    c.remove("never-made")  # no error: nothing to forget
    assert registry.get_sample_value("c_total", {"service": "web"}) is None
    c.labels("web").inc()
    assert registry.get_sample_value("c_total", {"service": "web"}) == 1


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: Counter("1bad", "."), "invalid metric name"),
        (lambda: Counter("c", ".", ("bad-label",)), "invalid label name"),
        (lambda: Counter("c", ".", ("__reserved",)), "invalid label name"),
        (lambda: Counter("c", ".", ("a", "a")), "label name twice"),
        (lambda: Histogram("h", ".", ("le",)), "'le' is the buckets' label"),
        (lambda: Histogram("h", ".", buckets=(1.0, 0.5)), "increasing"),
        (lambda: Counter("c", ".").inc(-1), "only goes up"),
        (lambda: Counter("c", ".", ("service",)).inc(), "use labels"),
        (lambda: Counter("c", ".", ("service",)).labels("a", "b"), "given values"),
        (lambda: Counter("c", ".").labels("a"), "has no labels"),
        (lambda: GaugeMetricFamily("g", ".", labels=("a",)).add_metric((), 1), "given values"),
        (
            lambda: HistogramMetricFamily("h", ".").add_metric((), [("1.0", 1)], 1.0),
            "last bucket must be \\+Inf",
        ),
    ],
)
def test_a_bad_metric_is_refused_with_the_reason(make, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        make()


def test_a_second_series_of_one_name_is_refused_and_unregister_frees_it() -> None:
    registry = CollectorRegistry()
    first = Counter("jobs", "Jobs.", registry=registry)
    with pytest.raises(ValueError, match="duplicated timeseries in the registry: jobs_total"):
        Counter("jobs_total", "The same samples.", registry=registry)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(first)
    registry.unregister(first)
    Counter("jobs", "Jobs again.", registry=registry).inc()
    assert registry.get_sample_value("jobs_total") == 1


def test_collectors_are_read_at_each_scrape_in_the_order_registered() -> None:
    registry = CollectorRegistry()
    value = [1.0]

    class Reading(Collector):
        def collect(self) -> list[Metric]:
            return [GaugeMetricFamily("r", "Read now.", value=value[0])]

    Gauge("first", "First.", registry=registry).set(3)
    registry.register(Reading())
    assert [f.name for f in registry.collect()] == ["first", "r"]
    value[0] = 7
    assert registry.get_sample_value("r") == 7
