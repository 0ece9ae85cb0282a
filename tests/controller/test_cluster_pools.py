"""The cluster's pools: records and reports (pure), then a leader and two followers on etcd."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from controller.cluster.demand import Demand
from controller.cluster.membership import (
    AddUpstream,
    DrainUpstream,
    Member,
    NodeReport,
    PeerTable,
    PoolRecord,
    RemoveService,
    RemoveUpstream,
    SetFailure,
    SetService,
    SetSplit,
    UndrainUpstream,
    plan,
    record_of,
    report_of,
)
from controller.cluster.peers import Peers
from controller.cluster.pools import Follower, Publisher, pools_key
from controller.etcd import Compare, EtcdClient
from gateway import (
    AdminState,
    Health,
    Pool,
    PoolEvent,
    ProbeConfig,
    RouteConfig,
    ServiceRouting,
    parse_settings,
)
from gateway import Upstream as Up
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually


def routing(name: str = "web", **changes: Any) -> ServiceRouting:
    return parse_settings(
        ServiceRouting, {"name": name, "route": RouteConfig(path_prefix=f"/{name}"), **changes}
    )


def up(uid: str, port: int = 9000, service: str = "web", **changes: Any) -> Up:
    return Up(uid, service, "127.0.0.1", port, **changes)


def pool_with(*upstreams: Up, name: str = "web") -> Pool:
    pool = Pool(clock=lambda: 0.0, rng=random.Random(0))
    pool.set_service(routing(name))
    for upstream in upstreams:
        pool.add_upstream(upstream)
    return pool


# -- records ----------------------------------------------------------------------------------


def test_a_record_round_trips_through_json() -> None:
    probe = ProbeConfig(path="/ready", interval=1.0)
    record = PoolRecord(
        routing("web", load_balancing="round_robin"),
        (
            Member("a", "10.0.0.1", 80, revision=2, weight=3, probes=(probe,)),
            Member("b", "::1", 81, admin=AdminState.DRAINING, since=7, timeout=12.5),
        ),
        split=(2, 10),
        failure="cold start failed",
        version=9,
    )
    assert PoolRecord.decode(record.encode()) == record


@pytest.mark.parametrize("data", [b"", b"{}", b"[]", b'{"routing": {"name": "x"}}', b"\xff"])
def test_a_malformed_record_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 (what it says matters less than its type)
        PoolRecord.decode(data)


def test_health_and_ejection_never_change_a_records_content() -> None:
    pool = pool_with(up("a"), up("b", 9001))
    sp = pool.service("web")
    before = record_of(sp.routing, sp.snapshot)
    pool.set_health("web", "a", Health.HEALTHY)
    pool.set_health("web", "b", Health.UNHEALTHY)
    after = record_of(sp.routing, sp.snapshot)
    assert after.version > before.version
    assert after.content == before.content
    assert after.content.version == 0


async def test_a_draining_upstream_carries_its_drain() -> None:
    pool = pool_with(up("a"))
    pool.drain("web", "a", 5.0)
    sp = pool.service("web")
    record = record_of(sp.routing, sp.snapshot, {"a": (4, 5.0)})
    assert record.upstreams == (
        Member("a", "127.0.0.1", 9000, admin=AdminState.DRAINING, since=4, timeout=5.0),
    )
    # Without a known drain: the snapshot's version, which is at least the drain's.
    assert record_of(sp.routing, sp.snapshot).upstreams[0].since == sp.snapshot.version


# -- plan: a follower's steps -----------------------------------------------------------------


def test_plan_for_a_new_service() -> None:
    record = PoolRecord(
        routing(),
        (Member("a", "h", 1), Member("b", "h", 2, admin=AdminState.DRAINING, since=3)),
        split=(1, 20),
        failure="",
    )
    assert plan(None, None, record) == [
        SetService(record.routing),
        AddUpstream(Up("a", "web", "h", 1)),
        AddUpstream(Up("b", "web", "h", 2)),
        DrainUpstream("b", None),
        SetSplit((1, 20)),
    ]


def test_plan_of_a_key_deleted() -> None:
    assert plan(routing(), None, None) == [RemoveService("web")]
    assert plan(None, None, None) == []


def test_plan_removes_moves_drains_and_undrains() -> None:
    pool = pool_with(up("gone"), up("moved", 9001), up("back", 9002), up("going", 9003))
    pool.set_health("web", "going", Health.HEALTHY)
    sp = pool.service("web")
    sp._publish(  # "back" draining as a follower's pool has it after an earlier record
        tuple(
            u.replace(admin=AdminState.DRAINING) if u.id == "back" else u
            for u in sp.snapshot.upstreams
        )
    )
    record = PoolRecord(
        routing(),
        (
            Member("moved", "127.0.0.1", 9999),
            Member("back", "127.0.0.1", 9002),
            Member("going", "127.0.0.1", 9003, admin=AdminState.DRAINING, since=8, timeout=3.0),
        ),
        failure="no capacity",
    )
    assert plan(sp.routing, sp.snapshot, record) == [
        RemoveUpstream("gone"),
        RemoveUpstream("moved"),
        AddUpstream(Up("moved", "web", "127.0.0.1", 9999)),
        UndrainUpstream("back"),
        DrainUpstream("going", 3.0),
        SetFailure("no capacity"),
    ]


def test_plan_changes_the_routing_and_keeps_upstreams() -> None:
    pool = pool_with(up("a"))
    sp = pool.service("web")
    record = record_of(routing(load_balancing="round_robin"), sp.snapshot)
    assert plan(sp.routing, sp.snapshot, record) == [SetService(record.routing)]


def test_a_changed_probe_makes_the_upstream_anew() -> None:
    pool = pool_with(up("a"))
    sp = pool.service("web")
    probe = ProbeConfig(path="/health")
    record = PoolRecord(routing(), (Member("a", "127.0.0.1", 9000, probes=(probe,)),))
    assert plan(sp.routing, sp.snapshot, record) == [
        RemoveUpstream("a"),
        AddUpstream(Up("a", "web", "127.0.0.1", 9000, probes=(probe,))),
    ]


async def test_a_followers_pool_reaches_the_leaders_record() -> None:
    leader = pool_with(up("a"), up("b", 9001, revision=2), up("c", 9002))
    leader.set_health("web", "a", Health.HEALTHY)
    leader.drain("web", "c", 5.0)
    leader.set_split("web", (2, 30))
    leader.set_failure("web", "why")
    sp = leader.service("web")
    record = record_of(sp.routing, sp.snapshot)
    follower = Pool(clock=lambda: 0.0)
    follower_records = _Applier(follower)
    follower_records.apply(record)
    fsp = follower.service("web")
    mirrored = record_of(fsp.routing, fsp.snapshot)
    assert _without_since(mirrored) == _without_since(record)
    assert [u.health for u in fsp.snapshot.upstreams] == [Health.UNKNOWN] * 3
    assert plan(fsp.routing, fsp.snapshot, record) == []


def _without_since(record: PoolRecord) -> PoolRecord:
    """Drains' versions are each pool's own."""
    members = tuple(dataclasses.replace(m, since=0) for m in record.upstreams)
    return dataclasses.replace(record, upstreams=members, version=0)


@dataclass
class _Applier:
    """The steps taken on a pool the simplest way (the real one is ``Follower._take``)."""

    pool: Pool
    done: list[object] = field(default_factory=list)

    def apply(self, record: PoolRecord) -> None:
        sp = self.pool.services.get(record.service)
        for step in plan(sp.routing if sp else None, sp.snapshot if sp else None, record):
            match step:
                case SetService(r):
                    self.pool.set_service(r)
                case AddUpstream(u):
                    self.pool.add_upstream(u)
                case DrainUpstream(uid, timeout):
                    self.done.append(self.pool.drain(record.service, uid, timeout or 1.0))
                case SetSplit(split):
                    self.pool.set_split(record.service, split)
                case SetFailure(failure):
                    self.pool.set_failure(record.service, failure)
                case _:
                    raise AssertionError(step)


# -- reports ----------------------------------------------------------------------------------


def test_a_report_round_trips_and_says_only_drains_the_record_has() -> None:
    pool = pool_with(up("a"), up("b", 9001), up("c", 9002))
    pool.set_health("web", "a", Health.HEALTHY)
    record = PoolRecord(
        routing(),
        (
            Member("a", "127.0.0.1", 9000),
            Member("b", "127.0.0.1", 9001, admin=AdminState.DRAINING, since=6),
            Member("c", "127.0.0.1", 9002),
        ),
    )
    report = report_of(
        [pool.service("web").snapshot], {"web": record}, [("web", "b"), ("web", "c"), ("x", "y")]
    )
    assert report == NodeReport({"web": frozenset({"a"})}, {("web", "b"): 6})
    assert NodeReport.decode(report.encode()) == report
    assert NodeReport.decode(b'{"routable": {}, "idle": {"s/u/v": 3}}').idle == {("s", "u/v"): 3}
    with pytest.raises(ValueError):  # noqa: PT011
        NodeReport.decode(b"{}")


def test_peer_table() -> None:
    table = PeerTable()
    assert table.routable_everywhere("web", "a")  # nobody else serves
    assert table.update("n1", NodeReport({"web": frozenset({"a", "b"})}))
    assert not table.update("n1", NodeReport({"web": frozenset({"a", "b"})}))
    assert table.update("n2", NodeReport({"web": frozenset({"a"})}))
    assert table.routable_everywhere("web", "a")
    assert not table.routable_everywhere("web", "b")
    assert not table.routable_everywhere("api", "a")
    assert table.number("n1") == -1
    assert table.number("n2") == -2
    assert table.remove("n2")
    assert not table.remove("n2")
    assert table.routable_everywhere("web", "b")
    assert table.number("n2") == -2  # stable for the table's life
    assert repr(table) == "<PeerTable nodes=['n1']>"


# -- Peers and Follower without etcd: what they do with what a feed hands them -----------------

NOWHERE = ["http://127.0.0.1:9"]
"""An etcd that is never called: these tests hand records and reports in directly."""


async def test_peers_make_reporting_nodes_pool_peers() -> None:
    leader = pool_with(up("a"))
    leader.set_health("web", "a", Health.HEALTHY)
    changed: list[str] = []
    peers = Peers(EtcdClient(NOWHERE), "/p/", leader, "me", on_change=changed.append)
    peers.change("me", NodeReport().encode())  # its own report, from when it followed
    assert peers.nodes == []
    peers.change("n1", NodeReport({"web": frozenset({"a"})}).encode())
    peers.change("n2", b"not json")
    assert (peers.nodes, leader.peers, changed) == (["n1"], {-1}, ["n1"])
    assert peers.routable_everywhere("web", "a")

    drain = leader.drain("web", "a", 10.0)
    version = leader.service("web").snapshot.version
    peers.change("n1", NodeReport(idle={("web", "a"): version - 1}).encode())  # an older drain
    assert not drain.done()
    assert not peers.routable_everywhere("web", "a")
    peers.change("n1", NodeReport(idle={("web", "a"): version}).encode())
    assert drain.done()

    drain = leader.drain("web", "b", 10.0)  # unknown: done at once
    leader.add_upstream(up("b", 9001))
    drain = leader.drain("web", "b", 10.0)
    assert not drain.done()
    peers.change("n1", None)  # its lease ended: it holds nothing
    assert drain.done()
    assert (peers.nodes, leader.peers) == ([], set())
    peers.change("n1", NodeReport().encode())
    assert leader.peers == {-1}  # the same number again
    await peers.stop()
    assert leader.peers == set()


async def test_a_follower_applies_records_and_reports_its_drains() -> None:
    pool = Pool(rng=random.Random(0))
    follower = Follower(EtcdClient(NOWHERE), "/p/", pool, "n1", lambda: 0)
    record = PoolRecord(routing(), (Member("a", "127.0.0.1", 9000), Member("b", "h", 1)))
    follower.change("web", record.encode())
    follower.change("api", b"{}")  # unreadable: ignored
    follower.change("other", record.encode())  # a record under another name: ignored
    assert set(pool.services) == {"web"}
    pool.set_health("web", "a", Health.HEALTHY)
    lease = pool.service("web").lease()
    assert lease is not None
    assert follower.report() == NodeReport(
        {"web": frozenset({"a"})}, demand={"web": Demand({"a": 1})}
    )

    draining = dataclasses.replace(
        record,
        upstreams=(
            Member("a", "127.0.0.1", 9000, admin=AdminState.DRAINING, since=5),
            Member("b", "h", 1),
        ),
    )
    follower.change("web", draining.encode())
    assert pool.upstream("web", "a").admin is AdminState.DRAINING
    assert follower.report() == NodeReport(demand={"web": Demand({"a": 1})})
    lease.release()
    assert await pool.drain("web", "a", 1.0) is True  # the follower's drain, done
    assert follower.report() == NodeReport(
        idle={("web", "a"): 5}, demand={"web": Demand(completed=1)}
    )

    # The service's key deleted: gone here too; a key of no service of ours: nothing.
    follower.change("web", None)
    follower.change("nothing", None)
    assert pool.services == {}
    assert follower.report() == NodeReport()


async def test_a_follower_started_and_stopped_at_once_stops() -> None:
    """What a term that begins as the last one ends does (``_end_term`` starts the follower,
    ``_begin_term`` stops it with no await between): the report task, cancelled as its first
    wait ends, must end. With ``asyncio.wait_for`` (3.11) it swallowed the cancel and ``stop``
    never returned: the node never took the lead it had won."""
    pool = Pool(rng=random.Random(0))
    follower = Follower(EtcdClient(NOWHERE), "/p/", pool, "n1", lambda: 0)
    for _ in range(3):
        await follower.start()
        async with asyncio.timeout(2.0):
            await follower.stop()
        assert follower._tasks == []
    assert [t for t in asyncio.all_tasks() if t.get_name() == "cluster report n1"] == []


async def test_a_follower_that_leads_hands_its_drains_over_to_the_nodes() -> None:
    pool = Pool(rng=random.Random(0))
    follower = Follower(EtcdClient(NOWHERE), "/p/", pool, "n1", lambda: 0)
    record = PoolRecord(
        routing(), (Member("a", "127.0.0.1", 9000, admin=AdminState.DRAINING, since=3),)
    )
    follower.change("web", record.encode())
    pool.set_health("web", "a", Health.HEALTHY)  # as it was before the drain
    sp = pool.service("web")
    lease = sp.lease_of(sp.snapshot.upstreams[0])
    await follower.stop()
    pool.peer_joined(-1)  # its Peers loaded: another node reports
    assert follower.handover() == [("web", "a")]
    assert follower.handover() == []
    drain = pool.drain("web", "a", 10.0)
    assert pool.upstream("web", "a").admin is AdminState.DRAINING
    lease.release()
    assert not drain.done()  # the other node has not said it holds nothing
    pool.peer_idle(-1, "web", "a", sp.snapshot.version)
    assert await drain is True


# -- a leader and two followers on etcd -------------------------------------------------------


class Kinds:
    """The kinds of a pool's events, in order."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def on_pool_event(self, event: PoolEvent) -> None:
        self.kinds.append(event.kind)


