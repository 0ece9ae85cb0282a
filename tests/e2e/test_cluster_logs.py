"""A replica's logs through any node of a cluster (issue 54.5), end to end.

Three gateway nodes on 127.0.0.2, .3 and .4 on one etcd member; each replica writes its log on
the node that runs it. Through a node that does not lead, ``gateway logs`` is answered by the
node that runs the replica; a replica that ended, by the leader, from the node that ran it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster_nodes import SERVER, Node, Nodes, started
from tests.e2e.conftest import PROBE, ROLLOUT, ROOT
from tests.support.eventually import eventually
from tests.support.ports import port_block

pytestmark = pytest.mark.slow


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    # Replica ports apart from the other cluster tests' (see test_cluster_workers.py).
    async with started(tmp_path, 1, ports=port_block(600)) as cluster:
        yield cluster


def service(name: str, commands: list[str], replicas: int) -> dict[str, Any]:
    return {
        "name": name,
        "route": {"path_prefix": f"/{name}"},
        "replicas": replicas,
        "replica": {"commands": commands},
        "probes": [PROBE],
        "rollout": ROLLOUT,
    }


async def cli(node: Node, *args: str) -> str:
    """``gateway ARGS --admin <node>``: its output (it must succeed)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.main", *args, "--admin", node.admin,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, out.decode()
    return out.decode()


async def test_a_replicas_logs_through_any_node(nodes: Nodes) -> None:
    by_host = {n.host: n.name for n in nodes.nodes}
    said = "echo started $REPLICA_ID on $HOST"
    status, body = await nodes.api("PUT", "/api/services/web", service("web", [said, SERVER], 3))
    assert status in (200, 201), body

    async def ready() -> bool:
        view = await nodes.service("web")
        return view["ready"] == 3 and view["rollout"] is None

    await eventually(ready, what="web ready on three nodes", timeout=30)
    view = await nodes.service("web")
    runs = {r["id"]: by_host[r["address"].rsplit(":", 1)[0]] for r in view["replicas"]}
    assert sorted(runs.values()) == ["n1", "n2", "n3"]  # one replica a node
    leader = nodes.leader()
    assert leader is not None
    follower = next(n for n in nodes.nodes if n is not leader)

    # Every replica's log, through every node: the lines of the node that runs it.
    for node in nodes.nodes:
        for rid, name in runs.items():
            host = next(n.host for n in nodes.nodes if n.name == name)
            status, logs = await nodes.api(
                "GET", f"/api/services/web/replicas/{rid}/logs", node=node
            )
            assert status == 200, logs
            assert (logs["node"], logs["lines"][0]) == (name, f"started {rid} on {host}")
    # The command line through a node that does not lead: each replica's output.
    out = await cli(follower, "logs", "web")
    for rid in runs:
        assert f"[{rid}] started {rid} on" in out

    # A replica that ended has no record of its node any more: the leader asks the nodes.
    crash = "echo crashed $REPLICA_ID on $HOST; exit 3"
    status, body = await nodes.api("PUT", "/api/services/bad", service("bad", [crash], 1))
    assert status in (200, 201), body

    async def failed() -> list[dict[str, Any]]:
        view = await nodes.service("bad")
        return [r for r in view["replicas"] if r["state"] == "failed"]

    first = (await eventually(failed, what="a failed replica of bad", timeout=30))[0]
    status, logs = await nodes.api(
        "GET", f"/api/services/bad/replicas/{first['id']}/logs", node=follower
    )
    assert status == 200, logs
    host = next(n.host for n in nodes.nodes if n.name == logs["node"])
    assert logs["lines"] == [f"crashed {first['id']} on {host}"]
    out = await cli(follower, "logs", "bad", "--failed", "--tail", "1")
    assert f"crashed {first['id']} on" in out
