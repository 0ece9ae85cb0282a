"""``ServicePool.queue``: requests held while nothing is routable, bounded in number and time,
answered at once with the controller's failure; the counts the autoscaler samples."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import NoRoutableUpstream
from gateway.pool.pool import Pool
from gateway.pool.upstream import Health, Upstream

from .test_pool import make_pool, routing


async def test_a_held_request_goes_on_once_an_upstream_is_routable() -> None:
    pool = make_pool()
    heard: list[str] = []
    pool.on_waiting = heard.append
    sp = pool.service("svc")
    held = asyncio.ensure_future(sp.queue(5.0))
    await asyncio.sleep(0)
    assert (sp.held, sp.waited, heard) == (1, 1, ["svc"])
    pool.add_upstream(Upstream("a", "svc", "127.0.0.1", 9000))
    await asyncio.sleep(0)
    assert not held.done()  # not routable until probed
    pool.set_health("svc", "a", Health.HEALTHY)
    await held
    assert sp.held == 0


async def test_the_queue_is_bounded_and_the_excess_refused_at_once() -> None:
    pool = make_pool()
    pool.max_held = 2
    sp = pool.service("svc")
    held = [asyncio.ensure_future(sp.queue(5.0)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(NoRoutableUpstream, match="2 requests held already") as refused:
        await sp.queue(5.0)
    assert refused.value.retry_after == 1
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert sp.held == 0


async def test_a_failure_answers_the_held_requests_with_its_reason_at_once() -> None:
    pool = make_pool()
    sp = pool.service("svc")
    held = asyncio.ensure_future(sp.queue(30.0))
    await asyncio.sleep(0)
    pool.set_failure("svc", "0 of 1 replicas ready: no capacity: 1 of 1 slots in use")
    with pytest.raises(NoRoutableUpstream, match="no capacity: 1 of 1 slots") as answered:
        await held
    assert str(answered.value.details["reason"]).startswith("0 of 1 replicas ready")
    # While it stands, a new request is not held.
    with pytest.raises(NoRoutableUpstream, match="no capacity"):
        await sp.queue(30.0)
    pool.set_failure("svc", "")
    assert sp.snapshot.failure == ""


async def test_the_time_is_bounded() -> None:
    sp = make_pool().service("svc")
    with pytest.raises(NoRoutableUpstream, match=r"held 0\.01 s"):
        await sp.queue(0.01)


async def test_peer_reports_add_to_the_totals_and_wake_on_held() -> None:
    pool = Pool()
    heard: list[str] = []
    pool.on_waiting = heard.append
    pool.set_service(routing())
    pool.peer_joined(7)
    pool.peer_report(7, {}, {"svc": 2}, {"svc": (5, 2)})
    pool.peer_report(7, {}, {"svc": 3}, {"svc": (1, 0)})
    sp = pool.service("svc")
    assert sp.totals() == (6, 2)
    assert sp.held_all() == 3
    assert heard == ["svc"]  # once: it held some already
    pool.peer_left(7)
    assert sp.held_all() == 0
