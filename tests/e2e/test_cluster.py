"""A cluster of three gateway nodes on one etcd cluster of three members, end to end.

Real processes: three etcd members and three gateways on 127.0.0.2, .3 and .4, each running
the replicas the leader places on it (``python -m http.server`` on the node's address). Load
goes to every node at once and every failed request is counted.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster_nodes import LEASE_TTL, SERVER, Node, Nodes, started
from tests.e2e.conftest import PROBE, ROLLOUT, Load, alive
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually
from tests.support.strays import reap, spawn_stray

pytestmark = pytest.mark.slow


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    async with started(tmp_path) as cluster:
        yield cluster


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
        assert status == 200, view
        assert (view["serving_revision"], view["rollout"], view["ready"]) == (
            revision,
            None,
            replicas,
        ), view  # the last view is in the failure
        return True

    await eventually(done, timeout=timeout, every=0.2, what=f"revision {revision} serving")


async def serve_v1(nodes: Nodes, site: Callable[[str], str]) -> None:
    """Apply revision 1 of ``web`` (3 replicas) through any node; wait until it serves."""
    status, body = await nodes.api("PUT", "/api/services/web", web(site, "v1"))
    assert status == 200, body
    await serving(nodes, 1, 3)


def leader_and_others(nodes: Nodes) -> tuple[Node, list[Node]]:
    leader = nodes.leader()
    assert leader is not None
    return leader, [n for n in nodes.nodes if n is not leader]


def no_failures(
    among: list[Node], loads: list[Load], marks: list[int] | None = None, body: str = ""
) -> None:
    """Every node's load failed nothing (and answered ``body`` alone after its mark)."""
    for i, (node, load) in enumerate(zip(among, loads, strict=True)):
        print(f"{node.name}: {load.summary()}")
        assert not load.failures, f"{node.name}: {load.summary()}"
        if marks is not None:
            assert load.bodies(marks[i]) == {body}, node.name


async def placed_nodes(nodes: Nodes) -> list[str]:
    """The node each replica runs on, from its address (a replica listens on its node's)."""
    names = {n.host: n.name for n in nodes.nodes}
    status, view = await nodes.api("GET", "/api/services/web")
    assert status == 200, view
    hosts = [
        r["address"].rsplit(":", 1)[0]
        for r in view["replicas"]
        if r.get("address") and r["state"] in ("starting", "ready", "unhealthy")
    ]
    return sorted(names.get(h, h) for h in hosts)


async def test_a_rolling_update_across_three_nodes_fails_no_request(
    nodes: Nodes, site: Callable[[str], str]
) -> None:
    status, body = await nodes.api("PUT", "/api/services/web", web(site, "v1"), node=nodes.nodes[2])
    assert status in (200, 201), body
    await serving(nodes, 1, 3)
    assert await placed_nodes(nodes) == ["n1", "n2", "n3"]  # spread: one replica per node
    loads = await loaded(nodes.nodes)
    try:
        status, body = await nodes.api("PUT", "/api/services/web", web(site, "v2"))
        assert status == 200, body
        await serving(nodes, 2, 3)
        marks = [load.mark() for load in loads]
        for load in loads:
            await load.more(30)
    finally:
        await unloaded(loads)
    no_failures(nodes.nodes, loads, marks, "v2")
    # Metrics carry the node; exactly one node says it leads.
    leading = []
    for node in nodes.nodes:
        text = await asyncio.to_thread(metrics_text, node.admin)
        assert f'gateway_cluster_node_info{{node="{node.name}",role=' in text
        assert f'gateway_cluster_nodes{{node="{node.name}"}} 3.0' in text
        if f'gateway_cluster_leader{{node="{node.name}"}} 1.0' in text:
            leading.append(node.name)
    assert len(leading) == 1, leading


def metrics_text(admin: str) -> str:
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as answer:
        return str(answer.read().decode())


async def loaded(nodes: list[Any]) -> list[Load]:
    loads = [Load(n.url, clients=4, limit=90) for n in nodes]
    for load in loads:
        await load.__aenter__()
    return loads


async def unloaded(loads: list[Load]) -> None:
    for load in loads:
        await load.__aexit__(None, None, None)


