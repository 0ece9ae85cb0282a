"""The pool with worker processes: mirrors that install snapshots, peers that hold leases.

The deciding pool (the controller's) and a mirror (a worker's) are both plain ``Pool``s here,
joined by hand as ``gateway.workers.supervisor`` and ``gateway.workers.worker`` join them
over a socketpair.
Drain timeouts use a zero timeout so that they fire on the next loop iteration; nothing sleeps.
"""

from __future__ import annotations

import random

from gateway.pool import router
from gateway.pool.pool import Pool
from gateway.pool.upstream import AdminState, Health, Upstream
from tests.support.clock import FakeClock

from .test_pool import Recorder, make_pool, routing

PEER = 4242


def mirror_of(pool: Pool, proposals: list[tuple[str, str, str]] | None = None) -> Pool:
    mirror = Pool(
        clock=FakeClock(100.0),
        rng=random.Random(0),
        propose_ejection=(lambda *p: proposals.append(p)) if proposals is not None else None,
    )
    sync(pool, mirror)
    return mirror


def sync(pool: Pool, mirror: Pool) -> None:
    for sp in pool.services.values():
        mirror.install(sp.routing, sp.snapshot)


# -- versions and mirrors -------------------------------------------------------------------


def test_versions_grow_across_services_and_a_service_set_again():
    pool = make_pool("a")
    first = pool.service("svc").snapshot.version
    pool.remove_service("svc")
    pool.set_service(routing())
    pool.add_upstream(Upstream("a", "svc", "127.0.0.1", 9000))
    assert pool.service("svc").snapshot.version > first


def test_a_mirror_serves_what_it_installed_and_hears_the_changes():
    pool = make_pool("a", "b")
    mirror = Pool(clock=FakeClock(100.0), rng=random.Random(0))
    recorder = Recorder(mirror)
    sync(pool, mirror)
    assert mirror.service("svc").snapshot == pool.service("svc").snapshot
    assert {u.id for u in mirror.service("svc").snapshot.routable} == {"a", "b"}

    pool.set_health("svc", "a", Health.UNHEALTHY)
    pool.remove_upstream("svc", "b")
    pool.add_upstream(Upstream("c", "svc", "127.0.0.1", 9009))
    sync(pool, mirror)
    assert mirror.service("svc").snapshot.version == pool.service("svc").snapshot.version
    assert mirror.service("svc").pick() is None  # a is unhealthy, c not yet probed
    assert recorder.kinds()[-3:] == [("changed", "a"), ("added", "c"), ("removed", "b")]
    route = router.resolve(mirror.routes, "any.example", "/svc/x")
    assert route is not None
    assert route.service == "svc"


async def test_a_mirror_keeps_its_leases_and_streaks_over_an_install():
    pool = make_pool("a", outlier={"consecutive_5xx": 2})
    proposals: list[tuple[str, str, str]] = []
    mirror = mirror_of(pool, proposals)
    lease = mirror.service("svc").lease()
    assert lease is not None
    assert mirror.report("svc", "a", "5xx") is None
    pool.set_health("svc", "a", Health.HEALTHY, "again")  # no change, a new install anyway
    sync(pool, mirror)
    assert mirror.service("svc").inflight == {"a": 1}
    mirror.report("svc", "a", "5xx")  # the second of the streak: proposed, not taken here
    assert proposals == [("svc", "a", "2 5xx responses in a row")]
    assert not mirror.upstream("svc", "a").ejected  # type: ignore[union-attr]
    lease.release()


def test_a_proposed_ejection_is_taken_once_and_refused_past_the_limit():
    pool = make_pool("a", "b", outlier={"max_ejection_percent": 50})
    assert pool.eject("svc", "a", "5 connect failures in a row") is not None
    assert pool.upstream("svc", "a").ejected  # type: ignore[union-attr]
    assert pool.eject("svc", "a", "again, from the other worker") is None
    assert pool.eject("svc", "b", "would leave nothing") is None  # 2 of 2 > 50 %
    assert not pool.upstream("svc", "b").ejected  # type: ignore[union-attr]
    assert pool.eject("nope", "a", "unknown service") is None


# -- drains wait for peers ------------------------------------------------------------------


async def test_a_drain_waits_for_every_peer_that_was_there():
    pool = make_pool("a")
    pool.peer_joined(PEER)
    pool.peer_joined(PEER + 1)
    done = pool.drain("svc", "a", timeout=30)
    version = pool.service("svc").snapshot.version
    assert not done.done()  # nothing in flight here, but the peers may have
    pool.peer_idle(PEER, "svc", "a", version)
    assert not done.done()
    pool.peer_joined(PEER + 2)  # came after the drain began: nothing of it to wait for
    pool.peer_idle(PEER + 1, "svc", "a", version + 3)
    assert await done is True


async def test_an_idle_report_about_an_earlier_drain_does_not_count():
    pool = make_pool("a")
    pool.peer_joined(PEER)
    first = pool.drain("svc", "a", timeout=30)
    stale = pool.service("svc").snapshot.version
    pool.undrain("svc", "a")
    assert first.cancelled()
    second = pool.drain("svc", "a", timeout=30)
    pool.peer_idle(PEER, "svc", "a", stale)  # the peer answered the first drain
    assert not second.done()
    pool.peer_idle(PEER, "svc", "a", pool.service("svc").snapshot.version)
    assert await second is True


async def test_a_peer_that_goes_away_no_longer_holds_a_drain():
    pool = make_pool("a")
    pool.peer_joined(PEER)
    pool.peer_report(PEER, {("svc", "a"): 3})
    assert pool.service("svc").inflight_all() == {"a": 3}
    done = pool.drain("svc", "a", timeout=30)
    pool.peer_left(PEER)  # its leases died with it
    assert await done is True
    assert pool.service("svc").inflight_all() == {}


async def test_a_drain_waits_for_local_leases_and_peers_alike():
    pool = make_pool("a")
    pool.peer_joined(PEER)
    lease = pool.service("svc").lease()
    assert lease is not None
    done = pool.drain("svc", "a", timeout=30)
    pool.peer_idle(PEER, "svc", "a", pool.service("svc").snapshot.version)
    assert not done.done()
    lease.release()
    assert await done is True


async def test_a_drain_timeout_is_unclean_while_a_peer_holds_on():
    pool = make_pool("a")
    recorder = Recorder(pool)
    pool.peer_joined(PEER)
    done = pool.drain("svc", "a", timeout=0)
    assert await done is False
    drained = await recorder.wait("drained")
    assert drained.clean is False  # the supervisor sends Abort to the workers on this


async def test_a_mirror_says_when_a_draining_upstream_is_idle_there():
    pool = make_pool("a")
    mirror = mirror_of(pool)
    lease = mirror.service("svc").lease()
    assert lease is not None
    pool.drain("svc", "a", timeout=30)
    sync(pool, mirror)
    sp = mirror.service("svc")
    assert sp.snapshot.get("a").admin is AdminState.DRAINING  # type: ignore[union-attr]
    assert sp.pick() is None
    idle: list[int] = []
    sp.when_idle("a", lambda: idle.append(sp.snapshot.version))
    assert idle == []
    lease.release()
    assert idle == [pool.service("svc").snapshot.version]
    sp.when_idle("a", lambda: idle.append(0))  # nothing in flight: at once
    assert idle[-1] == 0
