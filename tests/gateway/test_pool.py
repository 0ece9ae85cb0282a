"""The pool: admission, picks, leases, drains, passive ejection and events.

Ejection times run on a fake clock passed as ``clock=``; nothing here sleeps. Drain timeouts
use the event loop's timer with a zero timeout, so they fire on the next loop iteration.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import OutlierConfig, RouteConfig, ServiceRouting, parse_settings
from gateway.pool.events import PoolEvent
from gateway.pool.pool import Pool
from gateway.pool.service_pool import Lease
from gateway.pool.snapshot import PoolSnapshot
from gateway.pool.upstream import AdminState, Health, Upstream
from tests.support.clock import FakeClock


class Recorder:
    """Records every event with what the pool showed for its upstream at that moment."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.events: list[PoolEvent] = []
        self.seen: list[Upstream | None] = []
        self._waiters: list[tuple[str, asyncio.Future[PoolEvent]]] = []
        pool.subscribe(self)

    def on_pool_event(self, event: PoolEvent) -> None:
        self.events.append(event)
        if event.upstream is None:
            self.seen.append(None)
        else:
            self.seen.append(self.pool.upstream(event.service, event.upstream.id))
        for kind, waiter in self._waiters:
            if kind == event.kind and not waiter.done():
                waiter.set_result(event)

    async def wait(self, kind: str) -> PoolEvent:
        """The first event of ``kind`` recorded so far, or the next one (within 5 s)."""
        for event in self.events:
            if event.kind == kind:
                return event
        waiter: asyncio.Future[PoolEvent] = asyncio.get_running_loop().create_future()
        self._waiters.append((kind, waiter))
        return await asyncio.wait_for(waiter, 5)

    def kinds(self) -> list[tuple[str, str | None]]:
        return [(e.kind, e.upstream.id if e.upstream else None) for e in self.events]


def routing(name: str = "svc", **changes: Any) -> ServiceRouting:
    return parse_settings(
        ServiceRouting, {"name": name, "route": RouteConfig(path_prefix=f"/{name}"), **changes}
    )


def make_pool(
    *ids: str, healthy: bool = True, clock: FakeClock | None = None, **changes: Any
) -> Pool:
    pool = Pool(clock=clock or FakeClock(100.0), rng=random.Random(0))
    pool.set_service(routing(**changes))
    for i, uid in enumerate(ids):
        pool.add_upstream(Upstream(uid, "svc", "127.0.0.1", 9000 + i))
        if healthy:
            pool.set_health("svc", uid, Health.HEALTHY)
    return pool


def ids(upstreams: tuple[Upstream, ...]) -> list[str]:
    return [u.id for u in upstreams]


# -- admission -----------------------------------------------------------------------------


def test_added_upstream_starts_unknown_and_unroutable():
    pool = make_pool()
    added = pool.add_upstream(
        Upstream("a", "svc", "127.0.0.1", 1, health=Health.HEALTHY, ejected=True)
    )
    assert added.health is Health.UNKNOWN
    assert not added.ejected
    assert not added.routable
    assert pool.service("svc").pick() is None
    assert pool.service("svc").snapshot.routable == ()


def test_set_health_makes_it_routable_and_back():
    pool = make_pool("a", healthy=False)
    pool.set_health("svc", "a", Health.HEALTHY, "probe passed")
    picked = pool.service("svc").pick()
    assert picked is not None
    assert picked.id == "a"
    pool.set_health("svc", "a", Health.UNHEALTHY)
    assert pool.service("svc").pick() is None


def test_adding_twice_is_refused():
    pool = make_pool("a")
    with pytest.raises(ValueError, match="already"):
        pool.add_upstream(Upstream("a", "svc", "127.0.0.1", 2))


def test_adding_to_an_unknown_service_is_refused():
    with pytest.raises(KeyError):
        make_pool().add_upstream(Upstream("a", "nope", "127.0.0.1", 2))


def test_changes_to_unknown_things_are_ignored():
    pool = make_pool("a")
    version = pool.service("svc").snapshot.version
    pool.set_health("svc", "zz", Health.HEALTHY)
    pool.set_health("nope", "a", Health.HEALTHY)
    pool.remove_upstream("svc", "zz")
    pool.remove_upstream("nope", "a")
    pool.probe_passed("nope", "a")
    pool.undrain("nope", "a")
    pool.remove_service("nope")
    assert pool.report("nope", "a", "5xx") is None
    assert pool.report("svc", "zz", "5xx") is None
    assert pool.upstream("nope", "a") is None
    assert pool.service("svc").snapshot.version == version