class Changes:
    """Wakes ``eventually`` on any change: a pool event, a report taken in, a follower's status."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.statuses: list[tuple[str, str]] = []

    def on_pool_event(self, event: PoolEvent) -> None:
        self.event.set()

    def poke(self, *_: object) -> None:
        self.event.set()

    def status(self, node: str) -> Callable[[str], None]:
        def record(status: str) -> None:
            self.statuses.append((node, status))
            self.event.set()

        return record

    async def changed(self) -> None:
        """Returns at the next change (``eventually``'s ``changed``)."""
        self.event.clear()
        await self.event.wait()


@dataclass
class Cluster:
    """One leader's pool and two followers' pools, each node with its own etcd client."""

    etcd: EtcdCluster
    prefix: str
    changes: Changes
    clients: list[EtcdClient]
    leader: Pool
    publisher: Publisher
    peers: Peers
    pools: dict[str, Pool]
    followers: dict[str, Follower]
    leases: dict[str, int]

    async def stop(self) -> None:
        for follower in self.followers.values():
            await follower.stop()
        await self.peers.stop()
        await self.publisher.stop()
        for client in self.clients:
            await client.close()

    def has(self, node: str, uid: str, service: str = "web") -> bool:
        return self.pools[node].upstream(service, uid) is not None

    def admin(self, node: str, uid: str, service: str = "web") -> AdminState | None:
        upstream = self.pools[node].upstream(service, uid)
        return None if upstream is None else upstream.admin

    def idle(self, node: str) -> dict[tuple[str, str], int]:
        report = self.peers.table.reports.get(node)
        return {} if report is None else dict(report.idle)


RETRY = (0.05, 0.2)


@pytest.fixture
async def cluster(etcd: EtcdCluster, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    prefix = f"/test/{request.node.name}/"
    changes = Changes()
    clients = [EtcdClient(etcd.endpoints, timeout=0.5) for _ in range(3)]
    leader = Pool(rng=random.Random(0))
    leader.subscribe(changes)
    publisher = Publisher(clients[0], prefix, leader, list, delay=0.01, retry=RETRY)
    peers = Peers(clients[0], prefix, leader, "n0", on_change=changes.poke, retry=RETRY)
    pools: dict[str, Pool] = {}
    followers: dict[str, Follower] = {}
    leases: dict[str, int] = {}
    for i, node in enumerate(("n1", "n2"), start=1):
        pool = pools[node] = Pool(rng=random.Random(i))
        pool.subscribe(changes)
        leases[node] = await clients[i].grant(30)
        followers[node] = Follower(
            clients[i],
            prefix,
            pool,
            node,
            lambda node=node: leases[node],
            on_status=changes.status(node),
            delay=0.01,
            retry=RETRY,
            lease_check=0.05,
        )
    await publisher.start()
    await peers.start()
    await asyncio.wait_for(peers.loaded(), 5)
    for follower in followers.values():
        await follower.start()
    c = Cluster(etcd, prefix, changes, clients, leader, publisher, peers, pools, followers, leases)
    await eventually(
        lambda: c.peers.nodes == ["n1", "n2"],
        changed=changes.changed,
    )
    yield c
    await c.stop()


def add_web(c: Cluster, *upstreams: Up) -> None:
    c.leader.set_service(routing())
    for upstream in upstreams:
        c.leader.add_upstream(upstream)
        c.leader.set_health("web", upstream.id, Health.HEALTHY)


async def test_an_upstream_added_on_the_leader_appears_on_every_follower(cluster: Cluster) -> None:
    c = cluster
    add_web(c, up("a"))
    await eventually(
        lambda: c.has("n1", "a") and c.has("n2", "a"),
        changed=c.changes.changed,
    )
    for node in ("n1", "n2"):
        # Health is each node's own: it starts unknown, whatever the leader's probes said.
        assert c.pools[node].upstream("web", "a") == up("a")
    assert not c.peers.routable_everywhere("web", "a")
    c.pools["n1"].set_health("web", "a", Health.HEALTHY)
    await eventually(
        lambda: "a" in c.peers.table.reports["n1"].routable.get("web", ()),
        changed=c.changes.changed,
    )
    assert not c.peers.routable_everywhere("web", "a")  # n2 does not route to it yet
    c.pools["n2"].set_health("web", "a", Health.HEALTHY)
    await eventually(
        lambda: c.peers.routable_everywhere("web", "a"),
        changed=c.changes.changed,
    )

    # Health on the leader writes nothing.
    await c.publisher.flushed()
    writes = c.publisher.writes
    c.leader.set_health("web", "a", Health.UNHEALTHY)
    await c.publisher.flushed()
    assert c.publisher.writes == writes

    # Several changes at once: one transaction.
    requests = c.publisher.requests
    c.leader.add_upstream(up("b", 9001))
    c.leader.set_split("web", (0, 50))
    c.leader.set_failure("web", "why")
    await c.publisher.flushed()
    assert c.publisher.requests == requests + 1
    await eventually(
        lambda: c.has("n1", "b") and c.has("n2", "b"),
        changed=c.changes.changed,
    )
    for node in ("n1", "n2"):
        snapshot = c.pools[node].service("web").snapshot
        assert (snapshot.weights, snapshot.failure) == ((0, 50), "why")

    # Removed on the leader, removed everywhere; so is the service.
    c.leader.remove_upstream("web", "a")
    await eventually(
        lambda: not c.has("n1", "a") and not c.has("n2", "a"),
        changed=c.changes.changed,
    )
    c.leader.remove_service("web")
    await eventually(
        lambda: not c.pools["n1"].services and not c.pools["n2"].services,
        changed=c.changes.changed,
    )
    kvs, _ = await c.clients[0].get(pools_key(c.prefix), prefix=True)
    assert kvs == []


async def drain_with_a_request_on_n1(c: Cluster) -> tuple[asyncio.Future[bool], Any]:
    """Upstream ``a`` on every node, a request in flight on it in n1, then the leader drains it."""
    add_web(c, up("a"), up("b", 9001))
    await eventually(
        lambda: c.has("n1", "a") and c.has("n2", "a"),
        changed=c.changes.changed,
    )
    c.pools["n1"].set_health("web", "a", Health.HEALTHY)
    lease = c.pools["n1"].service("web").lease()
    assert lease is not None
    assert lease.upstream.id == "a"
    drain = c.leader.drain("web", "a", 10.0)
    await eventually(
        lambda: c.admin("n1", "a") == c.admin("n2", "a") == AdminState.DRAINING,
        changed=c.changes.changed,
    )
    # n2 holds nothing of it and says so; n1 holds a request.
    await eventually(
        lambda: ("web", "a") in c.idle("n2"),
        changed=c.changes.changed,
    )
    assert c.idle("n1") == {}
    assert not drain.done()
    return drain, lease


async def test_a_drain_on_the_leader_waits_for_every_follower(cluster: Cluster) -> None:
    c = cluster
    drain, lease = await drain_with_a_request_on_n1(c)
    lease.release()
    assert await asyncio.wait_for(drain, 5) is True
    assert c.idle("n1") == c.idle("n2")

    # Taken back on the leader: active everywhere, and no longer idle in any report.
    c.leader.undrain("web", "a")
    await eventually(
        lambda: c.admin("n1", "a") == c.admin("n2", "a") == AdminState.ACTIVE,
        changed=c.changes.changed,
    )
    await eventually(
        lambda: c.idle("n1") == c.idle("n2") == {},
        changed=c.changes.changed,
    )

    # Drained again: the reports of the earlier drain do not complete this one.
    c.pools["n2"].set_health("web", "a", Health.HEALTHY)
    lease = c.pools["n2"].service("web").lease()
    assert lease is not None
    drain = c.leader.drain("web", "a", 10.0)
    await eventually(
        lambda: ("web", "a") in c.idle("n1"),
        changed=c.changes.changed,
    )
    assert not drain.done()
    lease.release()
    assert await asyncio.wait_for(drain, 5) is True


async def test_a_node_whose_report_is_gone_holds_nothing(cluster: Cluster) -> None:
    c = cluster
    drain, lease = await drain_with_a_request_on_n1(c)
    await c.clients[1].revoke(c.leases["n1"])  # n1 is gone with its lease
    assert await asyncio.wait_for(drain, 5) is True
    assert c.peers.nodes == ["n2"]
    lease.release()
    # n1 registers again with a new lease: its report is written again, bound to it.
    c.leases["n1"] = await c.clients[1].grant(30)
    await eventually(
        lambda: c.peers.nodes == ["n1", "n2"],
        changed=c.changes.changed,
    )
    assert c.idle("n1") == {("web", "a"): c.idle("n2")[("web", "a")]}


async def test_a_drain_timeout_comes_with_the_record(cluster: Cluster) -> None:
    c = cluster
    await c.publisher.stop()
    c.publisher = Publisher(
        c.clients[0], c.prefix, c.leader, list, drain_timeout=lambda s, u: 0.05, delay=0.01
    )
    await c.publisher.start()
    add_web(c, up("a"))
    await eventually(lambda: c.has("n1", "a"), changed=c.changes.changed)
    c.pools["n1"].set_health("web", "a", Health.HEALTHY)
    lease = c.pools["n1"].service("web").lease()
    assert lease is not None
    aborted = asyncio.Event()
    lease.on_abort = aborted.set
    c.leader.drain("web", "a", 10.0)
    await asyncio.wait_for(aborted.wait(), 5)  # n1's own drain timed out after 0.05 s
    lease.release()


async def test_with_etcd_gone_followers_keep_their_pools_and_resume(cluster: Cluster) -> None:
    c = cluster
    add_web(c, up("a"))
    await eventually(
        lambda: c.has("n1", "a") and c.has("n2", "a"),
        changed=c.changes.changed,
    )
    before = {node: pool.service("web").snapshot.upstreams for node, pool in c.pools.items()}
    await asyncio.to_thread(c.etcd.stop_all)
    try:
        await eventually(
            lambda: all(f.status == "unreachable" for f in c.followers.values()),
            changed=c.changes.changed,
        )
        c.leader.add_upstream(up("b", 9001))  # the publisher retries until etcd is back
        drain = c.leader.drain("web", "a", 30.0)
        for node, pool in c.pools.items():
            assert pool.service("web").snapshot.upstreams == before[node]
        assert c.peers.nodes == ["n1", "n2"]  # nobody heard of leaves nothing
    finally:
        c.etcd.start_member(0)
        await asyncio.to_thread(c.etcd.wait_healthy)
    await eventually(
        lambda: c.has("n1", "b") and c.has("n2", "b"),
        timeout=10,
        changed=c.changes.changed,
    )
    await eventually(
        lambda: c.admin("n1", "a") == c.admin("n2", "a") == AdminState.DRAINING,
        changed=c.changes.changed,
    )
    assert all(f.status == "watching" for f in c.followers.values())
    assert await asyncio.wait_for(drain, 5) is True  # both nodes said they hold nothing


async def test_a_follower_started_again_after_a_compaction_loads_anew(cluster: Cluster) -> None:
    c = cluster
    add_web(c, up("a"))
    c.leader.set_service(routing("api"))
    await eventually(
        lambda: c.has("n1", "a") and "api" in c.pools["n1"].services,
        changed=c.changes.changed,
    )
    await c.followers["n1"].stop()
    await eventually(
        lambda: c.peers.nodes == ["n2"], changed=c.changes.changed
    )  # its report went with it
    c.leader.remove_upstream("web", "a")
    c.leader.add_upstream(up("b", 9001))
    c.leader.remove_service("api")
    await c.publisher.flushed()
    _, revision = await c.clients[0].get(b"/nothing")
    await c.clients[0].compact(revision)
    await c.followers["n1"].start()
    await eventually(
        lambda: c.has("n1", "b") and not c.has("n1", "a"),
        changed=c.changes.changed,
    )
    assert set(c.pools["n1"].services) == {"web"}
    await eventually(
        lambda: c.peers.nodes == ["n1", "n2"],
        changed=c.changes.changed,
    )


async def test_a_follower_back_from_leading_keeps_what_its_pool_has_and_probed(
    cluster: Cluster,
) -> None:
    """A node that led made its pool itself; following again, it loads the records as they
    are now. Replaying the records written while it led (from the revision it last saw)
    removed and added again every upstream an older record lacked: health unknown, so
    nothing routable for a moment (the etcd-faults e2e test's 503s)."""
    c = cluster
    add_web(c, up("a"))
    await eventually(lambda: c.has("n1", "a"), changed=c.changes.changed)
    n1 = c.pools["n1"]
    await c.followers["n1"].stop()  # n1 leads: its controller makes the same changes
    for pool in (c.leader, n1):
        pool.remove_upstream("web", "a")
        await c.publisher.flushed()  # a record without "a" or "b" in between
        pool.add_upstream(up("b", 9001))
        pool.set_health("web", "b", Health.HEALTHY)
    await c.publisher.flushed()
    seen = Kinds()
    n1.subscribe(seen)
    kvs, _ = await c.clients[0].get(pools_key(c.prefix, "web"))
    await c.followers["n1"].start()
    # Applied once the follower's feed is at the last record's revision.
    await eventually(
        lambda: c.followers["n1"].feed.revision >= kvs[0].mod_revision,
        changed=c.changes.changed,
    )
    upstream = n1.upstream("web", "b")
    assert upstream is not None
    assert upstream.health is Health.HEALTHY
    assert not {"removed", "added"} & set(seen.kinds), seen.kinds


async def test_a_deposed_leader_writes_nothing(cluster: Cluster) -> None:
    c = cluster
    leader_key = f"{c.prefix}leader".encode()
    await c.clients[0].put(leader_key, b"n0")
    await c.publisher.stop()
    deposed = asyncio.Event()
    c.publisher = Publisher(
        c.clients[0],
        c.prefix,
        c.leader,
        lambda: [Compare(leader_key, "VALUE", "EQUAL", b"n0")],
        on_deposed=deposed.set,
        delay=0.01,
    )
    await c.publisher.start()
    add_web(c, up("a"))
    await eventually(lambda: c.has("n1", "a"), changed=c.changes.changed)
    await c.clients[0].put(leader_key, b"n3")
    c.leader.add_upstream(up("b", 9001))
    await asyncio.wait_for(deposed.wait(), 5)
    assert c.publisher.deposed
    kvs, _ = await c.clients[0].get(pools_key(c.prefix, "web"))
    assert [m.id for m in PoolRecord.decode(kvs[0].value).upstreams] == ["a"]
    await c.publisher.flushed()  # returns: a deposed publisher has nothing left to do


async def test_many_services_in_few_transactions_and_pruning(cluster: Cluster) -> None:
    c = cluster
    await c.publisher.flushed()
    requests = c.publisher.requests
    names = [f"s{i:03}" for i in range(150)]
    for name in names:
        c.leader.set_service(routing(name))
    await c.publisher.flushed()
    assert c.publisher.requests == requests + 2  # 100 writes in a transaction at most
    await eventually(
        lambda: sorted(c.pools["n2"].services) == names,
        changed=c.changes.changed,
    )

    # A new leader whose pool lacks some services leaves them be, unless told to prune.
    await c.publisher.stop()
    c.leader.remove_service("s000")
    for prune in (False, True):
        c.publisher = Publisher(c.clients[0], c.prefix, c.leader, list, prune=prune, delay=0.01)
        await c.publisher.start()
        await c.publisher.flushed()
        await c.publisher.stop()
        assert c.publisher.writes == int(prune)
    await eventually(
        lambda: "s000" not in c.pools["n1"].services,
        changed=c.changes.changed,
    )
    assert sorted(c.pools["n1"].services) == names[1:]
