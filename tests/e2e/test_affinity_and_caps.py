"""End to end: affinity by consistent hash and the in-flight cap with its queue, through the
real gateway, in one process and with two workers.

Affinity: each user's requests go to one replica, in every worker (the hash is the same in
every process); a replica drained away moves only its own users. Caps: a replica is never
sent more than ``max_in_flight_per_replica`` at once (the replica counts what it holds), the
rest wait their turn and are served; past ``queue_timeout`` they get 503 with Retry-After."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.eventually import eventually

from .conftest import Gateways, serving
from .test_auth import admin, echo_spec, metric


async def replica_of(url: str, user: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url, headers={"X-User": user}) as r:
        assert r.status == 200
        return str((await r.json())["replica"])


@pytest.mark.parametrize("workers", [0, 2])
async def test_a_user_keeps_its_replica_and_only_a_leavers_users_move(
    gateways: Gateways, tmp_path: Path, workers: int
):
    gw = await gateways.start(**({"workers": workers} if workers else {}))
    balancing = {"policy": "hash", "key": "header:X-User"}
    await serving(gw, echo_spec(tmp_path, replicas=3, load_balancing=balancing))
    users = [f"user-{i}" for i in range(30)]
    before: dict[str, str] = {}
    for user in users:
        seen = {await replica_of(gw.url + "/", user) for _ in range(2)}  # new connections
        assert len(seen) == 1, (user, seen)
        before[user] = seen.pop()
    assert len(set(before.values())) == 3  # spread over all three
    leaving = before[users[0]]
    async with (
        aiohttp.ClientSession() as s,
        s.post(admin(gw) + f"/api/services/web/upstreams/{leaving}/drain") as r,
    ):
        assert r.status == 200

    async def moved() -> bool:
        return await replica_of(gw.url + "/", users[0]) != leaving

    await eventually(moved, what="the drain in every process")
    for user in users:
        now = await replica_of(gw.url + "/", user)
        if before[user] == leaving:
            assert now != leaving
        else:
            assert now == before[user], user


async def fetch(url: str) -> tuple[int, Any, dict[str, str], float]:
    began = time.monotonic()
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        body = await r.json()
        return r.status, body, dict(r.headers), time.monotonic() - began


@pytest.mark.parametrize("workers", [0, 2])
async def test_the_cap_holds_and_the_rest_wait_their_turn(
    gateways: Gateways, tmp_path: Path, workers: int
):
    gw = await gateways.start(**({"workers": workers} if workers else {}))
    data = echo_spec(tmp_path, limits={"max_in_flight_per_replica": 2}, queue_timeout=10)
    await serving(gw, data)
    results = await asyncio.gather(*(fetch(gw.url + "/slow?s=0.4") for _ in range(8)))
    assert [status for status, *_ in results] == [200] * 8
    # Never more than 2 at the replica (with 2 workers: 1 each), so 8 take 4 rounds at least.
    assert max(body["most"] for _, body, _, _ in results) <= 2
    assert max(took for *_, took in results) >= 4 * 0.4 - 0.05
    async with aiohttp.ClientSession() as s:

        async def counted() -> bool:
            waited = await metric(s, gw, 'gateway_service_queue_wait_seconds_count{service="web"}')
            return waited is not None and waited >= 6

        await eventually(counted, what="the queue's waits in /metrics")


@pytest.mark.parametrize("workers", [0, 2])
async def test_past_queue_timeout_503_with_retry_after(
    gateways: Gateways, tmp_path: Path, workers: int
):
    gw = await gateways.start(**({"workers": workers} if workers else {}))
    data = echo_spec(tmp_path, limits={"max_in_flight_per_replica": 2}, queue_timeout=0.3)
    await serving(gw, data)
    results = await asyncio.gather(*(fetch(gw.url + "/slow?s=1.5") for _ in range(6)))
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    # One process: 2 served. Two workers, 1 each: 2, or 1 if the kernel gave one worker all
    # six connections (SO_REUSEPORT spreads connections by a hash, 1 chance in 32).
    assert len(served) == 2 or (workers and len(served) == 1)
    assert len(refused) == 6 - len(served)
    for _, body, headers, took in refused:
        assert headers["Retry-After"] == "1"
        assert "no slot free within 0.3 s" in body["message"]
        assert 0.25 < took < 1.4  # answered at the timeout, not after the slow ones
    async with aiohttp.ClientSession() as s:

        async def counted() -> bool:
            rejected = await metric(
                s, gw, 'gateway_service_queue_rejected_requests_total{service="web"}'
            )
            return rejected == len(refused)

        await eventually(counted, what="the queue's 503s in /metrics")
        async with s.get(admin(gw) + "/api/services/web") as r:
            guards = (await r.json())["guards"]
        assert guards["max_in_flight_per_replica"] == 2
        assert guards["queue_rejected"] == len(refused)