async def write_when_led(nodes: Nodes, method: str, path: str, body: Any) -> tuple[int, Any]:
    """An admin write, retried while it is answered 503 (a node taking the lead, as a client
    that honours Retry-After would), for at most 10 s."""

    async def written() -> tuple[int, Any]:
        status, answer = await nodes.api(method, path, body)
        assert status != 503, answer  # not applied: tried again
        return status, answer

    return await eventually(written, every=0.5, what=f"{method} {path} answered, not 503")


async def new_leader(nodes: Nodes, old: Any, limit: float) -> tuple[Any, float]:
    """The node the survivors agree leads, and how long after now that took."""
    start = time.monotonic()
    survivors = [n for n in nodes.live() if n is not old]

    async def elected() -> Any:
        leader = await asyncio.to_thread(nodes.leader, survivors)
        return leader if leader is not old else None

    leader = await eventually(elected, timeout=limit, every=0.05, what="a new leader")
    return leader, time.monotonic() - start


async def test_the_leader_killed_mid_rollout_another_leads_and_finishes_it(
    nodes: Nodes, site: Callable[[str], str]
) -> None:
    await serve_v1(nodes, site)
    old, survivors = leader_and_others(nodes)
    loads = await loaded(survivors)
    try:
        status, body = await nodes.api("PUT", "/api/services/web", web(site, "v2"), node=old)
        assert status == 200, body
        nodes.kill(old)
        leader, took = await new_leader(nodes, old, LEASE_TTL + 5)
        print(f"SIGKILL of {old.name}: {leader.name} leads after {took:.2f} s")
        assert took <= LEASE_TTL + 1.0, f"took {took:.2f} s"
        await serving(nodes, 2, 3, timeout=40)
        marks = [load.mark() for load in loads]
        for load in loads:
            await load.more(30)
    finally:
        await unloaded(loads)
    no_failures(survivors, loads, marks, "v2")
    assert old.name not in await placed_nodes(nodes)  # its replica replaced elsewhere


def node_lease(nodes: Nodes, node: Node) -> int:
    """The lease ``node`` registered itself with (its ``nodes/<name>`` record's)."""
    key = f"{nodes.prefix}nodes/{node.name}".encode()
    body = json.dumps({"key": base64.b64encode(key).decode()}).encode()
    request = urllib.request.Request(nodes.etcd.endpoints[0] + "/v3/kv/range", data=body)
    with urllib.request.urlopen(request, timeout=5) as answer:
        [kv] = json.loads(answer.read())["kvs"]
    return int(kv["lease"])


