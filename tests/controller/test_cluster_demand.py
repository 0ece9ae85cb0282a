"""``controller.cluster.demand``: the nodes' traffic merged over the live nodes (issue 54, item 3).

The table is pure: each test passes ``now`` as the leader's clock would read it."""

from __future__ import annotations

import asyncio

import pytest

from controller.cluster.demand import Demand, DemandTable
from controller.cluster.membership import Member, NodeReport, PoolRecord, report_of
from controller.cluster.peers import Peers
from controller.cluster.pools import Follower, pools_key
from controller.etcd import EtcdClient
from controller.planning.autoscaler import Sample
from gateway import Health, Pool
from tests.controller.test_cluster_pools import routing
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually

TTL = 2.0


def merged(table: DemandTable, now: float, service: str = "web") -> tuple[int, int, int, int]:
    """(in flight, held, completed, waited) of ``service`` over the table's nodes at ``now``."""
    s = table.merged(service, now)
    return s.inflight, s.held, s.completed, s.waited


@pytest.mark.parametrize(
    ("reports", "now", "expected"),
    [
        # (node, at, demand) taken in in order; then the merge at ``now``.
        ([], 0.0, (0, 0, 0, 0)),
        # Rule 1: in flight and held summed over the nodes.
        (
            [("n1", 0.0, Demand({"a": 2}, 1)), ("n2", 0.5, Demand({"a": 1, "b": 3}, 2))],
            1.0,
            (6, 3, 0, 0),
        ),
        # Rule 1: a report older than its node's TTL no longer counts its requests.
        (
            [("n1", 0.0, Demand({"a": 2}, 1)), ("n2", 1.5, Demand({"b": 3}))],
            2.5,
            (3, 0, 0, 0),
        ),
        # Rule 2: a node counts from its first report's totals...
        ([("n1", 0.0, Demand(completed=50, waited=5))], 1.0, (0, 0, 0, 0)),
        # ... and what it completes after.
        (
            [
                ("n1", 0.0, Demand(completed=50, waited=5)),
                ("n1", 1.0, Demand(completed=80, waited=6)),
            ],
            1.5,
            (0, 0, 30, 1),
        ),
        # Rule 2: totals that went down (started again under its name) count on from there.
        (
            [
                ("n1", 0.0, Demand(completed=50)),
                ("n1", 1.0, Demand(completed=80)),
                ("n1", 2.0, Demand(completed=4)),
                ("n1", 3.0, Demand(completed=10)),
            ],
            3.0,
            (0, 0, 36, 0),
        ),
        # Rule 2: a stale report's totals still count (what it completed did happen).
        (
            [("n1", 0.0, Demand(completed=0)), ("n1", 1.0, Demand({"a": 1}, completed=9))],
            9.0,
            (0, 0, 9, 0),
        ),
    ],
)
def test_the_merge_rule(
    reports: list[tuple[str, float, Demand]], now: float, expected: tuple[int, int, int, int]
) -> None:
    table = DemandTable()
    for node, at, demand in reports:
        table.update(node, {"web": demand}, at, TTL)
    assert merged(table, now) == expected


def test_a_dead_node_stops_counting_within_its_ttl_and_its_totals_stay() -> None:
    """A node dies at t=3 with 4 requests in flight and 2 held, having completed 30 since the
    table first saw it. Stale by t=3+TTL at the latest (its report's age), gone when its lease
    ends (the report's key deleted): its requests no longer count, its completions do, so the
    totals the autoscaler reads a rate from never go down."""
    table = DemandTable()
    table.update("n1", {"web": Demand(completed=100)}, 0.0, TTL)
    table.update("n2", {"web": Demand({"a": 1}, completed=7)}, 0.0, TTL)
    table.update("n1", {"web": Demand({"a": 3, "b": 1}, 2, completed=130)}, 3.0, TTL)
    table.update("n2", {"web": Demand({"a": 1}, completed=9)}, 3.0, TTL)
    assert merged(table, 3.0) == (5, 2, 32, 0)
    table.update("n2", {"web": Demand({"a": 1}, completed=11)}, 4.5, TTL)  # n2 lives on
    assert merged(table, 5.0) == (5, 2, 34, 0)
    assert merged(table, 5.1) == (1, 0, 34, 0)  # n1's report is older than its TTL
    table.remove("n1")  # its lease ended: the key went
    assert merged(table, 5.2) == (1, 0, 34, 0)
    assert "n1" not in table.nodes
    table.update("n1", {"web": Demand(completed=3)}, 6.0, TTL)  # back, started again
    table.update("n1", {"web": Demand(completed=5)}, 7.0, TTL)
    assert merged(table, 7.0) == (0, 0, 36, 0)


def test_a_report_without_a_ttl_counts_while_it_is_there() -> None:
    table = DemandTable()
    table.update("n1", {"web": Demand({"a": 2})}, 0.0)
    assert merged(table, 1000.0) == (2, 0, 0, 0)
    table.remove("n1")
    assert merged(table, 1000.0) == (0, 0, 0, 0)


def test_per_replica_in_flight_is_summed_and_services_are_apart() -> None:
    table = DemandTable()
    table.update("n1", {"web": Demand({"a": 2, "b": 1}), "api": Demand({"x": 5})}, 0.0, TTL)
    table.update("n2", {"web": Demand({"b": 4})}, 0.0, TTL)
    assert table.merged("web", 0.5).per_replica == (("a", 2), ("b", 5))
    assert table.merged("api", 0.5).per_replica == (("x", 5),)
    assert table.merged("none", 0.5) == Sample(0.5, 0)


