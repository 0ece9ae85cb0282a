"""A real Prometheus scrapes a real gateway and reads ``gateway_upstream_up`` back.

The gateway runs in-process (``run_gateway``) with a static-backend service whose replica is
an aiohttp server on loopback. Prometheus runs as a process on loopback with a config derived
from ``configs/prometheus.yml`` (the target pointed at the gateway's admin listener, a 1 s
scrape interval), its data in ``tmp_path``. The test polls Prometheus's query API, bounded:
Prometheus only learns what it scrapes, on its own schedule.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.config import load_config
from controller.metrics import ControllerMetrics
from controller.serving import Gateway, run_gateway
from gateway.health.load_scraper import LoadScraper
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.scrape import ConnectionsCollector, LoadCollector, MetricsCollector
from gateway.pool.pool import Pool
from tests.needs import missing
from tests.support.eventually import eventually
from tests.support.ports import free_port
from tests.support.raw_servers import cleanup_runner

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "configs" / "prometheus.yml"
POLL_TIMEOUT = 15.0
POLL_STEP = 0.2


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} not installed (Debian package 'prometheus'; .ci/run installs it)")
    return path


@pytest.mark.parametrize(
    ("what", "name"),
    [("config", "prometheus.yml"), ("rules", "prometheus-alerts.yml")],
    ids=["scrape-config", "crash-alerts"],
)
async def test_the_shipped_prometheus_files_are_valid(what: str, name: str) -> None:
    path = Path(__file__).resolve().parents[2] / "configs" / name
    proc = await asyncio.create_subprocess_exec(
        binary("promtool"),
        "check",
        what,
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()


@pytest.fixture
async def replica() -> AsyncIterator[tuple[int, dict[str, bool]]]:
    """A static replica on loopback whose /health can be turned off: (port, switch)."""
    switch = {"healthy": True}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if switch["healthy"] else 503)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port: int = runner.addresses[0][1]
    try:
        yield port, switch
    finally:
        await cleanup_runner(runner)


@pytest.fixture
async def gateway(tmp_path: Path, replica) -> AsyncIterator[Gateway]:
    port, _ = replica
    config = {
        "listen": "127.0.0.1:0",
        "admin": {"listen": "127.0.0.1:0", "token_env": None},
        "state_dir": str(tmp_path / "state"),
        "access_log": {"enabled": True, "format": "json", "path": str(tmp_path / "access.log")},
        "services": [
            {
                "name": "static",
                "route": {"path_prefix": "/"},
                "backend": "static",
                "replica": {"addresses": [f"127.0.0.1:{port}"]},
                "probes": [
                    {
                        "type": "http",
                        "path": "/health",
                        "interval": 0.2,
                        "timeout": 1,
                        "healthy_threshold": 1,
                        "unhealthy_threshold": 1,
                    }
                ],
            }
        ],
    }
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    stop = asyncio.Event()
    started: asyncio.Future[Gateway] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_gateway(load_config(path), stop, started=started.set_result))
    try:
        done, _ = await asyncio.wait({task, started}, timeout=10, return_when="FIRST_COMPLETED")
        if started not in done:
            if task.done():
                task.result()
            raise AssertionError("the gateway did not start within 10 s")
        yield started.result()
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


@pytest.fixture
async def prometheus(tmp_path: Path, gateway: Gateway) -> AsyncIterator[str]:
    """A Prometheus process scraping ``gateway``; yields its base URL."""
    exe = binary("prometheus")
    scrape = yaml.safe_load(SCRAPE_CONFIG.read_text())
    scrape["global"]["scrape_interval"] = "1s"
    scrape["global"]["scrape_timeout"] = "1s"
    (job,) = scrape["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{gateway.admin.port}"]}]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        exe,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=log,
        stdin=asyncio.subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def query(session: aiohttp.ClientSession, base: str, promql: str) -> list[dict[str, Any]]:
    """An instant query; [] while Prometheus is not up yet or has nothing."""
    try:
        async with session.get(f"{base}/api/v1/query", params={"query": promql}) as resp:
            if resp.status != 200:
                return []
            body = await resp.json()
    except aiohttp.ClientConnectionError:
        return []
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def value_seen(
    session: aiohttp.ClientSession, base: str, promql: str, expected: float
) -> list[dict[str, Any]]:
    """The series of ``promql`` once one of them equals ``expected`` (Prometheus scrapes the
    gateway every second)."""

    async def seen() -> list[dict[str, Any]]:
        found = await query(session, base, promql)
        assert any(float(r["value"][1]) == expected for r in found), found
        return found

    return await eventually(
        seen, timeout=POLL_TIMEOUT, every=POLL_STEP, what=f"{promql} to be {expected}"
    )


async def test_prometheus_reads_upstream_health_from_the_gateway(
    gateway: Gateway, prometheus: str, replica, tmp_path: Path
) -> None:
    _, switch = replica
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{gateway.traffic.port}/hi") as resp:
            assert (resp.status, await resp.text()) == (200, "hello")

        up = 'gateway_upstream_up{job="gateway",service="static"}'
        (series,) = await value_seen(session, prometheus, up, 1.0)
        assert series["metric"]["revision"] == "1"
        assert series["metric"]["upstream"]
        requests = 'sum(gateway_requests_total{service="static",code="2xx"})'
        await value_seen(session, prometheus, requests, 1.0)

        # The replica fails its probe: the gateway takes it out, and Prometheus sees it.
        switch["healthy"] = False
        await value_seen(session, prometheus, up, 0.0)
        state = 'gateway_upstream_state{service="static",state="unhealthy"}'
        await value_seen(session, prometheus, state, 1.0)
        replicas = 'gateway_service_replicas{service="static",state="unhealthy"}'
        await value_seen(session, prometheus, replicas, 1)


async def test_the_gateways_metrics_pass_promtool_and_the_reference_parsers(
    gateway: Gateway,
) -> None:
    """The whole ``/metrics`` of a serving gateway, as Prometheus (OpenMetrics) and as a
    plain scrape (the text format) get it: ``promtool check metrics`` finds no problem in
    the text, and prometheus_client's parsers read both to the same samples."""
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )
    from prometheus_client.parser import text_string_to_metric_families

    base = f"http://127.0.0.1:{gateway.admin.port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{gateway.traffic.port}/hi") as resp:
            assert resp.status == 200
        async with session.get(f"{base}/metrics") as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await resp.text()
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        async with session.get(f"{base}/metrics", headers={"Accept": accept}) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            openmetrics = await resp.text()
    proc = await asyncio.create_subprocess_exec(
        binary("promtool"), "check", "metrics",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(text.encode()), 30)
    assert proc.returncode == 0, out.decode()

    def samples(families: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples
        }

    plain = samples(text_string_to_metric_families(text))
    assert ("gateway_workers", ()) not in plain  # one process: no supervisor
    ups = [v for (name, _), v in plain.items() if name == "gateway_upstream_up"]
    assert ups == [1.0]
    # The same series in both (a counter's value may have moved between the two scrapes).
    assert samples(openmetrics_families(openmetrics)).keys() == plain.keys()


