"""``ServicePool`` under ``limits.max_in_flight_per_replica``: picks never beyond the cap,
a bounded FIFO queue of waiters that freed slots go to, oldest first; and ``hash`` picks."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest

from gateway.errors import NoRoutableUpstream
from gateway.pool.service_pool import Lease
from gateway.pool.upstream import Health

from .test_pool import make_pool


def capped(*ids: str, cap: int = 2, max_queue: int = 10):
    return make_pool(*ids, limits={"max_in_flight_per_replica": cap, "max_queue": max_queue})


async def test_picks_stop_at_the_cap() -> None:
    sp = capped("a", "b", cap=2).service("svc")
    leases = [sp.lease() for _ in range(4)]
    assert all(lease is not None for lease in leases)
    assert sp.inflight == {"a": 2, "b": 2}
    assert sp.lease() is None
    assert sp.pick() is None


async def test_freed_slots_go_to_the_oldest_waiter_first() -> None:
    sp = capped("a", cap=1).service("svc")
    first = sp.lease()
    assert first is not None
    order: list[int] = []

    async def wait(n: int) -> Lease:
        lease = await sp.wait_slot(5.0)
        order.append(n)
        return lease

    waiters = [asyncio.ensure_future(wait(n)) for n in range(3)]
    await asyncio.sleep(0)
    assert sp.queued == 3
    assert sp.lease() is None  # a newcomer does not jump the queue
    first.release()
    second = await waiters[0]
    assert (order, sp.inflight, sp.queued) == ([0], {"a": 1}, 2)
    second.release()
    (await waiters[1]).release()
    (await waiters[2]).release()
    assert order == [0, 1, 2]
    assert sp.inflight == {}
    assert sp.counters["queued"] == 3


async def test_the_queue_is_bounded_and_its_wait_too() -> None:
    sp = capped("a", cap=1, max_queue=1).service("svc")
    held = sp.lease()
    assert held is not None
    waiter = asyncio.ensure_future(sp.wait_slot(0.05))
    await asyncio.sleep(0)
    with pytest.raises(NoRoutableUpstream, match="1 wait already") as full:
        await sp.wait_slot(5.0)
    assert full.value.retry_after == 1
    with pytest.raises(NoRoutableUpstream, match=r"no slot free within 0\.05 s"):
        await waiter
    assert sp.queued == 0
    assert (sp.counters["queue_timeout"], sp.counters["queue_full"]) == (1, 1)
    assert sp.counters["queue_wait_seconds"] >= 0.05


async def test_a_waiter_that_leaves_takes_no_slot_with_it() -> None:
    sp = capped("a", cap=1).service("svc")
    held = sp.lease()
    assert held is not None
    waiter = asyncio.ensure_future(sp.wait_slot(5.0))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    held.release()
    assert sp.inflight == {}
    assert sp.queued == 0


async def test_a_new_routable_upstream_takes_waiters() -> None:
    pool = capped("a", "b", cap=1)
    sp = pool.service("svc")
    pool.set_health("svc", "b", Health.UNHEALTHY)
    held = sp.lease()
    assert held is not None
    waiter = asyncio.ensure_future(sp.wait_slot(5.0))
    await asyncio.sleep(0)
    pool.set_health("svc", "b", Health.HEALTHY)
    lease = await waiter
    assert lease.upstream.id == "b"


def test_hash_keeps_a_key_on_one_upstream_and_moves_only_the_leavers() -> None:
    ids = [f"u{i}" for i in range(10)]
    pool = make_pool(*ids, load_balancing="hash", affinity="header:x-user")
    sp = pool.service("svc")
    keys = [f"user-{i}".encode() for i in range(2000)]
    before = {}
    for key in keys:
        picks = {sp.pick(key=key).id for _ in range(3)}  # type: ignore[union-attr]
        assert len(picks) == 1
        before[key] = picks.pop()
    assert max(Counter(before.values()).values()) < 1.5 * len(keys) / 10
    pool.set_health("svc", "u3", Health.UNHEALTHY)
    for key in keys:
        now = sp.pick(key=key).id  # type: ignore[union-attr]
        assert (now == before[key]) == (before[key] != "u3")
    # Without a key: least outstanding.
    assert sp.pick() is not None


def test_hash_under_a_cap_walks_on_to_the_next_with_room() -> None:
    pool = make_pool("a", "b", "c", load_balancing="hash", affinity="ip",
                     limits={"max_in_flight_per_replica": 1})  # fmt: skip
    sp = pool.service("svc")
    owner = sp.pick(key=b"k")
    assert owner is not None
    sp.lease_of(owner)
    other = sp.pick(key=b"k")
    assert other is not None
    assert other.id != owner.id
    assert sp.pick(frozenset({other.id}), key=b"k") not in (owner, other)


def test_per_process_share_of_the_cap() -> None:
    pool = make_pool()
    pool.share = 2
    routing = pool.service("svc").routing
    pool.set_service(replace(routing, limits=replace(routing.limits, max_in_flight_per_replica=5)))
    assert pool.service("svc").cap == 2


async def test_a_waiter_kept_off_some_upstreams_lets_the_next_take_their_slot() -> None:
    """A preview route's request may only use its revision's upstreams: it waits for one of
    those, and a slot freed elsewhere goes to the next waiter that may take it."""
    sp = capped("a", "b", cap=1).service("svc")
    on_a, on_b = sp.lease_of(sp.snapshot.routable[0]), sp.lease_of(sp.snapshot.routable[1])
    only_a = asyncio.ensure_future(sp.wait_slot(5.0, exclude=frozenset({"b"})))
    anyone = asyncio.ensure_future(sp.wait_slot(5.0))
    await asyncio.sleep(0)
    on_b.release()
    lease = await anyone
    assert lease.upstream.id == "b"
    assert not only_a.done()
    on_a.release()
    assert (await only_a).upstream.id == "a"