@contextlib.contextmanager
def lease_kept_alive(nodes: Nodes, lease: int) -> Iterator[None]:
    """``etcdctl lease keep-alive`` holds ``lease`` for as long as the block runs: etcd does
    not expire it, whatever its holder does."""
    etcdctl = shutil.which("etcdctl")
    if etcdctl is None:
        pytest.skip("etcdctl is not installed")
    argv = [etcdctl, "--endpoints", ",".join(nodes.etcd.endpoints), "lease", "keep-alive"]
    with subprocess.Popen(
        [*argv, f"{lease:x}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as keeper:
        try:
            yield
        finally:
            keeper.terminate()
            keeper.wait(5)


async def test_a_paused_leader_whose_lease_stays_is_replaced_stops_acting_then_follows(
    nodes: Nodes, site: Callable[[str], str]
) -> None:
    """Issue 54: the leader stops (SIGSTOP) and its lease stays in etcd (a keepalive from the
    test holds it, as a loaded etcd slow to expire it would): a follower takes over all the
    same, by its own clock; the old leader, woken, acts no more and follows."""
    await serve_v1(nodes, site)
    old, survivors = leader_and_others(nodes)
    loads = await loaded(survivors)
    try:
        with lease_kept_alive(nodes, node_lease(nodes, old)):
            nodes.pause(old)
            before_pause = len(old.log)
            leader, took = await new_leader(nodes, old, LEASE_TTL + 10)
            print(f"SIGSTOP of {old.name}, its lease held: {leader.name} leads after {took:.2f} s")
            assert took <= LEASE_TTL + 2.0, f"took {took:.2f} s"
            # Its lease held, the paused node stays a member: only the leadership moved.
            assert old.name in {n["name"] for n in (nodes.cluster(leader) or {})["nodes"]}
            await serving(nodes, 1, 3, timeout=40)
            nodes.resume(old)
            await eventually(
                lambda: asyncio.to_thread(
                    lambda: (nodes.cluster(old) or {}).get("leader") == leader.name
                ),
                timeout=10,
                what=f"{old.name} to follow {leader.name}",
            )
        # Writes through the old leader go to the new one.
        status, body = await nodes.api("POST", "/api/services/web/scale", {"replicas": 4}, node=old)
        assert status == 200, body
        await serving(nodes, 1, 4, timeout=30)
        for load in loads:
            await load.more(30)
    finally:
        await unloaded(loads)
    no_failures(survivors, loads)
    after = old.log[before_pause:]
    deposed = rf"no longer leads: (the leader record was not renewed in time|{leader.name} took)"
    assert re.search(deposed, after), after[-3000:]
    # Woken past its term, it placed nothing and stopped nothing: its writes were refused.
    assert "placed " not in after, after[-3000:]


async def test_a_node_killed_its_replicas_are_replaced_on_the_others(
    nodes: Nodes, site: Callable[[str], str]
) -> None:
    await serve_v1(nodes, site)
    leader = nodes.leader()
    victim = next(n for n in nodes.nodes if n is not leader)
    survivors = [n for n in nodes.nodes if n is not victim]
    loads = await loaded(survivors)
    before = nodes.replica_pids()
    try:
        nodes.kill(victim)
        await eventually(
            lambda: asyncio.to_thread(
                lambda: (
                    victim.name
                    not in {n["name"] for n in (nodes.cluster(leader) or {}).get("nodes", [])}
                )
            ),
            timeout=LEASE_TTL + 3,
            what=f"{victim.name} to leave the cluster",
        )

        async def replaced() -> bool:
            placed = await placed_nodes(nodes)
            assert victim.name not in placed, placed  # the last placement is in the failure
            return True

        await eventually(
            replaced, timeout=30, every=0.2, what=f"{victim.name}'s replicas placed elsewhere"
        )
        await serving(nodes, 1, 3, timeout=30)
        for load in loads:
            await load.more(30)
    finally:
        await unloaded(loads)
    no_failures(survivors, loads)

    # Back, the node stops what it left running: its replica, placed elsewhere since (found
    # by its record in etcd), and one it spawned just before the kill, with no record yet
    # (found by its log, once the node's records were loaded and adopted).
    status, view = await nodes.api("GET", "/api/services/web")
    assert status == 200, view
    live = {r["id"] for r in view["replicas"] if r["state"] in ("starting", "ready")}
    left = {pid for rid, pid in before.items() if rid not in live}
    assert len(left) == 1, (before, view["replicas"])
    assert all(alive(pid) for pid in left)
    log = victim.directory / "state" / "logs" / "web-1-unrecorded.log"
    stray = spawn_stray(log, "exec sleep 1000")
    try:
        await nodes.start(nodes.nodes.index(victim))
        assert not alive(stray), "a replica with no record outlived the node's restart"
    finally:
        reap(stray)
    await eventually(
        lambda: asyncio.to_thread(lambda: not any(alive(pid) for pid in left)),
        timeout=10,
        what="its replica to end",
    )
    await serving(nodes, 1, 3)


async def test_etcd_faults_one_member_changes_nothing_all_down_serves_and_refuses_writes(
    nodes: Nodes, site: Callable[[str], str]
) -> None:
    await serve_v1(nodes, site)
    loads = await loaded(nodes.nodes)
    try:
        nodes.etcd.kill_member(0)
        status, body = await nodes.api("POST", "/api/services/web/scale", {"replicas": 4})
        assert status == 200, body
        await serving(nodes, 1, 4)
        before = nodes.replica_pids()
        nodes.etcd.stop_all()
        for load in loads:
            await load.more(20)
        # etcd away longer than a lease (the nodes' leases end unrenewed), writes refused
        # throughout.
        started = time.monotonic()
        while time.monotonic() - started < LEASE_TTL + 3:
            status, body = await nodes.api("POST", "/api/services/web/scale", {"replicas": 2})
            assert status == 503, body
            await asyncio.sleep(1)
        for load in loads:
            await load.more(30)
        for i in range(3):
            nodes.etcd.start_member(i)
        nodes.etcd.wait_healthy()
        await eventually(
            lambda: asyncio.to_thread(lambda: nodes.leader() is not None),
            timeout=LEASE_TTL + 10,
            what="a leader",
        )
        # The nodes' leases ended while etcd was away; they register again, and the new
        # leader adopts their replicas instead of replacing them.
        # A window, not a wait: a leader that replaced them would do so once the old leases,
        # restored by etcd with a fresh TTL, end.
        await asyncio.sleep(LEASE_TTL + 3)
        assert nodes.replica_pids() == before  # nothing was stopped, nothing started
        await serving(nodes, 1, 4)
        status, body = await write_when_led(nodes, "PUT", "/api/services/web", web(site, "v2", 4))
        assert status == 200, body
        await serving(nodes, 2, 4, timeout=40)
        marks = [load.mark() for load in loads]
        for load in loads:
            await load.more(30)
    finally:
        await unloaded(loads)
    no_failures(nodes.nodes, loads, marks, "v2")


async def test_config_services_are_applied_by_the_leader_and_a_differing_node_is_told(
    tmp_path: Path,
) -> None:
    """n1 leads and applies its config's service; n2 starts with another document for it and
    another service: it is told at start, naming both, and applies nothing; n3 agrees. Then
    each node that leads applies its config by the rule of one gateway: n3, whose document the
    cluster applied, keeps what the API changed since; n2, whose documents differ, applies
    them."""

    def spec(name: str, replicas: int) -> dict[str, Any]:
        return {
            "name": name,
            "route": {"path_prefix": f"/{name}"},
            "replicas": replicas,
            "replica": {"commands": [SERVER]},
        }

    etcd = EtcdCluster(tmp_path / "etcd", 1).start()
    agreed = [spec("web", 0)]
    cluster = Nodes(
        tmp_path / "nodes",
        etcd,
        services={
            "n1": agreed,
            "n2": [spec("web", 0) | {"route": {"path_prefix": "/w2"}}, spec("api", 0)],
            "n3": agreed,
        },
    )
    try:
        first = await cluster.start(0)
        await eventually(
            lambda: asyncio.to_thread(lambda: cluster.leader() is first),
            timeout=10,
            what="n1 leads",
        )
        await eventually(
            lambda: asyncio.to_thread(lambda: "web: created from" in first.log),
            timeout=10,
            what="web applied",
        )
        second, third = await cluster.start(1), await cluster.start(2)
        assert "this config's services differ from what the cluster applied" in second.log
        assert "web: " + str(second.directory / "gateway.yaml") + " services[0] differs" in (
            second.log
        )
        assert "api: in this config" in second.log
        assert "differ from what the cluster applied" not in third.log + first.log
        assert "created from" not in second.log + third.log  # only the leader applies
        status, _ = await cluster.api("GET", "/api/services/api", node=second)
        assert status == 404
        web_view = await cluster.service("web", node=first)
        assert web_view["serving_revision"] in (None, 1)

        # Changed through the API: the next leader, with the document applied, keeps it.
        await eventually(
            lambda: asyncio.to_thread(lambda: cluster.leader() is first),
            timeout=10,
            what="n1 leads, as all see",
        )
        changed = spec("web", 0) | {"route": {"path_prefix": "/through-the-api"}}
        status, body = await cluster.api("PUT", "/api/services/web", changed, node=third)
        assert status == 200, body
        assert body["action"] == "updated"
        await cluster.stop(second)  # it leads later, not now
        await cluster.stop(first)
        await eventually(
            lambda: asyncio.to_thread(lambda: cluster.leader() is third),
            timeout=10,
            what="n3 leads",
        )
        await eventually(
            lambda: asyncio.to_thread(lambda: "web: spec from the store" in third.log),
            timeout=10,
            what="n3's choice",
        )
        assert "(changed through the API since" in third.log
        assert "created from" not in third.log
        assert "applied (" not in third.log
        web_view = await cluster.service("web", node=third)
        assert web_view["spec"]["route"]["path_prefix"] == "/through-the-api"

        # n2 leads: its documents differ from those last applied, so it applies them.
        second = await cluster.start(1)
        await cluster.stop(third)
        await eventually(
            lambda: asyncio.to_thread(lambda: cluster.leader() is second),
            timeout=10,
            what="n2 leads",
        )
        await eventually(
            lambda: asyncio.to_thread(lambda: "api: created from" in second.log),
            timeout=10,
            what="n2's choice",
        )
        assert "services[0] changed since last applied: applied (updated" in second.log
        web_view = await cluster.service("web", node=second)
        assert web_view["spec"]["route"]["path_prefix"] == "/w2"
    finally:
        await cluster.close()
        etcd.close()
