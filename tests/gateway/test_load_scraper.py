"""``health.load_scraper``: each replica's figures scraped into its service's pool, against
real aiohttp upstreams on loopback; and ``probe_client.fetch``, which reads them."""

from __future__ import annotations

import pytest
from aiohttp import web

from gateway.config import LoadMetricsConfig
from gateway.health import probe_client
from gateway.health.load_scraper import LoadScraper
from gateway.pool.upstream import Health
from tests.support.eventually import eventually

from .conftest import add, routing


def metrics_app(figures: dict[str, str], status: int = 200) -> web.Application:
    """An upstream whose /metrics says ``figures`` (changed in place by the test)."""

    async def metrics(request: web.Request) -> web.Response:
        text = "".join(
            f'vllm:{name}{{model_name="m"}} {value}\n' for name, value in figures.items()
        )
        return web.Response(text="# a comment\n" + text, status=status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def vllm(waiting: float, running: float, cache: float) -> dict[str, str]:
    return {
        "num_requests_waiting": str(waiting),
        "num_requests_running": str(running),
        "kv_cache_usage_perc": str(cache),
    }


CONFIG = {"format": "vllm", "interval": 0.05, "max_age": 0.5}


async def test_the_figures_reach_the_pool_and_follow_the_replica(pool, aiohttp_server):
    pool.set_service(routing("llm", prefix="/", load_metrics=CONFIG))
    busy, idle = vllm(5, 8, 0.9), vllm(0, 1, 0.1)
    for name, figures in (("busy", busy), ("idle", idle)):
        server = await aiohttp_server(metrics_app(figures))
        add(pool, "llm", name, server.port)
    sp = pool.services["llm"]
    scraper = LoadScraper(pool)
    await scraper.start()
    try:
        await eventually(lambda: set(sp.reports) == {"busy", "idle"}, what="both reports")
        assert (sp.reports["busy"].waiting, sp.reports["busy"].running) == (5.0, 8.0)
        assert sp.reports["idle"].kv_cache == 0.1
        idle["num_requests_waiting"] = "12"
        await eventually(lambda: sp.reports["idle"].waiting == 12.0, what="the new figure")
        # A service that stops asking is no longer scraped, and its figures go.
        pool.set_service(routing("llm", prefix="/"))
        await eventually(lambda: not sp.reports, what="the figures dropped")
        assert scraper.results["llm"][0] >= 4  # its counts stay while the service does
        pool.remove_service("llm")
        assert "llm" not in scraper.results
    finally:
        await scraper.stop()
    assert "scrapes=" in repr(scraper)


async def test_a_replica_that_stops_answering_keeps_its_figures_until_they_expire(
    pool, aiohttp_server
):
    pool.set_service(routing("llm", prefix="/", load_metrics=CONFIG))
    ok = await aiohttp_server(metrics_app(vllm(1, 2, 0.3)))
    broken = await aiohttp_server(metrics_app(vllm(1, 2, 0.3), status=500))
    add(pool, "llm", "ok", ok.port)
    add(pool, "llm", "broken", broken.port)
    add(pool, "llm", "sick", ok.port, health=Health.UNHEALTHY)
    sp = pool.services["llm"]
    scraper = LoadScraper(pool)
    config = LoadMetricsConfig(**CONFIG)  # type: ignore[arg-type]
    await scraper.scrape(sp, config)
    assert set(sp.reports) == {"ok"}  # not 200: no figures; not routable: not scraped
    assert scraper.failures == 1
    assert scraper.results == {"llm": [1, 1]}  # [read, failed]
    first = sp.reports["ok"]
    await ok.close()
    await scraper.scrape(sp, config)
    assert sp.reports["ok"] is first  # kept, to expire at its time
    assert scraper.results == {"llm": [1, 3]}
    pool.remove_upstream("llm", "ok")
    await scraper.scrape(sp, config)
    assert sp.reports == {}


async def test_fetch_reads_a_framed_body_within_its_limit(aiohttp_server):
    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(3):
            await response.write(b"x" * 1000)
        await response.write_eof()
        return response

    async def plain(request: web.Request) -> web.Response:
        return web.Response(text="y" * 5000)

    app = web.Application()
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/plain", plain)
    server = await aiohttp_server(app)
    authority = f"127.0.0.1:{server.port}"
    assert await probe_client.fetch("127.0.0.1", server.port, "/chunked", authority=authority) == (
        200,
        b"x" * 3000,
    )
    status, body = await probe_client.fetch("127.0.0.1", server.port, "/plain", authority=authority)
    assert (status, body) == (200, b"y" * 5000)
    status, _ = await probe_client.fetch("127.0.0.1", server.port, "/nope", authority=authority)
    assert status == 404
    with pytest.raises(probe_client.ProbeInvalidResponse, match="longer than 100 bytes"):
        await probe_client.fetch("127.0.0.1", server.port, "/plain", authority=authority, limit=100)
