"""A cluster of three gateway nodes on one etcd cluster of three members, end to end.

Real processes: three etcd members and three gateways on 127.0.0.2, .3 and .4, each running
the replicas the leader places on it (``python -m http.server`` on the node's address). Load
goes to every node at once and every failed request is counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster_nodes import SERVER, Nodes
from tests.e2e.conftest import PROBE, ROLLOUT, Load
from tests.etcd_cluster import EtcdCluster


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    etcd = EtcdCluster(tmp_path / "etcd", 3).start()
    cluster = Nodes(tmp_path / "nodes", etcd)
    try:
        await cluster.start_all()
        yield cluster
    finally:
        await cluster.close()
        etcd.close()


def web(site: Callable[[str], str], version: str, replicas: int = 3) -> dict[str, Any]:
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {"commands": [SERVER], "working_dir": site(version)},
        "probes": [PROBE],
        "retries": {"attempts": 3},
        "rollout": ROLLOUT | {"drain_timeout": 5},
    }


async def serving(nodes: Nodes, revision: int, replicas: int, timeout: float = 30) -> None:
    """Until the service serves ``revision`` with ``replicas`` ready and no rollout."""

    async def done() -> bool:
        status, view = await nodes.api("GET", "/api/services/web")
        return (
            status == 200
            and view["serving_revision"] == revision
            and view["rollout"] is None
            and view["ready"] == replicas
        )

    deadline = time.monotonic() + timeout
    while not await done():
        if time.monotonic() > deadline:
            _, view = await nodes.api("GET", "/api/services/web")
            raise AssertionError(f"revision {revision} not serving: {view}")
        await asyncio.sleep(0.2)


async def placed_nodes(nodes: Nodes) -> list[str]:
    """The node each replica runs on, from its address (a replica listens on its node's)."""
    names = {n.host: n.name for n in nodes.nodes}
    status, view = await nodes.api("GET", "/api/services/web")
    assert status == 200, view
    hosts = [r["address"].rsplit(":", 1)[0] for r in view["replicas"] if r.get("address")]
    return sorted(names.get(h, h) for h in hosts)


async def test_a_rolling_update_across_three_nodes_fails_no_request(
    nodes: Nodes, site: Callable[[str], str]
) -> None:
    status, body = await nodes.api("PUT", "/api/services/web", web(site, "v1"), node=nodes.nodes[2])
    assert status in (200, 201), body
    await serving(nodes, 1, 3)
    assert await placed_nodes(nodes) == ["n1", "n2", "n3"]  # spread: one replica per node
    loads = [Load(n.url, clients=4, limit=60) for n in nodes.nodes]
    for load in loads:
        await load.__aenter__()
    try:
        status, body = await nodes.api("PUT", "/api/services/web", web(site, "v2"))
        assert status == 200, body
        await serving(nodes, 2, 3)
        marks = [load.mark() for load in loads]
        for load in loads:
            await load.more(30)
    finally:
        for load in loads:
            await load.__aexit__(None, None, None)
    for node, load, mark in zip(nodes.nodes, loads, marks, strict=True):
        print(f"{node.name}: {load.summary()}")
        assert not load.failures, f"{node.name}: {load.summary()}"
        assert load.bodies(mark) == {"v2"}, node.name
