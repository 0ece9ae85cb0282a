"""The load scraper: each replica's own figures of its load, for ``load_balancing: inference``.

One guarded task per service with ``load_metrics``: every ``interval`` it fetches the metrics
path of each of the service's routable upstreams at once (``probe_client.fetch``, bounded by
the interval), reads the figures (``load_report``) and puts them in the service's pool
(``ServicePool.reports``), where the pick reads them (over TLS with the service's
``upstream_tls``, as its requests), and to ``on_scraped`` (the worker
processes' supervisor, which sends them on to every worker). A replica that does not answer keeps
its last figures until they expire (``max_age``), then counts by its in-flight requests
alone; an upstream that left is forgotten. Each scrape is counted per service, read or not
(``results``: the admin ``/metrics``' ``gateway_load_scrapes_total``).

Invariants: a task never dies silently (an error in a round is logged and the next round
runs); cancellation is never swallowed; ``stop`` cancels and awaits every task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..config import LoadMetricsConfig
from ..pool.events import PoolEvent
from ..pool.inference import ReplicaLoad
from ..pool.pool import Pool
from ..pool.service_pool import ServicePool
from ..pool.upstream import Upstream
from ..wire.upstream_tls import HTTP1, UpstreamTlsError, tls_of
from . import load_report, probe_client

log = logging.getLogger(__name__)


class LoadScraper:
    """Scrapes the replicas of every service of ``pool`` that asks for it, while started.

    A ``PoolSubscriber``: a service set with ``load_metrics`` gets a task, which ends once the
    service is removed or no longer asks."""

    def __init__(
        self,
        pool: Pool,
        on_scraped: Callable[[str, dict[str, ReplicaLoad]], object] | None = None,
    ) -> None:
        self._pool = pool
        self._on_scraped = on_scraped
        """Told of a service's figures after each round (the worker processes' supervisor)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.scrapes = 0
        """Replicas scraped (each answer, read or not)."""
        self.failures = 0
        """Scrapes that gave no figures (no answer, not 200, a figure missing)."""
        self.results: dict[str, list[int]] = {}
        """Per service, its scrapes as [read, failed] (a service removed is forgotten)."""

    async def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._pool.subscribe(self)
        for name in list(self._pool.services):
            self._begin(name)

    async def stop(self) -> None:
        self._pool.unsubscribe(self)
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._loop = None

    def on_pool_event(self, event: PoolEvent) -> None:
        if self._loop is None:
            return
        if event.kind == "service_set":
            self._begin(event.service)
        elif event.kind == "service_removed":
            task = self._tasks.pop(event.service, None)
            if task is not None:
                task.cancel()
            self.results.pop(event.service, None)

    def _begin(self, service: str) -> None:
        sp = self._pool.services.get(service)
        if sp is None or sp.routing.load_metrics is None or service in self._tasks:
            return
        assert self._loop is not None
        task = self._loop.create_task(self._run(service), name=f"load metrics of {service}")
        self._tasks[service] = task
        task.add_done_callback(lambda done: self._ended(service, done))

    def _ended(self, service: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(service) is task:
            del self._tasks[service]
        if not task.cancelled() and task.exception() is not None:
            log.error("load scraping of %s ended", service, exc_info=task.exception())

    async def _run(self, service: str) -> None:
        while True:
            sp = self._pool.services.get(service)
            config = sp.routing.load_metrics if sp is not None else None
            if sp is None or config is None:
                if sp is not None:
                    sp.reports = {}
                return
            try:
                await self.scrape(sp, config)
            except Exception:
                log.exception("load scraping of %s failed", service)
            await asyncio.sleep(config.interval)

    async def scrape(self, sp: ServicePool, config: LoadMetricsConfig) -> None:
        """One round: every routable upstream of ``sp`` scraped at once."""
        upstreams = sp.snapshot.routable
        found = await asyncio.gather(*(self._one(sp, u, config) for u in upstreams))
        kept = sp.reports
        reports: dict[str, ReplicaLoad] = {}
        for upstream in sp.snapshot.upstreams:
            old = kept.get(upstream.id)
            if old is not None:
                reports[upstream.id] = old
        for upstream, report in zip(upstreams, found, strict=True):
            if report is not None:
                reports[upstream.id] = report
        sp.reports = reports
        if self._on_scraped is not None:
            self._on_scraped(sp.routing.name, reports)

    async def _one(
        self, sp: ServicePool, upstream: Upstream, config: LoadMetricsConfig
    ) -> ReplicaLoad | None:
        report = await self._read(sp, upstream, config)
        self.scrapes += 1
        if report is None:
            self.failures += 1
        counts = self.results.setdefault(sp.routing.name, [0, 0])
        counts[0 if report is not None else 1] += 1
        return report

    async def _read(
        self, sp: ServicePool, upstream: Upstream, config: LoadMetricsConfig
    ) -> ReplicaLoad | None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(config.interval):
                status, body = await probe_client.fetch(
                    upstream.host,
                    upstream.port,
                    config.path,
                    authority=upstream.address,
                    tls=tls_of(sp.routing.upstream_tls, HTTP1),
                )
        except (TimeoutError, probe_client.ProbeError, OSError, UpstreamTlsError) as error:
            log.debug("load metrics of %s/%s: %r", upstream.service, upstream.id, error)
            return None
        if status != 200:
            return None
        text = body.decode("utf-8", "replace")
        own = sp.inflight_all().get(upstream.id, 0)
        return load_report.report(text, config.format, loop.time(), config.max_age, own)

    def __repr__(self) -> str:
        return (
            f"<LoadScraper services={len(self._tasks)} scrapes={self.scrapes} "
            f"failures={self.failures}>"
        )