def test_snapshots_are_new_objects_with_growing_versions():
    pool = make_pool("a", healthy=False)
    before = pool.service("svc").snapshot
    pool.set_health("svc", "a", Health.HEALTHY)
    after = pool.service("svc").snapshot
    assert after is not before
    assert after.version == before.version + 1
    old = before.get("a")
    assert old is not None
    assert old.health is Health.UNKNOWN  # the old snapshot is untouched
    pool.set_health("svc", "a", Health.HEALTHY)  # no change: no new snapshot
    assert pool.service("svc").snapshot is after


def test_snapshot_counts():
    ups = [
        Upstream("a", "s", "h", 1, health=Health.HEALTHY),
        Upstream("b", "s", "h", 2, health=Health.HEALTHY, admin=AdminState.DRAINING),
        Upstream("c", "s", "h", 3, health=Health.UNHEALTHY, ejected=True),
        Upstream("d", "s", "h", 4),
    ]
    snapshot = PoolSnapshot.of("s", 1, ups)
    assert snapshot.counts() == {"healthy": 1, "draining": 1, "ejected": 1, "unknown": 1}
    assert ids(snapshot.routable) == ["a"]


# -- picks and leases ----------------------------------------------------------------------


async def test_pick_honours_exclude():
    pool = make_pool("a", "b")
    service = pool.service("svc")
    assert {service.pick(frozenset({"a"})).id for _ in range(5)} == {"b"}  # type: ignore[union-attr]
    assert service.pick(frozenset({"a", "b"})) is None
    assert service.lease(frozenset({"a", "b"})) is None


async def test_leases_count_in_flight():
    pool = make_pool("a", load_balancing="round_robin")
    service = pool.service("svc")
    first = service.lease()
    second = service.lease()
    assert first is not None
    assert second is not None
    assert service.inflight == {"a": 2}
    assert "inflight=2" in repr(service)
    first.release()
    first.release()  # released exactly once
    assert service.inflight == {"a": 1}
    with second:
        pass
    assert service.inflight == {}
    assert service.leases == {}
    assert repr(second) == "<Lease a released=True>"


async def test_least_outstanding_through_leases():
    pool = make_pool("a", "b", "c")
    service = pool.service("svc")
    held = [service.lease() for _ in range(6)]
    assert service.inflight == {"a": 2, "b": 2, "c": 2}
    held[0].release()  # type: ignore[union-attr]
    lease = service.lease()
    assert lease is not None
    assert lease.upstream.id == held[0].upstream.id  # type: ignore[union-attr]


async def test_wait_routable():
    pool = make_pool("a", healthy=False)
    service = pool.service("svc")
    assert await service.wait_routable(0) is False
    loop = asyncio.get_running_loop()
    loop.call_soon(pool.set_health, "svc", "a", Health.HEALTHY)
    assert await service.wait_routable(5) is True
    assert service._routable_waiters == []
    assert await service.wait_routable(0) is True


def test_unavailable_error_names_the_states():
    pool = make_pool("a", "b", healthy=False)
    pool.set_health("svc", "b", Health.UNHEALTHY)
    error = pool.service("svc").unavailable()
    assert error.status == 503
    assert "2 upstreams: 1 unhealthy, 1 unknown" in error.message
    assert error.details["states"] == {"unknown": 1, "unhealthy": 1}


# -- drain ---------------------------------------------------------------------------------


async def hold(pool: Pool) -> tuple[Lease, asyncio.Task[None]]:
    """A lease taken inside a task that then waits forever (like a streaming request)."""
    taken: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

    async def request() -> None:
        lease = pool.service("svc").lease()
        assert lease is not None
        taken.set_result(lease)
        try:
            await asyncio.Event().wait()
        finally:
            lease.release()

    task = asyncio.create_task(request())
    return await taken, task


async def test_drain_with_nothing_in_flight_resolves_at_once():
    pool = make_pool("a")
    recorder = Recorder(pool)
    done = pool.drain("svc", "a", timeout=30)
    assert done.done()
    assert done.result() is True
    assert pool.upstream("svc", "a").admin is AdminState.DRAINING  # type: ignore[union-attr]
    assert pool.service("svc").pick() is None
    drained = await recorder.wait("drained")
    assert drained.clean is True
    assert drained.upstream is not None
    assert drained.upstream.id == "a"