@pytest.mark.parametrize(
    ("before", "after", "began"),
    [
        (None, Demand(held=1), ["web"]),  # a new node that holds
        (Demand(), Demand(held=1), ["web"]),
        (Demand(held=2), Demand(held=3), []),  # held already
        (Demand(held=2), Demand(), []),
        (None, Demand({"a": 1}), []),
    ],
)
def test_a_node_that_begins_holding_is_the_cue(
    before: Demand | None, after: Demand, began: list[str]
) -> None:
    table = DemandTable()
    if before is not None:
        table.update("n1", {"web": before}, 0.0, TTL)
    assert table.update("n1", {"web": after}, 1.0, TTL) == began


def test_held_again_after_a_stale_report_is_the_cue_again() -> None:
    table = DemandTable()
    table.update("n1", {"web": Demand(held=1)}, 0.0, TTL)
    assert table.update("n1", {"web": Demand(held=1)}, 5.0, TTL) == ["web"]


def test_a_report_with_demand_round_trips_and_leaves_out_what_has_none() -> None:
    records = {"web": PoolRecord(routing()), "api": PoolRecord(routing("api"))}
    demand = {
        "web": Demand({"a": 2}, 1, 40, 3),
        "api": Demand(),  # nothing so far: left out
        "gone": Demand(held=1),  # not one of the cluster's services: left out
    }
    report = report_of([], records, [], demand, TTL)
    assert report == NodeReport(demand={"web": Demand({"a": 2}, 1, 40, 3)}, fresh_for=TTL)
    assert report.busy
    assert NodeReport.decode(report.encode()) == report
    # A report written before demand was: none, counted while it is there.
    old = NodeReport.decode(b'{"routable":{},"idle":{}}')
    assert (old.demand, old.fresh_for, old.busy) == ({}, 0.0, False)
    assert not NodeReport(demand={"web": Demand(completed=4)}).busy


async def test_peers_merge_the_reports_demand_and_cue_a_hold() -> None:
    now = [10.0]
    waiting: list[str] = []
    peers = Peers(
        EtcdClient(["http://127.0.0.1:9"]),
        "/p/",
        Pool(),
        "me",
        on_waiting=waiting.append,
        clock=lambda: now[0],
    )
    peers.change("me", NodeReport(demand={"web": Demand(held=5)}).encode())  # its own: not
    peers.change("n1", NodeReport(demand={"web": Demand(held=1)}, fresh_for=TTL).encode())
    peers.change("n2", NodeReport(demand={"web": Demand({"a": 2})}, fresh_for=TTL).encode())
    assert waiting == ["web"]
    assert (peers.elsewhere("web").held, peers.elsewhere("web").inflight) == (1, 2)
    now[0] = 13.0  # both reports older than the TTL
    assert (peers.elsewhere("web").held, peers.elsewhere("web").inflight) == (0, 0)
    peers.change("n1", None)  # its lease ended
    assert "n1" not in peers.demand.nodes
    await peers.stop()
    assert peers.demand.nodes == {}


def test_a_sample_plus_the_other_nodes_traffic() -> None:
    own = Sample(5.0, 3, 1, 100, 2, ready=2, per_replica=(("a", 2), ("b", 1)))
    other = Sample(4.0, 4, 2, 30, 1, per_replica=(("b", 1), ("c", 3)))
    assert own.plus(other) == Sample(
        5.0, 7, 3, 130, 3, ready=2, per_replica=(("a", 2), ("b", 2), ("c", 3))
    )


# -- with etcd: a follower's report, and the leader's peers ---------------------------------


async def test_a_request_held_on_a_follower_reaches_the_leader_at_once_and_stays_fresh(
    etcd: EtcdCluster,
) -> None:
    """The follower looks at its traffic every 5 s here: the hold is reported at once all
    the same (the pool's cue), and while it lasts the report is written again within a
    third of ``fresh_for`` though nothing changed, so the leader never reads it as stale."""
    clients = [EtcdClient(etcd.endpoints, timeout=0.5) for _ in range(2)]
    heard = asyncio.Event()
    waiting: list[str] = []
    peers = Peers(
        clients[0],
        "/demand/",
        Pool(),
        "n0",
        on_change=lambda _: heard.set(),
        on_waiting=waiting.append,
    )
    pool = Pool()
    lease = await clients[1].grant(30)
    follower = Follower(
        clients[1],
        "/demand/",
        pool,
        "n1",
        lambda: lease,
        delay=0.01,
        lease_check=5.0,
        fresh_for=0.6,
    )

    async def changed() -> None:
        heard.clear()
        await heard.wait()

    try:
        await peers.start()
        await peers.loaded()
        record = PoolRecord(routing(), (Member("a", "127.0.0.1", 9000),))
        await clients[0].put(pools_key("/demand/", "web"), record.encode())  # the leader's
        await follower.start()
        await asyncio.wait_for(follower.feed.loaded.wait(), 5)
        await eventually(lambda: peers.nodes == ["n1"], changed=changed)
        pool.on_waiting = lambda _: follower.wake()  # the node's wiring (``ClusterNode``)
        held = asyncio.ensure_future(pool.service("web").queue(10.0))
        await eventually(lambda: waiting == ["web"], changed=changed)
        assert peers.elsewhere("web").held == 1
        written = follower.reports
        await eventually(lambda: follower.reports >= written + 2, changed=changed)
        assert peers.elsewhere("web").held == 1
        pool.set_health("web", "a", Health.HEALTHY)  # the hold ends
        await held
        await eventually(lambda: peers.elsewhere("web").held == 0, changed=changed)
        assert peers.elsewhere("web").waited == 1  # after its first report: counted
    finally:
        await follower.stop()
        await peers.stop()
        for client in clients:
            await client.close()
