"""Docker Engines in a cluster, end to end: three gateway nodes (127.0.0.2, .3 and .4) on one
etcd cluster of three, a Docker service's containers on two engines (the test engine as host
``a``, the second ``dockerd`` of ``test_docker_engines`` as host ``b``) and a process service
on the nodes. The leader alone talks to the engines.

Every node routes to the containers' ports, published on 127.0.0.1 (never a bridge address),
from the leader's pool records. The containers are labelled with the cluster's id (the key
``cluster`` under the prefix): after a SIGKILL of the leader the next one adopts them by their
labels, the same containers, none restarted. Host b cut off (its engine and the ports it
publishes answer nothing: SIGSTOP to its ``dockerd`` and ``docker-proxy`` processes) is a host
fault: its replicas turn unhealthy and are replaced on a, which has room; nothing else stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from controller.backends.docker import EngineClient
from controller.etcd import EtcdClient
from tests.controller.test_backend_docker import ENGINE, engine_or_skip, remove_labelled
from tests.e2e.cluster_nodes import LEASE_TTL, SERVER, Node, Nodes, started
from tests.e2e.conftest import PROBE, ROLLOUT, Load, children
from tests.e2e.test_cluster import leader_and_others, write_when_led
from tests.e2e.test_cluster_workers import replica_ports
from tests.e2e.test_docker_engines import (  # the module's second engine, a fixture here too
    Engine,
    docker_spec,
    remove_labelled_on,
    second_engine,  # noqa: F401
)
from tests.support.eventually import eventually
from tests.support.ports import port_block

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def engines(second: Engine, capacity: int = 4) -> dict[str, Any]:
    """Hosts a and b, each with a port range of its own."""
    base = port_block(40)
    hosts = [
        {"name": "a", "engine": ENGINE, "capacity": {"replicas": capacity}},
        {"name": "b", "engine": second.unix, "capacity": {"replicas": capacity}},
    ]
    for i, host in enumerate(hosts):
        host["port_range"] = f"{base + i * 20}-{base + i * 20 + 19}"
    return {"hosts": hosts}


@pytest.fixture
async def nodes(tmp_path: Path, second_engine: Engine) -> AsyncIterator[Nodes]:  # noqa: F811
    await engine_or_skip()
    instance = None
    try:
        async with started(
            tmp_path, ports=replica_ports(), docker=engines(second_engine)
        ) as cluster:
            try:
                yield cluster
            finally:
                instance = await cluster_id(cluster)
    finally:
        if instance is not None:  # the nodes leave the containers: removed by their label
            await remove_labelled(instance)
            if second_engine.process is not None and second_engine.process.poll() is None:
                await remove_labelled_on(second_engine.unix, instance)


def pages(site: Callable[[str], str]) -> dict[str, Any]:
    """A process service beside the Docker one: a replica on each node."""
    return {
        "name": "pages",
        "route": {"path_prefix": "/pages", "strip_prefix": True},
        "replicas": 3,
        "replica": {"commands": [SERVER], "working_dir": site("pages")},
        "probes": [PROBE],
        "retries": {"attempts": 3},
        "rollout": ROLLOUT,
    }


async def cluster_id(nodes: Nodes) -> str | None:
    client = EtcdClient(nodes.etcd.endpoints, timeout=2.0)
    try:
        kvs, _ = await client.get(f"{nodes.prefix}cluster".encode())
        return kvs[0].value.decode() if kvs else None
    finally:
        await client.close()


@dataclass(frozen=True)
class Container:
    host: str
    id: str
    started: str
    """The engine's ``State.StartedAt``: a container restarted reads a later one."""
    port: int


async def containers(nodes: Nodes, second: Engine, hosts: str = "ab") -> dict[str, Container]:
    """Each running container of the cluster (on ``hosts``): replica id -> its container."""
    instance = await cluster_id(nodes)
    assert instance is not None
    found: dict[str, Container] = {}
    for name, engine in (("a", ENGINE), ("b", second.unix)):
        if name not in hosts:
            continue
        client = EngineClient(engine)
        try:
            for c in await client.containers({"gateway.instance": instance}):
                labels = c.get("Labels") or {}
                if c["State"] != "running":
                    continue
                assert labels["gateway.host"] == name
                info = await client.inspect(c["Id"])
                assert info is not None
                port = next(p["PublicPort"] for p in c["Ports"] if p.get("PublicPort"))
                assert all(p.get("IP") in (None, "127.0.0.1") for p in c["Ports"]), c["Ports"]
                found[labels["gateway.replica"]] = Container(
                    name, c["Id"], info["State"]["StartedAt"], port
                )
        finally:
            await client.close()
    return found


