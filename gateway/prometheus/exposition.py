"""A registry written in Prometheus's text format (0.0.4) or in OpenMetrics (1.0.0), as the
scrape's ``Accept`` asks.

The two differ in little: OpenMetrics names a counter's family without its ``_total`` (its
samples keep it) and ends with ``# EOF``. Both sort labels by name, escape backslashes, new
lines and quotes in label values (and the first two in help texts), and write numbers as Go
does (``1.0``, ``+Inf``, ``NaN``, ``1e+06``): what prometheus_client wrote before, so a
scrape reads the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .families import Sample
    from .registry import CollectorRegistry

CONTENT_TYPE_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_OPENMETRICS: Final = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def float_text(value: float) -> str:
    """``value`` as Go writes a float: ``+Inf``, ``-Inf``, ``NaN``, an exponent past 1e6."""
    d = float(value)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if d != d:
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go takes an exponent sooner than Python (1e+06, not 1000000.0)
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _line(sample: Sample) -> str:
    labels = sample.labels
    if labels:
        pairs = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))
        return f"{sample.name}{{{pairs}}} {float_text(sample.value)}\n"
    return f"{sample.name} {float_text(sample.value)}\n"


def generate_latest(registry: CollectorRegistry) -> bytes:
    """``registry`` in the text format 0.0.4."""
    return _written(registry, openmetrics=False)


def generate_openmetrics(registry: CollectorRegistry) -> bytes:
    """``registry`` in OpenMetrics 1.0.0."""
    return _written(registry, openmetrics=True)


def _written(registry: CollectorRegistry, openmetrics: bool) -> bytes:
    out: list[str] = []
    for metric in registry.collect():
        name, typ, help_text = metric.name, metric.type, _escape_help(metric.documentation)
        if openmetrics:
            help_text = help_text.replace('"', r"\"")
        else:  # the text format names a counter by its samples, and has no "unknown"
            name = name + "_total" if typ == "counter" else name
            typ = "untyped" if typ == "unknown" else typ
        out.append(f"# HELP {name} {help_text}\n")
        out.append(f"# TYPE {name} {typ}\n")
        out.extend(_line(s) for s in metric.samples)
    if openmetrics:
        out.append("# EOF\n")
    return "".join(out).encode()


Encoder = Callable[["CollectorRegistry"], bytes]


def choose_encoder(accept: str | None) -> tuple[Encoder, str]:
    """The format a scrape's ``Accept`` header asks for, and its content type: OpenMetrics
    if it names it at all (as Prometheus does, first), else the text format."""
    for accepted in (accept or "").split(","):
        if accepted.split(";")[0].strip() == "application/openmetrics-text":
            return generate_openmetrics, CONTENT_TYPE_OPENMETRICS
    return generate_latest, CONTENT_TYPE_TEXT
