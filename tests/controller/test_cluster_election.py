"""controller/cluster/election.py and lease.py on a real three-member etcd cluster."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from controller.cluster.election import Election
from controller.cluster.leadership import Transition
from controller.cluster.lease import LeaseEvent, LeaseKeeper
from controller.errors import Deposed
from controller.etcd import EtcdClient, Put
from tests.etcd_cluster import EtcdCluster

TTL = 2
_prefixes = itertools.count()


@dataclass
class Node:
    name: str
    client: EtcdClient
    keeper: LeaseKeeper
    election: Election
    transitions: list[Transition]
    lease_events: list[LeaseEvent]


NodeFactory = Callable[..., Awaitable[Node]]


@pytest.fixture
async def node(cluster: EtcdCluster) -> AsyncIterator[NodeFactory]:
    prefix = f"/election/{next(_prefixes)}/"
    nodes: list[Node] = []

    async def make(name: str, *, margin: float | None = None) -> Node:
        client = EtcdClient(cluster.endpoints, timeout=1.0)
        keeper = LeaseKeeper(client, ttl=TTL, margin=margin)
        election = Election(client, keeper, name, prefix)
        n = Node(name, client, keeper, election, [], [])
        election.subscribe(n.transitions.append)
        keeper.subscribe(n.lease_events.append)
        keeper.start()
        election.start()
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        await n.election.stop()
        await n.keeper.stop()
        await n.client.close()


async def first_leader(nodes: list[Node], timeout: float) -> Node:
    waits = {asyncio.ensure_future(n.election.elected()): n for n in nodes}
    done, pending = await asyncio.wait(waits, timeout=timeout, return_when="FIRST_COMPLETED")
    for w in pending:
        w.cancel()
    assert done, f"nobody led within {timeout} s: {[n.election for n in nodes]}"
    return waits[done.pop()]


async def test_one_leads_and_all_see_it(node: NodeFactory) -> None:
    nodes = [await node(f"n{i}") for i in range(3)]
    leader = await first_leader(nodes, 5)
    for n in nodes:
        assert await asyncio.wait_for(n.election.wait_leader(), 5) == leader.name
    assert [n.election.leading for n in nodes].count(True) == 1
    assert leader.election.leader == leader.name
    assert leader.election.reason == ""
    [fence] = leader.election.fence()
    assert fence.target == "CREATE"
    assert fence.value == leader.election.term > 0
    follower = next(n for n in nodes if n is not leader)
    assert follower.election.reason == f"{leader.name} leads"
    with pytest.raises(Deposed):
        follower.election.fence()
    assert leader.transitions == [Transition(True, leader.transitions[0].at, "won the campaign")]
    assert follower.transitions == []


async def test_a_leader_that_stops_renewing_is_replaced_within_the_ttl(
    node: NodeFactory,
) -> None:
    nodes = [await node(f"n{i}") for i in range(3)]
    old = await first_leader(nodes, 5)
    fence = old.election.fence()
    # The process dies: nothing renews, nothing revokes; etcd expires the lease.
    await old.election.stop()
    old.keeper._task.cancel()  # type: ignore[union-attr]
    stopped = time.monotonic()
    rest = [n for n in nodes if n is not old]
    new = await first_leader(rest, TTL + 1)
    assert time.monotonic() - stopped < TTL + 1
    assert new.election.leading
    # The old leader's fenced write fails in etcd, whatever the old node believes.
    result = await old.client.txn(fence, [Put(b"/election/write", old.name.encode())])
    assert not result.succeeded
    assert new.election.term != fence[0].value
    ok = await new.client.txn(new.election.fence(), [Put(b"/election/write", b"new")])
    assert ok.succeeded


async def test_a_revoked_lease_hands_over_at_once(node: NodeFactory) -> None:
    nodes = [await node(f"n{i}") for i in range(2)]
    old = await first_leader(nodes, 5)
    await old.keeper.stop(revoke=True)
    assert not old.election.leading
    assert [t.leading for t in old.transitions] == [True, False]
    new = next(n for n in nodes if n is not old)
    started = time.monotonic()
    await asyncio.wait_for(new.election.elected(), 1)
    assert time.monotonic() - started < 1


async def test_a_paused_keeper_stops_leading_by_its_local_deadline(
    node: NodeFactory, cluster: EtcdCluster
) -> None:
    old = await node("n0", margin=0.5)
    await asyncio.wait_for(old.election.elected(), 5)
    other = await node("n1")
    await asyncio.wait_for(other.election.wait_leader(), 5)
    observer = EtcdClient(cluster.endpoints)
    try:
        # The keeper's task hangs in its next keepalive: stopped, not cancelled.
        hang = asyncio.Event()

        async def stuck(lease: int) -> int:
            await hang.wait()
            return 0

        old.client.keepalive = stuck  # type: ignore[method-assign]
        lease = old.keeper.lease
        await asyncio.wait_for(old.election.deposed(), TTL + 1)
        assert not old.election.leading
        assert old.transitions[-1].leading is False
        assert old.transitions[-1].reason == "the lease was not renewed in time"
        # etcd has not expired the lease yet: the old leader stopped first.
        kvs, _ = await observer.get(old.election.key)
        assert [(kv.value, kv.lease) for kv in kvs] == [(b"n0", lease)]
        assert not other.election.leading
        # Then etcd expires it and the other node leads.
        await asyncio.wait_for(other.election.elected(), TTL + 1)
        assert not old.election.leading
        hang.set()
    finally:
        await observer.close()


async def test_resign_hands_over_at_once(node: NodeFactory) -> None:
    nodes = [await node(f"n{i}") for i in range(3)]
    old = await first_leader(nodes, 5)
    rest = [n for n in nodes if n is not old]
    started = time.monotonic()
    await old.election.resign()
    assert not old.election.leading
    assert old.transitions[-1] == Transition(False, old.transitions[-1].at, "resigned")
    await first_leader(rest, 1)
    assert time.monotonic() - started < 1


async def test_a_lost_lease_is_replaced_and_the_node_campaigns_again(
    node: NodeFactory,
) -> None:
    only = await node("n0")
    await asyncio.wait_for(only.election.elected(), 5)
    first_lease = only.keeper.lease
    first_term = only.election.term
    await only.client.revoke(first_lease)  # as if etcd had expired it
    await asyncio.wait_for(only.election.deposed(), 2)
    await asyncio.wait_for(only.election.elected(), 5)
    assert only.keeper.lease != first_lease
    assert only.election.term > first_term
    assert [e.kind for e in only.lease_events] == ["granted", "lost", "granted"]
    assert [t.leading for t in only.transitions] == [True, False, True]


async def test_etcd_down_then_back(node: NodeFactory, cluster: EtcdCluster) -> None:
    nodes = [await node(f"n{i}") for i in range(2)]
    leader = await first_leader(nodes, 5)
    cluster.stop_all()
    try:
        # Nobody can vouch for a lease: the leader stops by its local deadline.
        await asyncio.wait_for(leader.election.deposed(), TTL + 0.5)
        assert not any(n.election.leading for n in nodes)
        assert leader.lease_events[-1].kind == "lapsed"
        assert "etcd unavailable" in leader.keeper.unreachable
        with pytest.raises(Deposed):
            leader.election.fence()
    finally:
        for i in range(len(cluster.members)):
            cluster.start_member(i)
        cluster.wait_healthy()
    # etcd restores the leases it had: the cluster goes on, one node leads again.
    again = await first_leader(nodes, 10)
    assert again.election.fence()
    assert [n.election.leading for n in nodes].count(True) == 1
    for n in nodes:
        assert await asyncio.wait_for(n.election.wait_leader(), 5) == again.name


async def test_a_process_that_was_stopped_wakes_up_not_leading(node: NodeFactory) -> None:
    nodes = [await node(f"n{i}") for i in range(2)]
    old = await first_leader(nodes, 5)
    # The whole process stops (SIGSTOP): no task, no timer runs until it continues.
    time.sleep(TTL + 0.5)
    # Before anything else runs, what it reads says it does not lead.
    assert not old.election.leading
    assert old.election.leader is None or old.election.leader != old.name
    with pytest.raises(Deposed):
        old.election.fence()
    # Then the loop runs again: its term has ended for good; a leader follows.
    await asyncio.sleep(0)
    await first_leader(nodes, TTL + 2)
    assert [n.election.leading for n in nodes].count(True) == 1
    assert [t.leading for t in old.transitions][:2] == [True, False]
    assert old.transitions[1].reason in (
        "the lease was not renewed in time",
        "the lease lapsed before it was renewed",
        "etcd no longer has the lease",
        "the leader key was deleted",
        f"{nodes[1 - nodes.index(old)].name} leads",
    )