async def test_drain_resolves_when_the_last_lease_is_released():
    pool = make_pool("a")
    service = pool.service("svc")
    recorder = Recorder(pool)
    first, second = service.lease(), service.lease()
    done = pool.drain("svc", "a", timeout=30)
    assert pool.drain("svc", "a", timeout=30) is done  # twice: the same future
    assert service.pick() is None  # no new picks at once
    first.release()  # type: ignore[union-attr]
    assert not done.done()
    second.release()  # type: ignore[union-attr]
    assert done.done()
    assert await done is True
    await recorder.wait("drained")
    assert recorder.kinds() == [("changed", "a"), ("drained", "a")]
    assert recorder.events[0].reason == "draining"


async def test_drain_timeout_aborts_leases_and_resolves_false():
    pool = make_pool("a")
    recorder = Recorder(pool)
    lease, task = await hold(pool)
    aborted: list[Lease] = []
    other = pool.service("svc").lease()
    assert other is not None
    other.on_abort = lambda: aborted.append(other)  # a WebSocket would close with 1001

    done = pool.drain("svc", "a", timeout=0)
    assert await done is False
    assert aborted == [other]
    with pytest.raises(asyncio.CancelledError):
        await task  # the default abort cancels the task that took the lease
    assert lease._released
    drained = await recorder.wait("drained")
    assert drained.clean is False
    assert drained.reason == "drain timeout"
    other.release()
    assert pool.service("svc").inflight == {}


async def test_undrain_returns_to_active_and_cancels_the_drain():
    pool = make_pool("a")
    lease = pool.service("svc").lease()
    assert lease is not None
    done = pool.drain("svc", "a", timeout=30)
    pool.undrain("svc", "a")
    assert done.cancelled()
    upstream = pool.upstream("svc", "a")
    assert upstream is not None
    assert upstream.admin is AdminState.ACTIVE
    assert pool.service("svc").pick() == upstream
    lease.release()


async def test_redrain_after_undrain_keeps_its_own_timeout():
    """Regression: the first drain's callback cancelled the second drain's timer."""
    pool = make_pool("a")
    lease = pool.service("svc").lease()
    assert lease is not None
    lease.on_abort = lambda: None
    pool.drain("svc", "a", timeout=30)
    pool.undrain("svc", "a")
    again = pool.drain("svc", "a", timeout=0)
    assert await asyncio.wait_for(again, 5) is False
    lease.release()


async def test_drain_of_an_unknown_upstream_is_done():
    pool = make_pool("a")
    assert await pool.drain("svc", "zz", timeout=1) is True
    assert await pool.drain("nope", "a", timeout=1) is True


async def test_removing_a_draining_upstream_resolves_its_drain():
    """Regression: the drain future of a removed upstream never resolved."""
    pool = make_pool("a", "b")
    lease = pool.service("svc").lease(frozenset({"b"}))
    assert lease is not None
    busy = pool.drain("svc", "a", timeout=30)
    idle = pool.drain("svc", "b", timeout=30)
    pool.remove_upstream("svc", "a")
    assert await asyncio.wait_for(busy, 5) is False  # requests were still in flight
    assert await idle is True
    lease.release()


# -- passive ejection ----------------------------------------------------------------------

OUTLIER = OutlierConfig(
    consecutive_connect_failures=2, base_ejection_time=10, max_ejection_time=100
)


def eject(pool: Pool, uid: str) -> object:
    pool.report("svc", uid, "connect_failure")
    return pool.report("svc", uid, "connect_failure")


def test_report_ejects_and_a_probe_lifts_only_after_the_ejection_time():
    clock = FakeClock(100.0)
    pool = make_pool("a", "b", clock=clock, outlier=OUTLIER)
    recorder = Recorder(pool)
    assert pool.report("svc", "a", "connect_failure") is None
    ejection = pool.report("svc", "a", "connect_failure")
    assert ejection is not None
    assert ejection.until == 110.0
    assert pool.upstream("svc", "a").ejected  # type: ignore[union-attr]
    assert recorder.events[-1].reason == "ejected: 2 connect failures in a row"
    assert {pool.service("svc").pick().id for _ in range(4)} == {"b"}  # type: ignore[union-attr]

    clock.now = 109.9
    pool.probe_passed("svc", "a")
    assert pool.upstream("svc", "a").ejected  # type: ignore[union-attr]
    clock.now = 110.0
    pool.probe_passed("svc", "a")
    assert not pool.upstream("svc", "a").ejected  # type: ignore[union-attr]
    assert recorder.events[-1].reason == "ejection lifted by a passing probe"

    # the second ejection lasts twice as long
    second = eject(pool, "a")
    assert second is not None
    assert second.until == 130.0  # type: ignore[attr-defined]