async def test_metrics_are_openmetrics_if_the_scrape_asks_else_the_text_format(
    gateway: Gateway,
) -> None:
    """``Accept`` chooses the format (prometheus_client's ``choose_encoder``): OpenMetrics,
    which names a counter's family without ``_total`` and ends with ``# EOF``, for a scrape
    that names it; the text format 0.0.4 for one that does not."""
    url = f"http://127.0.0.1:{gateway.admin.port}/metrics"
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers={"Accept": "application/openmetrics-text"}) as resp:
            om_type = resp.headers["Content-Type"]
            openmetrics = await resp.text()
        async with session.get(url, headers={"Accept": "text/plain"}) as resp:
            text_type = resp.headers["Content-Type"]
            text = await resp.text()
    assert om_type.startswith("application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert openmetrics.endswith("\n# EOF\n")
    assert "# TYPE gateway_requests counter\n" in openmetrics
    assert text_type == "text/plain; version=0.0.4; charset=utf-8"
    assert "# EOF" not in text
    assert "# TYPE gateway_requests_total counter\n" in text


# -- the dashboard -------------------------------------------------------------------------

DASHBOARD = ROOT / "configs" / "grafana-dashboard.json"
GRAFANA_VARIABLES = {"$service": ".*", "$__rate_interval": "1m", "$__range": "1h"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    out = []
    for expr in exprs:
        for name, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(name, value)
        out.append(expr)
    return out


def exposed_names() -> set[str]:
    """Every sample name the gateway can expose (counters as _total, histograms' series)."""
    registry = CollectorRegistry()
    registry.register(MetricsCollector(GatewayMetrics()))
    registry.register(ControllerMetrics(SimpleNamespace(services={})))  # type: ignore[arg-type]
    registry.register(ConnectionsCollector(lambda: (0, 0)))  # the traffic listener's (serving)
    pool = Pool()
    registry.register(LoadCollector(LoadScraper(pool), pool, lambda: 0.0))  # the scraper's
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def test_the_dashboard_uses_only_metrics_the_gateway_exposes() -> None:
    used = {m for q in dashboard_queries() for m in re.findall(r"\bgateway_[a-z_]+", q)}
    assert used
    assert used <= exposed_names(), used - exposed_names()


async def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses every expression of a rules file: one recording rule per query.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": q}
                    for i, q in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = await asyncio.create_subprocess_exec(
        binary("promtool"),
        "check",
        "rules",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()


# -- the alerts the gateway ships (configs/prometheus-alerts.yml) ---------------------------

ALERTS = Path(__file__).resolve().parents[2] / "configs" / "prometheus-alerts.yml"


def shipped_alerts() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    return {rule["alert"]: rule["expr"] for rule in rules}


def test_the_crash_alerts_use_only_metrics_the_gateway_exposes() -> None:
    alerts = shipped_alerts()
    assert set(alerts) == {"GatewayReplicaCrashed", "GatewayUpstreamsDown"}
    used = {m for q in alerts.values() for m in re.findall(r"\bgateway_[a-z_]+", q)}
    assert used <= exposed_names(), used - exposed_names()
    assert "gateway_replica_exits_total" in used
