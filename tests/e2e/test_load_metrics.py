"""End to end: the load scraper's own series on the admin ``/metrics`` (issue 57): its scrapes
by result, and the figures of real model replicas it holds (requests waiting and running, the
KV-cache use, their age), read by a real scrape that ``promtool check metrics`` accepts."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.needs import missing
from tests.support.eventually import eventually

from .conftest import Gateways, Handle
from .test_models import model_spec, serving

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(handle: Handle) -> tuple[str, Samples]:
    url = f"http://127.0.0.1:{handle.gateway.admin.port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def of(samples: Samples, name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The series of ``name`` whose labels include ``labels``."""
    return {
        key: value
        for (n, key), value in samples.items()
        if n == name and set(labels.items()) <= set(key)
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The one series of ``name`` with ``labels``' value, or None if there is none."""
    found = of(samples, name, **labels)
    assert len(found) <= 1, found
    return next(iter(found.values()), None)


LOAD_FAMILIES = (
    "gateway_load_scrapes_total",
    "gateway_load_report_age_seconds",
    "gateway_upstream_reported_requests",
    "gateway_upstream_kv_cache_usage_ratio",
)


async def test_the_scrapers_series_show_the_replicas_figures_and_failures(
    gateways: Gateways, tmp_path: Path
):
    gw = await gateways.start(models={"path_prefix": "/v1"})
    waiting = tmp_path / "waiting"
    waiting.mkdir()
    spec = model_spec(
        tmp_path,
        "llama",
        {"name": "llama"},
        load_balancing="inference",
        load_metrics={"format": "vllm", "interval": 0.1, "max_age": 0.5},
    )
    spec["replica"]["env"] |= {"WAITING_DIR": str(waiting), "KV_CACHE": "0.25"}
    await serving(gw, spec)
    busy, broken = sorted(r.id for r in gw.replicas(name="llama"))
    (waiting / busy).write_text("7")

    async def read() -> Samples | None:
        _, samples = await scrape(gw)
        queue = value(samples, "gateway_upstream_reported_requests", upstream=busy, state="waiting")
        return samples if queue == 7 else None

    samples = await eventually(read, what="the busy replica's queue on /metrics")
    assert (value(samples, "gateway_load_scrapes_total", service="llama", result="ok") or 0) >= 2
    assert value(samples, "gateway_load_scrapes_total", service="llama", result="error") == 0
    assert all(of(samples, name, service="llama") for name in LOAD_FAMILIES)
    kv = of(samples, "gateway_upstream_kv_cache_usage_ratio", service="llama")
    assert sorted(kv.values()) == [0.25, 0.25]
    running = of(samples, "gateway_upstream_reported_requests", state="running")
    assert set(running.values()) == {0}
    ages = of(samples, "gateway_load_report_age_seconds", service="llama")
    assert len(ages) == 2
    assert all(0 <= age < 0.5 for age in ages.values()), ages

    # A replica whose figure cannot be read: its scrapes count as errors, and once its last
    # figures are older than max_age they leave the gauges; their age stays, growing.
    (waiting / broken).write_text("many")

    async def stale() -> Samples | None:
        _, samples = await scrape(gw)
        age = value(samples, "gateway_load_report_age_seconds", upstream=broken) or 0
        figure = value(samples, "gateway_upstream_kv_cache_usage_ratio", upstream=broken)
        return samples if figure is None and age >= 0.5 else None

    samples = await eventually(stale, what="the broken replica's figures to expire")
    errors = value(samples, "gateway_load_scrapes_total", service="llama", result="error")
    assert (errors or 0) >= 1
    assert of(samples, "gateway_upstream_reported_requests", upstream=broken) == {}
    assert len(of(samples, "gateway_upstream_kv_cache_usage_ratio", upstream=busy)) == 1

    text, _ = await scrape(gw)
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool not installed (Debian package 'prometheus'; .ci/run installs it)")
    proc = await asyncio.create_subprocess_exec(
        promtool, "check", "metrics",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(text.encode()), 30)
    assert proc.returncode == 0, out.decode()

    # A service deleted: its series go with it.
    await gw.controller.delete("llama")

    async def gone() -> bool:
        _, samples = await scrape(gw)
        return not any(of(samples, name, service="llama") for name in LOAD_FAMILIES)

    await eventually(gone, what="the deleted service's load series to go")