def test_ok_resets_the_streak():
    pool = make_pool("a", "b", outlier=OUTLIER)
    pool.report("svc", "a", "connect_failure")
    pool.report("svc", "a", "ok")
    assert pool.report("svc", "a", "connect_failure") is None
    assert not pool.upstream("svc", "a").ejected  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("n", "percent", "ejectable"),
    [(4, 50, 2), (4, 25, 1), (5, 40, 2), (1, 50, 1), (2, 50, 1), (3, 100, 3), (4, 0, 0)],
)
def test_max_ejection_percent_is_respected(n, percent, ejectable):
    outlier = replace(OUTLIER, max_ejection_percent=percent)
    uids = [f"u{i}" for i in range(n)]
    pool = make_pool(*uids, outlier=outlier)
    results = [eject(pool, uid) for uid in uids]
    assert sum(r is not None for r in results) == ejectable
    snapshot = pool.service("svc").snapshot
    assert sum(u.ejected for u in snapshot.upstreams) == ejectable
    assert len(snapshot.routable) == n - ejectable


def test_outlier_config_change_applies_to_existing_upstreams():
    """Regression: an upstream kept the outlier settings of when it was added."""
    pool = make_pool("a", "b", outlier=OUTLIER)
    pool.set_service(routing(outlier=replace(OUTLIER, consecutive_5xx=1)))
    assert pool.report("svc", "a", "5xx") is not None


# -- events --------------------------------------------------------------------------------


def test_events_in_order_with_the_new_snapshot_in_place():
    clock = FakeClock(5.0)
    pool = Pool(clock=clock)
    recorder = Recorder(pool)
    pool.set_service(routing(outlier=OUTLIER))
    pool.add_upstream(Upstream("a", "svc", "127.0.0.1", 1))
    clock.now = 6.0
    pool.set_health("svc", "a", Health.HEALTHY, "probe passed")
    eject(pool, "a")
    pool.remove_upstream("svc", "a", "stopping")

    assert recorder.kinds() == [
        ("service_set", None),
        ("added", "a"),
        ("changed", "a"),
        ("changed", "a"),
        ("removed", "a"),
    ]
    assert [e.at for e in recorder.events] == [5.0, 5.0, 6.0, 6.0, 6.0]
    for event, seen in zip(recorder.events, recorder.seen, strict=True):
        if event.kind in ("added", "changed"):
            assert seen == event.upstream  # the pool already shows what the event says
        elif event.kind == "removed":
            assert seen is None
    healthy = recorder.events[2]
    assert healthy.previous is not None
    assert healthy.previous.health is Health.UNKNOWN
    assert healthy.upstream is not None
    assert healthy.upstream.health is Health.HEALTHY
    assert healthy.reason == "probe passed"
    assert recorder.events[4].reason == "stopping"


def test_remove_service_emits_removed_for_each_upstream():
    pool = make_pool("a", "b", "c")
    recorder = Recorder(pool)
    pool.remove_service("svc")
    assert recorder.kinds() == [
        ("removed", "a"),
        ("removed", "b"),
        ("removed", "c"),
        ("service_removed", None),
    ]
    assert all(e.reason == "service removed" for e in recorder.events[:3])
    assert pool.services == {}
    assert pool.routes.routes == ()


def test_set_service_rebuilds_routes_and_keeps_upstreams():
    pool = make_pool("a")
    pool.set_service(routing("other"))
    assert sorted(r.service for r in pool.routes.routes) == ["other", "svc"]
    changed = routing(load_balancing="round_robin")
    same = pool.set_service(changed)
    assert same is pool.service("svc")
    assert same.routing is changed
    assert ids(same.snapshot.upstreams) == ["a"]


def test_a_failing_subscriber_does_not_stop_the_others():
    pool = make_pool()

    class Broken:
        def on_pool_event(self, event: PoolEvent) -> None:
            raise RuntimeError("subscriber bug")

    pool.subscribe(Broken())
    recorder = Recorder(pool)
    pool.add_upstream(Upstream("a", "svc", "127.0.0.1", 1))
    assert recorder.kinds() == [("added", "a")]


def test_unsubscribe():
    pool = make_pool()
    recorder = Recorder(pool)
    pool.unsubscribe(recorder)
    pool.unsubscribe(recorder)
    pool.add_upstream(Upstream("a", "svc", "127.0.0.1", 1))
    assert recorder.events == []


