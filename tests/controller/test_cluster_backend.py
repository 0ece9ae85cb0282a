"""Replicas across nodes: placement (pure), the records, and ClusterBackend with two Agents.

The etcd tests run one real etcd member, a ClusterBackend (the leader's side) and two nodes in
this process, each with its lease, its registration, a ProcessBackend on its own loopback
address (127.0.0.2, 127.0.0.3) and its Agent; replicas are real processes answering HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop

from controller.backends import Exit, Launch, ProcessBackend
from controller.cluster.agent import Agent
from controller.cluster.backend import ClusterBackend
from controller.cluster.books import forgotten
from controller.cluster.lease import LeaseKeeper
from controller.cluster.nodes import NodeRecord, NodeRegistry
from controller.cluster.placement import NodeLoad, NoRoom, place
from controller.cluster.replicas import (
    CapacityRecord,
    ExitRecord,
    FailedRecord,
    Keys,
    Placement,
    RunningRecord,
)
from controller.errors import Deposed, NoCapacity, StartFailed
from controller.etcd import Compare, EtcdClient
from controller.spec import ReplicaTemplate
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually

# -- placement ---------------------------------------------------------------------------------


def test_place_spreads_a_revision_then_a_service_then_by_load_then_by_name() -> None:
    nodes = [
        NodeLoad("b", 4, 0),
        NodeLoad("a", 4, 0),
    ]
    assert place(nodes) == "a"  # ties by name
    nodes = [NodeLoad("a", 4, 2), NodeLoad("b", 4, 1)]
    assert place(nodes) == "b"  # fewest in use
    nodes = [
        NodeLoad("a", 4, 0, service_replicas=1),
        NodeLoad("b", 4, 3, service_replicas=0),
    ]
    assert place(nodes) == "b"  # the service spreads before the load
    nodes = [
        NodeLoad("a", 4, 0, service_replicas=1, revision_replicas=1),
        NodeLoad("b", 4, 0, service_replicas=2, revision_replicas=0),
    ]
    assert place(nodes) == "b"  # the revision spreads first


def test_place_takes_only_free_nodes_with_an_agent() -> None:
    nodes = [
        NodeLoad("a", 1, 1),
        NodeLoad("b", 4, 0, agent=False),
        NodeLoad("c", None, 9),
    ]
    assert place(nodes) == "c"  # no limit


def test_place_says_why_no_node_can() -> None:
    nodes = [NodeLoad("b", 1, 1), NodeLoad("a", 2, 2), NodeLoad("c", 0, 0, agent=False)]
    assert place(nodes) == NoRoom("no capacity on any node (a: 2 of 2, b: 1 of 1, c: no agent)")
    assert place([]) == NoRoom("no capacity: no node is live")


# -- records -----------------------------------------------------------------------------------


def test_records_round_trip() -> None:
    template = ReplicaTemplate(commands=("serve",), env={"A": "1"}, port=8080)
    placement = Placement("n1", Launch("web", 3, "web-3-a", template))
    assert Placement.from_json("n1", placement.to_json()) == placement
    stopping = Placement("n1", placement.launch, stop=2.5)
    assert Placement.from_json("n1", stopping.to_json()) == stopping
    running = RunningRecord("n1", "web", 3, "127.0.0.2", 9000, 42, {"pid": 42})
    assert RunningRecord.from_json(running.to_json()) == running
    failed = FailedRecord("n1", "no_capacity", "full", 5.0)
    assert FailedRecord.from_json(failed.to_json()) == failed
    ended = ExitRecord("n1", -9, "killed", False)
    assert ExitRecord.from_json(ended.to_json()) == ended
    assert ended.exit("r") == Exit("r", -9, "killed", False)
    assert CapacityRecord.from_json(CapacityRecord(None, 2).to_json()) == CapacityRecord(None, 2)
    assert Placement.from_json("n1", b"{") is None
    assert RunningRecord.from_json(b"[]") is None


def test_keys() -> None:
    keys = Keys.of("/gw")
    assert keys.placement("n1", "r1") == b"/gw/placements/n1/r1"
    assert keys.split_placement(b"/gw/placements/n1/r1") == ("n1", "r1")
    assert keys.split_placement(b"/gw/placements/n1") is None
    assert keys.split_placement(b"/gw/running/r1") is None
    assert keys.exit_key("r1") == b"/gw/exits/r1"
    assert keys.capacity_key("n1") == b"/gw/capacity/n1"
    assert keys.node("n1") == b"/gw/nodes/n1"


# -- against etcd ------------------------------------------------------------------------------

SERVER_PY = """
import http.server, os
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ["REPLICA_ID"].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
address = (os.environ["HOST"], int(os.environ["PORT"]))
http.server.ThreadingHTTPServer(address, Handler).serve_forever()
"""

TTL = 2
_prefixes = itertools.count()
_ports = itertools.count(0)


@dataclass
class Node:
    name: str
    host: str
    client: EtcdClient
    keeper: LeaseKeeper
    registry: NodeRegistry
    backend: ProcessBackend
    agent: Agent


@dataclass
class World:
    prefix: str
    leader: ClusterBackend
    client: EtcdClient
    exits: list[Exit]
    exited: asyncio.Event
    node: Callable[..., Awaitable[Node]]
    command: str

    async def exit_of(self, rid: str) -> Exit:
        while True:
            for event in self.exits:
                if event.replica_id == rid:
                    return event
            self.exited.clear()
            await asyncio.wait_for(self.exited.wait(), 15)


LEADER_KEY = b"leader"


@pytest.fixture
async def world(etcd: EtcdCluster, tmp_path: Path) -> AsyncIterator[World]:
    async with opened_world(etcd, tmp_path) as w:
        yield w


@contextlib.asynccontextmanager
async def opened_world(
    etcd: EtcdCluster, tmp_path: Path, forget_after: float = 600.0
) -> AsyncIterator[World]:
    prefix = f"/cluster-backend-test/{next(_prefixes)}/"
    script = tmp_path / "server.py"
    script.write_text(SERVER_PY)
    client = EtcdClient(etcd.endpoints, timeout=1.0)
    fence_key = prefix.encode() + LEADER_KEY
    await client.put(fence_key, b"me")
    leader = ClusterBackend(
        client,
        prefix,
        lambda: [Compare(fence_key, "VALUE", "EQUAL", b"me")],
        answer_timeout=5.0,
        forget_after=forget_after,
    )
    exits: list[Exit] = []
    exited = asyncio.Event()

    def on_exit(event: Exit) -> None:
        exits.append(event)
        exited.set()

    leader.set_exit_handler(on_exit)
    made: list[Node] = []

    async def node(name: str, host: str, capacity: int | None = 2) -> Node:
        node_client = EtcdClient(etcd.endpoints, timeout=1.0)
        keeper = LeaseKeeper(node_client, ttl=TTL)
        registry = NodeRegistry(
            node_client, keeper, prefix, NodeRecord(name=name, address=f"http://{host}:9000")
        )
        low = 42000 + 50 * (next(_ports) % 100)
        backend = ProcessBackend(
            capacity=capacity,
            port_range=(low, low + 49),
            log_dir=tmp_path / name,
            stop_grace_default=2.0,
            host=host,
        )
        agent = Agent(node_client, prefix, name, backend, lambda: keeper.lease, stop_grace=2.0)
        keeper.subscribe(lambda e: agent.republish() if e.kind in ("granted", "restored") else None)
        keeper.start()
        registry.start()
        await asyncio.wait_for(agent.open(), 10)
        n = Node(name, host, node_client, keeper, registry, backend, agent)
        made.append(n)
        return n

    await asyncio.wait_for(leader.open(), 10)
    w = World(prefix, leader, client, exits, exited, node, f"{sys.executable} {script}")
    try:
        yield w
    finally:
        await leader.close()
        for n in made:
            for rid in list(n.backend._replicas):
                await n.backend.stop(rid, 0.5)
            await n.agent.close()
            await n.backend.close()
            await n.registry.stop()
            await n.keeper.stop()
            await n.client.close()
        await client.close()


def launch(world: World, rid: str, service: str = "web", revision: int = 1) -> Launch:
    return Launch(service, revision, rid, ReplicaTemplate(commands=(world.command,)))


async def get(host: str, port: int) -> str:
    """The body a replica answers at ``/``, once it listens."""

    async def once() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{host}:{port}/") as response:
                return await response.text()

    return await eventually(once, what=f"{host}:{port} to answer")


def agents(count: int) -> Callable[[ClusterBackend], bool]:
    return lambda b: sum(1 for r in b.nodes.values() if r is not None) == count


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def keys_under(world: World, what: str) -> list[bytes]:
    kvs, _ = await world.client.get(world.prefix.encode() + what.encode(), prefix=True)
    return [kv.key for kv in kvs]


async def nothing_under(world: World, *under: str) -> bool:
    """For ``eventually``: no key left under any of ``under`` (the keys left, if any)."""
    left = [key for what in under for key in await keys_under(world, what)]
    assert not left, f"left behind: {left}"
    return True


async def test_starts_spread_over_the_nodes_answer_and_stop(world: World) -> None:
    a = await world.node("a", "127.0.0.2")
    b = await world.node("b", "127.0.0.3")
    await asyncio.wait_for(world.leader.wait(agents(2)), 10)
    first = await world.leader.start(launch(world, "web-1-a"))
    second = await world.leader.start(launch(world, "web-1-b"))
    assert {first.handle["node"], second.handle["node"]} == {"a", "b"}
    for running in (first, second):
        node = a if running.handle["node"] == "a" else b
        assert running.host == node.host
        assert await get(running.host, running.port) == running.replica_id
    assert world.leader.in_use == 2
    assert world.leader.capacity == 4
    pids = [r.pid for r in (first, second)]
    await asyncio.gather(world.leader.stop("web-1-a", 2.0), world.leader.stop("web-1-b", 2.0))
    for rid in ("web-1-a", "web-1-b"):
        event = await world.exit_of(rid)
        assert event.requested
    for pid in pids:
        assert pid is not None
        await eventually(lambda pid=pid: gone(pid), what="the replica's process to end")
    await eventually(lambda: world.leader.placed() == {}, what="no placement left")
    await eventually(
        lambda: nothing_under(world, "placements/", "running/", "exits/"),
        timeout=5,
        what="no keys under placements/, running/, exits/",
    )


async def test_a_crash_is_an_exit(world: World) -> None:
    await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    running = await world.leader.start(launch(world, "web-1-c"))
    assert running.pid is not None
    await get(running.host, running.port)
    os.killpg(running.pid, signal.SIGKILL)
    event = await world.exit_of("web-1-c")
    assert not event.requested
    assert event.code == -signal.SIGKILL
    await eventually(lambda: world.leader.placed() == {}, what="no placement left")


async def test_a_start_that_fails_on_the_node(world: World) -> None:
    await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    empty = Launch("web", 1, "web-1-e", ReplicaTemplate())
    with pytest.raises(StartFailed, match="node a: the template has no command"):
        await world.leader.start(empty)
    assert world.leader.placed() == {}
    await eventually(
        lambda: nothing_under(world, "placements/", "failed/"),
        timeout=5,
        what="no keys under placements/, failed/",
    )


async def test_no_capacity_on_any_node(world: World) -> None:
    await world.node("a", "127.0.0.2", capacity=1)
    await world.node("b", "127.0.0.3", capacity=1)
    await asyncio.wait_for(world.leader.wait(agents(2)), 10)
    await world.leader.start(launch(world, "web-1-a"))
    await world.leader.start(launch(world, "web-1-b"))
    with pytest.raises(NoCapacity, match=r"no capacity on any node \(a: 1 of 1, b: 1 of 1\)"):
        await world.leader.start(launch(world, "web-1-c"))
    assert not await keys_under(world, "placements/a/web-1-c")


async def test_a_node_whose_key_is_gone_takes_its_replicas(world: World) -> None:
    await world.node("a", "127.0.0.2", capacity=1)
    b = await world.node("b", "127.0.0.3", capacity=1)
    await asyncio.wait_for(world.leader.wait(agents(2)), 10)
    on_a = await world.leader.start(launch(world, "web-1-a"))
    on_b = await world.leader.start(launch(world, "web-1-b"))
    assert (on_a.handle["node"], on_b.handle["node"]) == ("a", "b")
    await world.client.revoke(b.keeper.lease)  # as when b dies: its lease ends
    event = await world.exit_of("web-1-b")
    assert event == Exit("web-1-b", None, "node b is gone", requested=False)
    assert "web-1-a" not in [e.replica_id for e in world.exits]
    # b is back (a new lease): its placement is gone, so its agent stops the replica.
    assert on_b.pid is not None
    await eventually(lambda: gone(on_b.pid), what="b's replica to end")  # type: ignore[arg-type]
    await get(on_a.host, on_a.port)  # a's goes on
    await asyncio.wait_for(world.leader.wait(agents(2)), 10)
    # A place on b again: the old records were cleaned up.
    again = await world.leader.start(launch(world, "web-1-d"))
    assert again.handle["node"] == "b"
    assert [e.replica_id for e in world.exits] == ["web-1-b"]


def test_a_gone_nodes_running_records_are_forgotten_after_the_grace() -> None:
    def record(node: str) -> RunningRecord:
        return RunningRecord(node, "web", 1, "127.0.0.9", 8000, 1, {})

    running = {"r-a": record("a"), "r-b": record("b"), "r-c": record("c"), "r-d": record("d")}
    gone_at = {"b": 100.0, "c": 150.0, "a": 0.0}  # a came back: live, kept
    nodes = {"a"}
    assert forgotten(running, nodes, gone_at, now=159.0, grace=60.0) == []
    assert forgotten(running, nodes, gone_at, now=160.0, grace=60.0) == ["r-b"]
    assert forgotten(running, nodes, gone_at, now=210.0, grace=60.0) == ["r-b", "r-c"]
    # d was never seen gone (no gone_at): kept whatever the time.
    assert "r-d" not in forgotten(running, nodes, gone_at, now=1e9, grace=60.0)


async def test_a_node_gone_for_good_leaves_no_records_after_the_grace(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async with opened_world(etcd, tmp_path, forget_after=1.5) as world:
        await world.node("a", "127.0.0.2", capacity=1)
        b = await world.node("b", "127.0.0.3", capacity=1)
        await asyncio.wait_for(world.leader.wait(agents(2)), 10)
        await world.leader.start(launch(world, "web-1-a"))
        on_b = await world.leader.start(launch(world, "web-1-b"))
        assert on_b.handle["node"] == "b"
        await b.agent.close()  # b dies for good: its agent writes nothing more
        await b.registry.stop()
        await b.keeper.stop(revoke=True)
        event = await world.exit_of("web-1-b")
        seen = asyncio.get_running_loop().time()
        assert event.reason == "node b is gone"
        running = world.prefix.encode() + b"running/"
        # Its running record stays for the grace (b, back, would adopt and stop its replica)...
        assert await keys_under(world, "running/") == [running + b"web-1-a", running + b"web-1-b"]
        assert await keys_under(world, "placements/b/") == []
        # ...then it is deleted, and a's is not.
        await asyncio.wait_for(world.leader.wait(lambda lb: "web-1-b" not in lb._books.running), 10)
        assert asyncio.get_running_loop().time() - seen >= 1.0
        assert await keys_under(world, "running/") == [running + b"web-1-a"]


async def test_a_node_gone_before_the_term_began_is_forgotten_too(world: World) -> None:
    """The running record of a node that went before this leader's term (a leader that died
    within the grace) is forgotten ``forget_after`` after the term began."""
    record = RunningRecord("z", "web", 1, "127.0.0.9", 8000, 1, {})
    await world.client.put(world.leader.keys.running_key("web-1-z"), record.to_json())
    fence_key = world.prefix.encode() + LEADER_KEY
    later = ClusterBackend(
        world.client,
        world.prefix,
        lambda: [Compare(fence_key, "VALUE", "EQUAL", b"me")],
        forget_after=0.5,
    )
    try:
        await asyncio.wait_for(later.open(), 10)
        assert "web-1-z" in later._books.running
        await asyncio.wait_for(later.wait(lambda lb: "web-1-z" not in lb._books.running), 10)
        assert await keys_under(world, "running/") == []
    finally:
        await later.close()


async def test_a_refused_fence_places_nothing(world: World) -> None:
    await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    await world.client.put(world.prefix.encode() + LEADER_KEY, b"another")
    with pytest.raises(Deposed):
        await world.leader.start(launch(world, "web-1-a"))
    assert not await keys_under(world, "placements/")
    assert world.leader.placed() == {}


async def test_a_restarted_agent_adopts_its_replicas(world: World, tmp_path: Path) -> None:
    a = await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    running = await world.leader.start(launch(world, "web-1-a"))
    await a.agent.close()
    await a.backend.close()
    backend = ProcessBackend(
        capacity=2, port_range=(41000, 41049), log_dir=tmp_path / "a", host="127.0.0.2"
    )
    a.backend = backend
    a.agent = Agent(a.client, world.prefix, "a", backend, lambda: a.keeper.lease)
    await asyncio.wait_for(a.agent.open(), 10)
    assert backend.in_use == 1
    assert world.leader.adopt(running_launch := launch(world, "web-1-a"), running.handle)
    assert running_launch.replica_id == "web-1-a"
    await world.leader.stop("web-1-a", 2.0)
    assert (await world.exit_of("web-1-a")).requested


async def test_a_node_that_does_not_answer(world: World) -> None:
    a = await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    await a.agent.close()  # its capacity record stays: bound to the node's lease
    world.leader.answer_timeout = 0.5
    with pytest.raises(StartFailed, match=r"node a did not answer within 0\.5 s"):
        await world.leader.start(launch(world, "web-1-a"))
    assert world.leader.placed() == {}
    await eventually(
        lambda: nothing_under(world, "placements/"), timeout=5, what="no keys under placements/"
    )


async def test_a_new_leader_adopts_and_hears_what_it_missed(world: World) -> None:
    await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    kept = await world.leader.start(launch(world, "web-1-a"))
    crashed = await world.leader.start(launch(world, "web-1-b"))
    await world.leader.close()
    assert crashed.pid is not None
    os.killpg(crashed.pid, signal.SIGKILL)
    await eventually(lambda: gone(crashed.pid), what="the crashed replica reaped")  # type: ignore[arg-type]
    # The agent's exit record is in etcd before the next leader reads.
    await eventually(
        lambda: nothing_under(world, "running/web-1-b"),
        timeout=5,
        what="no keys under running/web-1-b",
    )
    fence_key = world.prefix.encode() + LEADER_KEY
    leader = ClusterBackend(
        world.client, world.prefix, lambda: [Compare(fence_key, "VALUE", "EQUAL", b"me")]
    )
    heard: list[Exit] = []
    leader.set_exit_handler(heard.append)
    try:
        await asyncio.wait_for(leader.open(), 10)
        assert [(e.replica_id, e.requested) for e in heard] == [("web-1-b", False)]
        adopted = leader.adopt(launch(world, "web-1-a"), kept.handle)
        assert adopted is not None
        assert (adopted.host, adopted.port, adopted.handle) == (kept.host, kept.port, kept.handle)
        assert leader.adopt(launch(world, "web-1-b"), crashed.handle) is None
        assert leader.adopt(launch(world, "web-1-a"), {**kept.handle, "node": "b"}) is None
        await leader.stop("web-1-a", 2.0)
        assert heard[-1].replica_id == "web-1-a"
        assert heard[-1].requested
    finally:
        await leader.close()


async def test_with_etcd_away_nothing_stops_and_exits_come_later(
    world: World, etcd: EtcdCluster
) -> None:
    a = await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    kept = await world.leader.start(launch(world, "web-1-a"))
    crashed = await world.leader.start(launch(world, "web-1-b"))
    etcd.stop_all()
    try:
        assert crashed.pid is not None
        os.killpg(crashed.pid, signal.SIGKILL)
        await eventually(lambda: a.backend.in_use == 1, what="a's replica in use")
        await asyncio.sleep(0.5)  # the agent tries to write meanwhile, and fails
        assert world.exits == []
    finally:
        etcd.start_member(0)
        etcd.wait_healthy()
    event = await world.exit_of("web-1-b")
    assert not event.requested
    assert await get(kept.host, kept.port) == "web-1-a"
    assert a.backend.in_use == 1
    assert world.leader.placed() == {"web-1-a": "a"}


async def test_an_agent_back_stops_what_was_stopped_while_it_was_away(
    world: World, tmp_path: Path
) -> None:
    a = await world.node("a", "127.0.0.2")
    await asyncio.wait_for(world.leader.wait(agents(1)), 10)
    running = await world.leader.start(launch(world, "web-1-a"))
    await a.agent.close()
    await a.backend.close()
    world.leader.answer_timeout = 0.5
    await world.leader.stop("web-1-a", 0.0)
    event = await world.exit_of("web-1-a")
    assert event == Exit("web-1-a", None, "node a did not report the stop within 0.5 s", True)
    await eventually(
        lambda: nothing_under(world, "placements/"), timeout=5, what="no keys under placements/"
    )
    assert await keys_under(world, "running/web-1-a")  # the node's, to adopt
    assert running.pid is not None
    assert not gone(running.pid)
    backend = ProcessBackend(
        capacity=2, port_range=(41050, 41099), log_dir=tmp_path / "a", host="127.0.0.2"
    )
    a.backend = backend
    a.agent = Agent(a.client, world.prefix, "a", backend, lambda: a.keeper.lease, stop_grace=1)
    await asyncio.wait_for(a.agent.open(), 10)
    await eventually(lambda: gone(running.pid), what="the replica's process to end")  # type: ignore[arg-type]
    await eventually(
        lambda: nothing_under(world, "running/", "exits/"),
        timeout=5,
        what="no keys under running/, exits/",
    )
    assert [e.replica_id for e in world.exits] == ["web-1-a"]  # reported once


# -- uvloop ---------------------------------------------------------------------------------

ON_UVLOOP: list[Callable[[World], Coroutine[Any, Any, None]]] = [
    test_starts_spread_over_the_nodes_answer_and_stop,
    test_a_crash_is_an_exit,
    test_a_node_whose_key_is_gone_takes_its_replicas,
    test_a_node_that_does_not_answer,
]


@pytest.mark.parametrize("case", ON_UVLOOP, ids=lambda case: case.__name__)
def test_on_uvloop(
    case: Callable[[World], Coroutine[Any, Any, None]], etcd: EtcdCluster, tmp_path: Path
) -> None:
    """The gateway runs on uvloop: some of the tests above again, on a uvloop loop."""

    async def run() -> None:
        async with opened_world(etcd, tmp_path) as w:
            await case(w)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert type(runner.get_loop()).__module__.startswith("uvloop")
        runner.run(run())
