"""controller/cluster/election.py and lease.py on a real three-member etcd cluster.

The leader record is bound to no lease: a follower takes over once the record has not changed
for TTL + margin by its own clock, whatever etcd does with the old leader's lease."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from controller.cluster.election import Election
from controller.cluster.leadership import Record, Transition
from controller.cluster.lease import LeaseEvent, LeaseKeeper
from controller.errors import Deposed
from controller.etcd import EtcdClient, Put, TxnResult
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually

TTL = 2
MARGIN = 0.2  # default_margin(TTL)
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

    async def make(
        name: str, *, margin: float | None = None, ttl: int = TTL, timeout: float = 1.0
    ) -> Node:
        client = EtcdClient(cluster.endpoints, timeout=timeout)
        keeper = LeaseKeeper(client, ttl=ttl, margin=margin)
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
    assert (fence.target, fence.result) == ("VALUE", "EQUAL")
    record = Record.decode(fence.value)  # type: ignore[arg-type]
    assert record == Record(leader.name, leader.election.term, TTL, leader.keeper.lease)
    follower = next(n for n in nodes if n is not leader)
    assert follower.election.reason == f"{leader.name} leads"
    with pytest.raises(Deposed):
        follower.election.fence()
    assert leader.transitions == [Transition(True, leader.transitions[0].at, "won the campaign")]
    assert follower.transitions == []


async def test_the_leader_renews_its_record_and_nobody_takes_over(node: NodeFactory) -> None:
    ttl = 3  # more room than TTL for a loop slowed by a loaded machine
    nodes = [await node(f"n{i}", ttl=ttl) for i in range(2)]
    leader = await first_leader(nodes, 5)
    term = leader.election.term
    renewals = leader.election.renewals
    started = time.monotonic()
    # Four renewals take 4 s: longer than a follower waits (TTL + margin) for a silent record.
    await eventually(
        lambda: leader.election.renewals >= renewals + 4,
        changed=lambda: leader.election._changed.wait(),
        timeout=4 * ttl,
        what="four renewals",
    )
    assert time.monotonic() - started > ttl + 0.3
    assert leader.election.term == term
    assert [n.election.leading for n in nodes].count(True) == 1
    assert all(n.election.campaigns <= 2 for n in nodes), [n.election for n in nodes]
    assert all(len(n.transitions) <= 1 for n in nodes)


async def test_a_renewal_lost_in_etcd_is_sent_again_and_the_term_goes_on(node: NodeFactory) -> None:
    """A write sent to a member as etcd's raft leader dies is lost: that member answers it only
    at etcd's request timeout, seconds later. Here the next two requests of a renewal get no
    answer at all, with the client's default timeout (2 s, more than the term's slack of
    1.13 s): the renewal gives them up within TTL/3 and the term goes on. Waiting on them as
    long as the client does (1 s, then 0.5 s), the third member's answer came 2.17 s after
    the last renewal was sent, past the term's deadline (1.8 s)."""
    n = await node("n0", timeout=2.0)
    await asyncio.wait_for(n.election.elected(), 5)
    renewals = n.election.renewals
    await eventually(  # just renewed: the next renewal is TTL/3 away
        lambda: n.election.renewals != renewals,
        changed=lambda: n.election._changed.wait(),
        timeout=TTL,
        what="a renewal",
    )
    lost = 2
    send = n.client._send

    async def losing(
        endpoint: str, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> Any:
        nonlocal lost
        if path == "/v3/kv/txn" and lost:
            lost -= 1
            await asyncio.Event().wait()  # never answered
        return await send(endpoint, path, body, headers)

    n.client._send = losing  # type: ignore[method-assign]
    renewals = n.election.renewals
    await eventually(
        lambda: n.election.renewals >= renewals + 2,
        changed=lambda: n.election._changed.wait(),
        timeout=6 * TTL,
        what="two renewals past the lost requests",
    )
    assert lost == 0
    assert n.transitions == [Transition(True, n.transitions[0].at, "won the campaign")]
    assert n.election.leading


async def test_a_leader_that_stops_renewing_is_replaced_within_the_ttl(
    node: NodeFactory,
) -> None:
    nodes = [await node(f"n{i}") for i in range(3)]
    old = await first_leader(nodes, 5)
    fence = old.election.fence()
    # The process dies: nothing renews, nothing revokes.
    await old.election.stop()
    old.keeper._task.cancel()  # type: ignore[union-attr]
    stopped = time.monotonic()
    rest = [n for n in nodes if n is not old]
    new = await first_leader(rest, TTL + 3)
    assert time.monotonic() - stopped < TTL + MARGIN + 1
    assert new.election.leading
    # The old leader's fenced write fails in etcd, whatever the old node believes.
    result = await old.client.txn(fence, [Put(b"/election/write", old.name.encode())])
    assert not result.succeeded
    assert new.election.term > Record.decode(fence[0].value).term  # type: ignore[arg-type]
    ok = await new.client.txn(new.election.fence(), [Put(b"/election/write", b"new")])
    assert ok.succeeded


async def test_a_stopped_leader_whose_lease_is_kept_alive_is_replaced_and_then_follows(
    node: NodeFactory, cluster: EtcdCluster
) -> None:
    """Issue 54: etcd may be slow to expire a dead leader's lease (here: never, a keepalive
    from the test holds it). The record is bound to no lease: a follower takes over by its own
    clock, the old leader stops by its own first, and its writes are refused after."""
    old = await node("n0")
    await asyncio.wait_for(old.election.elected(), 5)
    other = await node("n1")
    await asyncio.wait_for(other.election.wait_leader(), 5)
    fence = old.election.fence()
    lease = old.keeper.lease
    # The old leader stops (as SIGSTOP would): every etcd call it makes hangs until released.
    released = asyncio.Event()
    real_txn, real_keepalive = old.client.txn, old.client.keepalive

    async def stuck_txn(*args: Any, **kwargs: Any) -> TxnResult:
        await released.wait()
        return await real_txn(*args, **kwargs)

    async def stuck_keepalive(lease: int) -> int:
        await released.wait()
        return await real_keepalive(lease)

    old.client.txn = stuck_txn  # type: ignore[method-assign]
    old.client.keepalive = stuck_keepalive  # type: ignore[method-assign]
    held = EtcdClient(cluster.endpoints)
    keeping = asyncio.create_task(keep_alive(held, lease))
    try:
        stopped = time.monotonic()
        await asyncio.wait_for(old.election.deposed(), TTL + 1)
        assert old.transitions[-1].reason == "the leader record was not renewed in time"
        await asyncio.wait_for(other.election.elected(), TTL + 3)
        took = time.monotonic() - stopped
        # It stopped before the other took over (both nodes read this one loop's clock).
        assert old.transitions[-1].at < other.transitions[0].at
        print(f"takeover {took:.2f} s after the leader stopped (TTL {TTL} s)")
        assert took < TTL + MARGIN + 1.5
        # etcd never expired the old leader's lease.
        assert await held.keepalive(lease) > 0
        # Woken: its renewal (pending all along) and its writes are refused; it follows.
        released.set()
        result = await old.client.txn(fence, [Put(b"/election/write", b"old")])
        assert not result.succeeded
        await eventually(
            lambda: old.election.leader == "n1",
            changed=lambda: old.election._changed.wait(),
            timeout=5,
            what="n1 leading, as n0 sees",
        )
        assert not old.election.leading
        with pytest.raises(Deposed):
            old.election.fence()
        assert other.election.leading
        assert [t.leading for t in old.transitions] == [True, False]
    finally:
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
        await held.close()


async def keep_alive(client: EtcdClient, lease: int) -> None:
    while True:
        await client.keepalive(lease)
        await asyncio.sleep(TTL / 4)


async def test_a_lost_lease_neither_ends_the_term_nor_hands_over(node: NodeFactory) -> None:
    nodes = [await node(f"n{i}") for i in range(2)]
    old = await first_leader(nodes, 5)
    term = old.election.term
    first_lease = old.keeper.lease
    regranted = asyncio.Event()
    old.keeper.subscribe(lambda e: regranted.set() if e.kind == "granted" else None)
    await old.client.revoke(first_lease)  # as if etcd had expired it
    # The record is bound to no lease: etcd deleted nothing of it.
    kvs, _ = await old.client.get(old.election.key)
    assert Record.decode(kvs[0].value) == Record(old.name, term, TTL, first_lease)
    await asyncio.wait_for(regranted.wait(), 5)
    assert [e.kind for e in old.lease_events] == ["granted", "lost", "granted"]
    assert old.election.leading
    assert old.election.term == term
    assert [t.leading for t in old.transitions] == [True]


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


async def test_etcd_down_then_back(node: NodeFactory, cluster: EtcdCluster) -> None:
    nodes = [await node(f"n{i}") for i in range(2)]
    leader = await first_leader(nodes, 5)
    cluster.stop_all()
    try:
        # Nobody can renew the record: the leader stops by its own deadline.
        await asyncio.wait_for(leader.election.deposed(), TTL + 0.5)
        assert not any(n.election.leading for n in nodes)
        assert leader.transitions[-1].reason == "the leader record was not renewed in time"
        with pytest.raises(Deposed):
            leader.election.fence()
    finally:
        for i in range(len(cluster.members)):
            cluster.start_member(i)
        cluster.wait_healthy()
    # The record is as the leader left it: the same node takes it back at once.
    again = await first_leader(nodes, 10)
    assert again.election.fence()
    assert [n.election.leading for n in nodes].count(True) == 1
    for n in nodes:
        assert await asyncio.wait_for(n.election.wait_leader(), 5) == again.name


async def test_a_process_that_was_stopped_wakes_up_not_leading(node: NodeFactory) -> None:
    nodes = [await node(f"n{i}") for i in range(2)]
    old = await first_leader(nodes, 5)
    # The whole process stops (SIGSTOP): no task, no timer runs until it continues. The
    # blocking sleep is that stop, the thing under test (etcd's lease expires meanwhile).
    time.sleep(TTL + 0.5)
    # Before anything else runs, what it reads says it does not lead.
    assert not old.election.leading
    assert old.election.leader is None
    with pytest.raises(Deposed):
        old.election.fence()
    # Then the loop runs again: its term has ended for good; a leader follows (a new term).
    await asyncio.sleep(0)
    await first_leader(nodes, TTL + 2)
    assert [n.election.leading for n in nodes].count(True) == 1
    assert [t.leading for t in old.transitions][:2] == [True, False]
    other = nodes[1 - nodes.index(old)].name
    assert old.transitions[1].reason in (
        "the leader record was not renewed in time",
        "the record was renewed past the term's deadline",
    ) or old.transitions[1].reason.startswith(f"{other} took over")