def test_repr():
    pool = make_pool("a", "b", healthy=False)
    pool.set_health("svc", "a", Health.HEALTHY)
    Recorder(pool)
    assert repr(pool) == "<Pool services=1 subscribers=1>"
    assert repr(pool.service("svc")) == "<ServicePool svc v3 upstreams=2 routable=1 inflight=0>"


# -- generated sequences -------------------------------------------------------------------

UIDS = ["a", "b", "c", "d"]

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(UIDS)),
        st.tuples(st.just("remove"), st.sampled_from(UIDS)),
        st.tuples(st.just("health"), st.sampled_from(UIDS), st.sampled_from(list(Health))),
        st.tuples(
            st.just("report"),
            st.sampled_from(UIDS),
            st.sampled_from(["ok", "5xx", "connect_failure"]),
        ),
        st.tuples(st.just("probe"), st.sampled_from(UIDS)),
        st.tuples(st.just("tick"), st.floats(min_value=0, max_value=30)),
        st.tuples(st.just("drain"), st.sampled_from(UIDS)),
        st.tuples(st.just("undrain"), st.sampled_from(UIDS)),
        st.tuples(st.just("lease"), st.frozensets(st.sampled_from(UIDS), max_size=2)),
        st.tuples(st.just("release"), st.integers(min_value=0, max_value=10)),
        st.tuples(st.just("policy"), st.sampled_from(["round_robin", "least_outstanding", "p2c"])),
    ),
    max_size=60,
)


async def run_sequence(ops: list[tuple[object, ...]]) -> None:
    clock = FakeClock(0.0)
    pool = Pool(clock=clock, rng=random.Random(0))
    pool.set_service(
        routing(outlier=OutlierConfig(consecutive_connect_failures=2, consecutive_5xx=2))
    )
    leases: list[Lease] = []
    drains: list[asyncio.Future[bool]] = []
    for op in ops:
        kind = op[0]
        if kind == "add":
            if pool.upstream("svc", op[1]) is None:  # type: ignore[arg-type]
                pool.add_upstream(Upstream(op[1], "svc", "127.0.0.1", 1))  # type: ignore[arg-type]
        elif kind == "remove":
            pool.remove_upstream("svc", op[1])  # type: ignore[arg-type]
        elif kind == "health":
            pool.set_health("svc", op[1], op[2])  # type: ignore[arg-type]
        elif kind == "report":
            pool.report("svc", op[1], op[2])  # type: ignore[arg-type]
        elif kind == "probe":
            pool.probe_passed("svc", op[1])  # type: ignore[arg-type]
        elif kind == "tick":
            clock.now += op[1]  # type: ignore[operator]
        elif kind == "drain":
            drains.append(pool.drain("svc", op[1], timeout=3600))  # type: ignore[arg-type]
        elif kind == "undrain":
            pool.undrain("svc", op[1])  # type: ignore[arg-type]
        elif kind == "lease":
            lease = pool.service("svc").lease(op[1])  # type: ignore[arg-type]
            if lease is not None:
                assert lease.upstream.routable
                assert lease.upstream.id not in op[1]  # type: ignore[operator]
                leases.append(lease)
        elif kind == "release" and leases:
            leases.pop(op[1] % len(leases)).release()  # type: ignore[operator]
        elif kind == "policy":
            pool.set_service(routing(load_balancing=op[1]))

        service = pool.service("svc")
        snapshot = service.snapshot
        assert snapshot.routable == tuple(u for u in snapshot.upstreams if u.routable)
        for _ in range(3):
            picked = service.pick()
            if picked is None:
                assert not snapshot.routable
            else:
                assert picked.routable
                assert picked in snapshot.upstreams
        live: dict[str, int] = {}
        for lease in leases:
            live[lease.upstream.id] = live.get(lease.upstream.id, 0) + 1
        assert service.inflight == live
        for upstream in snapshot.upstreams:
            pending = service._drains.get(upstream.id)
            if pending is not None and not pending.done.done():
                assert upstream.admin is AdminState.DRAINING
                assert live.get(upstream.id, 0) > 0  # a pending drain waits on something
    for lease in leases:
        lease.release()
    for done in drains:
        if not done.cancelled():
            assert done.done()  # nothing left in flight: every drain is resolved


@settings(max_examples=200, deadline=None)
@given(operations)
def test_pick_never_returns_an_unroutable_upstream(ops):
    asyncio.run(run_sequence(ops))