async def view(nodes: Nodes, name: str, among: list[Node] | None = None) -> dict[str, Any]:
    node = (among or nodes.live())[0]
    status, body = await nodes.api("GET", f"/api/services/{name}", node=node)
    assert status == 200, body
    return dict(body)


def ready_ids(seen: dict[str, Any]) -> set[str]:
    return {r["id"] for r in seen["replicas"] if r["state"] == "ready"}


async def serving(
    nodes: Nodes, name: str, replicas: int, among: list[Node] | None = None
) -> dict[str, Any] | None:
    """The service's view once it serves revision 1 with ``replicas`` ready, no rollout, and
    nothing else live (None before)."""
    seen = await view(nodes, name, among)
    live = [r for r in seen["replicas"] if r["state"] not in ("stopped", "failed")]
    done = (
        seen["serving_revision"] == 1
        and seen["rollout"] is None
        and seen["ready"] == replicas
        and len(live) == replicas
    )
    return seen if done else None


async def loaded(
    among: list[Node], *, web_clients: int = 3, limit: int = 150
) -> list[tuple[str, Load]]:
    """Load on every node of ``among``: the Docker service (at /) and the process one."""
    loads = []
    for node in among:
        loads.append((f"{node.name} web", Load(node.url, clients=web_clients, limit=limit)))
        loads.append((f"{node.name} pages", Load(node.url, clients=2, limit=limit, path="/pages/")))
    for _, load in loads:
        await load.__aenter__()
    return loads


async def unloaded(loads: list[tuple[str, Load]]) -> None:
    for _, load in loads:
        await load.__aexit__(None, None, None)


async def new_leader(nodes: Nodes, old: Node, survivors: list[Node]) -> Node:
    async def led() -> Node | None:
        leader = await asyncio.to_thread(nodes.leader, survivors)
        return leader if leader is not None and leader is not old else None

    return await eventually(led, timeout=LEASE_TTL + 10, what="a new leader")


def frozen_host(second: Engine, ports: set[int]) -> list[int]:
    """The pids that cut host b off: its dockerd and the docker-proxy of each of ``ports``."""
    assert second.process is not None
    dockerd = second.process.pid
    proxies = []
    for pid in children(dockerd):
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if Path(args[0].decode()).name == "docker-proxy":
                port = int(args[args.index(b"-host-port") + 1])
                if port in ports:
                    proxies.append((port, pid))
    assert sorted(port for port, _ in proxies) == sorted(ports), proxies
    return [dockerd, *(pid for _, pid in proxies)]


