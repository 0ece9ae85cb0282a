"""End to end: rate limits through the real gateway. A key's burst, then 429 with
Retry-After and the RateLimit-* fields; a spoofed X-Forwarded-For is no new key unless the
gateway trusts its peer (then the last hop is); with two workers each enforces its share (one
keep-alive connection meets one worker's, many connections the whole limit), as the README
says."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.support.eventually import eventually

from .conftest import Gateways, serving
from .test_auth import admin, echo_spec, metric

LIMIT = {"path_prefix": "/api", "key": "ip", "rps": 0.1, "burst": 3}
"""A token every 10 s: nothing refills while a test runs."""


async def status(session: aiohttp.ClientSession, url: str, **headers: str) -> int:
    async with session.get(url, headers=headers) as response:
        await response.read()
        return response.status


async def test_a_burst_then_429_and_spoofing_gets_nothing(gateways: Gateways, tmp_path: Path):
    gw = await gateways.start()
    await serving(gw, echo_spec(tmp_path, rate_limits=[LIMIT]))
    async with aiohttp.ClientSession() as s:
        assert [await status(s, gw.url + "/api/x") for _ in range(3)] == [200] * 3
        async with s.get(gw.url + "/api/x") as refused:
            assert refused.status == 429
            body = await refused.json()
            h = refused.headers
        assert body["error"] == "rate_limited"
        assert body["service"] == "web"
        assert (h["Retry-After"], h["RateLimit-Limit"], h["RateLimit-Remaining"]) == (
            "10",
            "3",
            "0",
        )
        assert int(h["RateLimit-Reset"]) == 30
        assert h["RateLimit-Policy"] == "3;w=30"
        # Outside the prefix: not limited.
        assert await status(s, gw.url + "/other") == 200
        # A made-up X-Forwarded-For is not the client's address: still the same bucket.
        for i in range(20):
            assert await status(s, gw.url + "/api/x", **{"X-Forwarded-For": f"10.0.0.{i}"}) == 429

        async def counted() -> bool:
            value = await metric(s, gw, 'gateway_rate_limited_requests_total{service="web"}')
            return value == 21

        await eventually(counted, what="the 429s in /metrics")
        async with s.get(admin(gw) + "/api/services/web") as r:
            guards = (await r.json())["guards"]
        assert guards["rate_limited"] == 21
        assert guards["rate_limits"] == [{"path_prefix": "/api", "key": "ip", "rps": 0.1,
                                          "burst": 3}]  # fmt: skip


async def test_behind_a_trusted_proxy_the_last_hop_is_the_client(
    gateways: Gateways, tmp_path: Path
):
    gw = await gateways.start(proxy={"shutdown_timeout": 2, "trust_forwarded": True})
    await serving(gw, echo_spec(tmp_path, rate_limits=[LIMIT]))
    async with aiohttp.ClientSession() as s:
        for client in ("192.0.2.1", "192.0.2.2"):
            # The trusted proxy appended the client's address; what the client wrote before
            # it does not count.
            got = [
                await status(s, gw.url + "/api/x", **{"X-Forwarded-For": f"6.6.6.{i}, {client}"})
                for i in range(4)
            ]
            assert got == [200, 200, 200, 429], client


@pytest.mark.parametrize("workers", [2])
async def test_each_worker_enforces_its_share(gateways: Gateways, tmp_path: Path, workers: int):
    limit = {"path_prefix": "/", "key": "header:X-User", "rps": 0.1, "burst": 4}
    gw = await gateways.start(workers=workers)
    await serving(gw, echo_spec(tmp_path, rate_limits=[limit]))
    # One keep-alive connection is served by one worker: its share, burst 4 // 2.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        got = [await status(s, gw.url + "/", **{"X-User": "a"}) for _ in range(4)]
    assert got == [200, 200, 429, 429]
    # A connection each: spread over both workers, the whole burst (and no more) goes through.
    got = []
    for _ in range(30):
        async with aiohttp.ClientSession() as fresh:
            got.append(await status(fresh, gw.url + "/", **{"X-User": "b"}))
    assert got.count(200) == 4
    assert got.count(429) == 26
