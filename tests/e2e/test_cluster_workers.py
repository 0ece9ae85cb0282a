"""A cluster whose nodes serve with two worker processes each (issue 54, item 2).

Real processes: three etcd members, three gateways on 127.0.0.2, .3 and .4 with ``workers: 2``
(so nine gateway processes), and echo replicas (``echo_replica.py``, on the node's address).
Each node's workers serve from the pools the node follows; a drain on the leader waits for
every node's report, and a node reports a drain done only once each of its workers said it
holds nothing of the upstream.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.cluster_nodes import Node, Nodes, started
from tests.e2e.conftest import PROBE, ROLLOUT
from tests.e2e.test_cluster import leader_and_others, loaded, no_failures, unloaded
from tests.support.eventually import eventually
from tests.support.ports import port_block

pytestmark = pytest.mark.slow

ECHO = Path(__file__).with_name("echo_replica.py")
SLOW = 6.0
"""Seconds the slow request is held by its replica."""


def replica_ports() -> int:
    """Replica ports apart from the other cluster tests' (23000 on) and below the ephemeral
    range: a replica that takes its time to listen must not meet another test's server on
    its port, answering its probes."""
    return port_block(600)


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    async with started(tmp_path, workers=2, ports=replica_ports()) as cluster:
        yield cluster


def echo(version: str, replicas: int = 3) -> dict[str, Any]:
    """``web`` on echo replicas; ``version`` (an environment variable) makes a revision."""
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {
            "commands": [f"{sys.executable} {ECHO}"],
            "env": {"VERSION": version},
        },
        "probes": [PROBE],
        "retries": {"attempts": 3},
        "rollout": ROLLOUT | {"drain_timeout": 30},
    }


async def serving(nodes: Nodes, revision: int, replicas: int, timeout: float = 60) -> dict:
    """Until ``web`` serves ``revision`` with ``replicas`` ready and no rollout; its view."""

    async def done() -> dict:
        status, view = await nodes.api("GET", "/api/services/web")
        assert status == 200, view
        assert (view["serving_revision"], view["rollout"], view["ready"]) == (
            revision,
            None,
            replicas,
        ), view  # the last view is in the failure
        return dict(view)

    return await eventually(done, timeout=timeout, every=0.2, what=f"revision {revision} serving")


def inflight(node: Node) -> float:
    """``web``'s requests in flight on ``node``, its workers' included (their last reports)."""
    with urllib.request.urlopen(node.admin + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_inflight_requests{") and 'service="web"' in line
    )


def pool_requests(node: Node) -> float:
    """etcd requests ``node`` made for the pools: records, reports (``gateway_cluster_etcd_
    requests_total{part="pools"}``)."""
    with urllib.request.urlopen(node.admin + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    prefix = f'gateway_cluster_etcd_requests_total{{node="{node.name}",part="pools"}}'
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def test_a_rollout_on_nodes_with_workers_fails_nothing_and_waits_for_a_follower_worker(
    nodes: Nodes,
) -> None:
    """Load on every node through a rolling update of 3 replicas: no request fails. A slow
    request held in one worker of a node that does not lead keeps its replica running (the
    drain waits for it) and is answered whole by that replica of revision 1."""
    status, body = await nodes.api("PUT", "/api/services/web", echo("v1"))
    assert status in (200, 201), body
    view = await serving(nodes, 1, 3)
    first = {r["id"] for r in view["replicas"]}
    _, others = leader_and_others(nodes)
    follower = others[0]

    async with aiohttp.ClientSession() as http:

        async def slow() -> tuple[int, dict[str, Any], float]:
            async with http.get(f"{follower.url}/slow?s={SLOW}") as answer:
                return answer.status, json.loads(await answer.text()), time.monotonic()

        held = asyncio.ensure_future(slow())
        await eventually(
            lambda: asyncio.to_thread(lambda: inflight(follower) >= 1),
            what="the slow request in flight",
        )
        loads = await loaded(nodes.nodes)
        before = [await asyncio.to_thread(pool_requests, n) for n in others]
        try:
            began = time.monotonic()
            status, body = await nodes.api("PUT", "/api/services/web", echo("v2"))
            assert status == 200, body
            view = await serving(nodes, 2, 3)
            done = time.monotonic()
            for load in loads:
                await load.more(30)
            after = [await asyncio.to_thread(pool_requests, n) for n in others]
            loaded_for = time.monotonic() - began
        finally:
            await unloaded(loads)
        status, answer, answered = await held
    no_failures(nodes.nodes, loads)
    requests = sum(len(load.outcomes) for load in loads)
    print(
        f"\n{requests} requests on 3 nodes of 2 workers, 0 failed; rollout {done - began:.2f} s;"
        f" the slow request answered {answered - began:.2f} s after the PUT, the rollout"
        f" complete {done - answered:.2f} s after it"
    )
    rates = [(a - b) / loaded_for for a, b in zip(after, before, strict=True)]
    print(
        "etcd requests for the pools (reports included) per second on each follower, under"
        f" load for {loaded_for:.1f} s: {', '.join(f'{r:.2f}' for r in rates)}"
    )
    assert all(rate < 10 for rate in rates), rates  # no storm of reports: one a look at most
    assert status == 200, answer
    assert answer["replica"] in first, answer  # not retried elsewhere: its replica lived on
    assert done >= answered, "the rollout completed before the slow request was answered"
    live = {r["id"] for r in view["replicas"] if r["state"] in ("starting", "ready", "draining")}
    assert len(live) == 3
    assert not live & first
