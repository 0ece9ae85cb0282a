"""Autoscaling over a cluster (issue 54, item 3): demand on any node counts.

Real processes: three etcd members, three gateways on 127.0.0.2, .3 and .4 with ``workers: 2``
and a lease TTL of 2 s, echo replicas. Each node reports its traffic per service with its
report; the leader's autoscaler reads it merged over the live nodes. Requests sent to a node
that does not lead, while the service is at zero, are held in one of its workers: they make
the leader scale up and are answered once the replica is ready. A node killed while it holds
requests stops counting within its lease TTL.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.cluster_nodes import LEASE_TTL, Nodes, started
from tests.e2e.conftest import PROBE, ROLLOUT
from tests.e2e.test_cluster import leader_and_others, metrics_text
from tests.e2e.test_cluster_workers import replica_ports
from tests.support.eventually import eventually

pytestmark = pytest.mark.slow

ECHO = Path(__file__).with_name("echo_replica.py")
SAMPLE_INTERVAL = 1.0
"""The leader's autoscaler samples every second (``reconciler.SAMPLE_INTERVAL``)."""


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    async with started(tmp_path, workers=2, ports=replica_ports()) as cluster:
        yield cluster


def autoscaled(delay_file: Path) -> dict[str, Any]:
    """``web`` from 0 to 1 replica; a replica sleeps what ``delay_file`` says before it
    listens (the same revision however long: the file is read as it starts)."""
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "replicas": "0..1",
        "scaling": {
            "target": 2,
            "window": "2s",
            "scale_up_delay": "0.5s",
            "scale_down_delay": "2s",
        },
        "replica": {"commands": [f"sleep $(cat {delay_file})", f"{sys.executable} {ECHO}"]},
        "probes": [PROBE],
        "rollout": ROLLOUT | {"start_timeout": 60},
    }


async def view(nodes: Nodes, among: Any = None) -> dict[str, Any]:
    status, body = await nodes.api("GET", "/api/services/web", node=among)
    assert status == 200, body
    return dict(body)


def view_where(
    nodes: Nodes, check: Callable[[dict[str, Any]], bool], among: Any = None
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """For ``eventually``: the service's view (from ``among``, else any node) once ``check``
    holds of it (the last view is in the failure)."""

    async def seen() -> dict[str, Any]:
        body = await view(nodes, among)
        assert check(body), body
        return body

    return seen


def at_zero(seen: dict[str, Any]) -> bool:
    running = [r for r in seen["replicas"] if r["state"] not in ("stopped", "failed")]
    return seen["desired"] == 0 and not running


async def test_requests_held_on_a_follower_scale_from_zero_and_a_dead_ones_stop_counting(
    nodes: Nodes, tmp_path: Path
) -> None:
    delay = tmp_path / "start-delay"
    delay.write_text("0")
    status, body = await nodes.api("PUT", "/api/services/web", autoscaled(delay))
    assert status in (200, 201), body
    # A new service starts one replica (its revision proven), then idle goes to zero.
    await eventually(view_where(nodes, at_zero), timeout=40, what="web at zero")
    leader, (follower, other) = leader_and_others(nodes)

    # 1. Held on a follower (in one of its workers), answered once a replica is ready.
    async with aiohttp.ClientSession() as http:

        async def request(i: int) -> tuple[int, str, float]:
            sent = time.monotonic()
            async with http.get(f"{follower.url}/held/{i}") as answer:
                return answer.status, await answer.text(), time.monotonic() - sent

        answers = await asyncio.gather(*(request(i) for i in range(4)))
    print(f"\nheld on follower {follower.name}, answered after", [f"{t:.2f}s" for *_, t in answers])
    assert [status for status, *_ in answers] == [200] * 4, answers
    assert len({json.loads(text)["replica"] for _, text, _ in answers}) == 1
    assert max(t for *_, t in answers) < 20
    # The leader counts the cold start once every node routes to the replica.
    cold_starts = 'gateway_service_cold_starts_total{service="web"} 1.0'
    await eventually(
        lambda: asyncio.to_thread(lambda: cold_starts in metrics_text(leader.admin)),
        what="the cold start",
    )

    # 2. A follower killed while it holds requests: they stop counting within its lease TTL.
    await eventually(view_where(nodes, at_zero), timeout=40, what="web at zero again")
    delay.write_text("30")  # the next cold start takes long: the requests stay held
    async with aiohttp.ClientSession() as http:
        held = [asyncio.ensure_future(http.get(f"{other.url}/held/{i}")) for i in range(3)]
        await eventually(
            view_where(nodes, lambda v: v["autoscaling"]["held"] == 3, among=leader),
            what=f"the 3 requests held on {other.name} counted by the leader",
        )
        nodes.kill(other)
        killed = time.monotonic()
        await eventually(
            view_where(nodes, lambda v: v["autoscaling"]["held"] == 0, among=leader),
            timeout=LEASE_TTL + SAMPLE_INTERVAL + 5,
            what="the dead node's held requests no longer counted",
        )
        gone = time.monotonic() - killed
        for future in held:
            future.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    print(f"{other.name} killed holding 3 requests: not counted {gone:.2f} s later")
    # The TTL, a sample, and room for a machine under load (the view is polled).
    assert gone <= LEASE_TTL + SAMPLE_INTERVAL + 1.5, gone