async def test_docker_replicas_over_a_cluster_survive_the_leader_and_a_host_cut_off(
    nodes: Nodes,
    second_engine: Engine,  # noqa: F811
    site: Callable[[str], str],
) -> None:
    # 4 containers spread over both engines, a process replica on each node.
    for name, spec in (("web", docker_spec("v1", 4)), ("pages", pages(site))):
        status, body = await write_when_led(nodes, "PUT", f"/api/services/{name}", spec)
        assert status in (200, 201), body
    seen = await eventually(lambda: serving(nodes, "web", 4), timeout=120, what="web serving")
    await eventually(lambda: serving(nodes, "pages", 3), timeout=60, what="pages serving")
    placed = await containers(nodes, second_engine)
    assert sorted(c.host for c in placed.values()) == ["a", "a", "b", "b"]
    assert set(placed) == ready_ids(seen)
    addresses = {r["id"]: r["address"] for r in seen["replicas"]}
    assert all(addresses[rid] == f"127.0.0.1:{c.port}" for rid, c in placed.items())

    # 1. The leader killed under load on the others: the new one adopts every container.
    old, survivors = leader_and_others(nodes)
    loads = await loaded(survivors)
    try:
        nodes.kill(old)
        killed = time.monotonic()
        leader = await new_leader(nodes, old, survivors)
        took = time.monotonic() - killed

        # Its process replica is replaced on the survivors once its node's lease ends, which
        # may be after the new leader took over (leadership does not wait for the lease): by
        # then the new leader has probed and planned for seconds with the containers.
        async def pages_without_old() -> dict[str, Any] | None:
            seen = await serving(nodes, "pages", 3, survivors)
            if seen is None:
                return None
            ready = [r["address"] for r in seen["replicas"] if r["state"] == "ready"]
            return None if [a for a in ready if a.startswith(f"{old.host}:")] else seen

        pages_seen = await eventually(
            pages_without_old, timeout=60, what=f"pages serving without {old.name}"
        )
        web_seen = await eventually(
            lambda: serving(nodes, "web", 4, survivors), timeout=30, what="web serving"
        )
        print(f"SIGKILL of {old.name}: {leader.name} leads after {took:.2f} s")
        marks = [load.mark() for _, load in loads]
        for _, load in loads:
            await load.more(30)
    finally:
        await unloaded(loads)
    for (name, load), mark in zip(loads, marks, strict=True):
        print(f"{name}: {load.summary()}")
        assert not load.failures, f"{name}: {load.summary()}"
        assert load.bodies(mark) == ({"v1"} if name.endswith("web") else {"pages"})
    assert await containers(nodes, second_engine) == placed  # the same, none restarted
    assert ready_ids(web_seen) == set(placed)
    for rid, c in placed.items():  # found by its labels in its engine's listing
        assert f"adopted replica {rid} on {c.host} (container {c.id[:12]})\n" in leader.log
    assert "started replica web-" not in leader.log

    # 2. Host b cut off (its engine and the ports it publishes answer nothing): its replicas
    # turn unhealthy and are replaced on a, which has room; nothing else stops.
    on_a = {rid: c for rid, c in placed.items() if c.host == "a"}
    on_b = {rid: c for rid, c in placed.items() if c.host == "b"}
    pages_ready = ready_ids(pages_seen)
    frozen = frozen_host(second_engine, {c.port for c in on_b.values()})
    loads = await loaded(survivors)
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        cut = time.monotonic()

        async def replaced() -> dict[str, Any] | None:
            seen = await serving(nodes, "web", 4, survivors)
            now = await containers(nodes, second_engine, hosts="a")
            return seen if seen is not None and ready_ids(seen) == set(now) else None

        seen = await eventually(replaced, timeout=90, what="b's replicas replaced on a")
        took_replaced = time.monotonic() - cut
        gone = {r["id"]: r for r in seen["replicas"] if r["id"] in on_b}
        print(f"host b cut off: 4 ready on a after {took_replaced:.2f} s")
        print("b's replicas:", {rid: (r["state"], r["failure"]) for rid, r in gone.items()})
        assert {r["state"] for r in gone.values()} == {"failed"}, gone  # given up, not adopted
        assert all(r["failure"].startswith("unhealthy for 10s") for r in gone.values()), gone
        # No room on a, b out of reach: the reason names the hosts and the node reaching them.
        status, body = await nodes.api("POST", "/api/services/web/scale", {"replicas": 5})
        assert status == 200, body

        async def no_room() -> str | None:
            reason = (await view(nodes, "web", survivors))["conditions"]["reason"] or ""
            return reason if "no capacity" in reason else None

        reason = await eventually(no_room, timeout=30, what="web degraded: no capacity")
        print(f"scaled to 5: {reason}")
        assert f"(a: 4 of 4, b: unreachable from {leader.name})" in reason, reason
        status, body = await nodes.api("POST", "/api/services/web/scale", {"replicas": 4})
        assert status == 200, body
        await eventually(lambda: serving(nodes, "web", 4, survivors), timeout=30, what="4 again")
        marks = [load.mark() for _, load in loads]
        for _, load in loads:
            await load.more(30)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        thawed = time.monotonic()
        await unloaded(loads)
    for (name, load), mark in zip(loads, marks, strict=True):
        print(f"{name}: {load.summary()}")
        if name.endswith("pages"):
            assert not load.failures, f"{name}: {load.summary()}"
        else:  # only requests in flight on b's containers as it was cut off may fail
            print(f"  sent at (s from the cut): {[round(o.at - cut, 2) for o in load.failures]}")
            assert len(load.failures) <= load.clients, f"{name}: {load.summary()}"
            assert all(o.at <= cut + 2.0 for o in load.failures), f"{name}: {load.summary()}"
        assert not [o for o in load.sent_since(mark) if o.failed], f"{name}: {load.summary()}"
    now = await containers(nodes, second_engine, hosts="a")
    assert {rid: now[rid] for rid in on_a} == on_a  # a's containers untouched
    assert ready_ids(await view(nodes, "pages", survivors)) == pages_ready

    # 3. b answers again: the containers given up there are stopped and removed; a keeps all.
    instance = await cluster_id(nodes)
    assert instance is not None

    async def b_emptied() -> bool:
        client = EngineClient(second_engine.unix)
        try:
            return not await client.containers({"gateway.instance": instance})
        finally:
            await client.close()

    await eventually(b_emptied, timeout=30, what="b's containers removed")
    print(f"b answers: its containers removed {time.monotonic() - thawed:.2f} s after")
    assert await containers(nodes, second_engine, hosts="a") == now
