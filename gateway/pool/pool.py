"""The pools of all services: immutable snapshots, picks, in-flight leases and drains.

Each service's upstreams are published as a frozen ``PoolSnapshot``; every change builds a
new one and swaps a single reference, so readers need no lock and a snapshot could be sent to
another process as it is. In-flight counts live beside the snapshot (they change on every
request) and are what ``least_outstanding`` and ``p2c`` read and what a drain waits on.

Invariants:
- ``pick`` only ever returns a routable upstream (healthy, active, not ejected).
- A drain stops new picks at once; it completes when the upstream's leases are all released
  or when its timeout passes, at which point the remaining leases are aborted.
- Every change is published to subscribers as a ``PoolEvent``, after the new snapshot is in
  place, so a subscriber that reads the pool sees the state the event describes.
- Snapshot versions come from one counter per ``Pool``, so they only ever grow, across
  services and a service removed and set again alike.

With several worker processes (``gateway.workers.supervisor``) the controller's pool is the one that
decides, and each worker serves from a mirror of it (``install``). The leases are then in the
workers: they are the pool's *peers*. A drain completes only when every peer said that it holds
no lease of the upstream any more (``peer_idle``) or went away (``peer_left``); a worker's
passive detection proposes ejections (``eject``) that the deciding pool takes or refuses.

The snapshot is ``snapshot.py``'s, a service's pool (picks, leases, queues) ``service_pool.py``'s;
this module is the set of them, their changes and events, drains and peers.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from ..config import ServiceRouting
from .events import EventKind, PoolEvent, PoolSubscriber
from .models import ModelTable
from .outlier import Ejection, OutlierState, may_eject
from .router import Route, RouteTable
from .service_pool import Drain, ServicePool
from .snapshot import PoolSnapshot
from .upstream import AdminState, Health, Upstream

log = logging.getLogger(__name__)

MAX_HELD = 1000
"""Requests one service holds at most per process while nothing is routable; beyond, 503."""

RequestCounts = tuple[
    tuple[float, ...], dict[int, tuple[int, int, tuple[int, ...], tuple[int, ...]]]
]
"""The latency buckets' bounds, and per revision: (requests answered, of them 5xx, requests
per latency bucket, +Inf last, requests on a model path per time-to-first-token bucket, empty
if none). Running totals."""


class Pool:
    """All services' pools, the route table over them, and the subscribers to their events.

    ``clock`` is the monotonic clock (the event loop's ``time``) used for ejection times and
    event stamps; ``rng`` feeds the randomised policies. Both are injected for tests.
    """

    def __init__(
        self,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
        propose_ejection: Callable[[str, str, str], object] | None = None,
    ) -> None:
        self.clock = clock or self._loop_time
        self._loop: asyncio.AbstractEventLoop | None = None
        self.rng = rng or random.Random()
        self.services: dict[str, ServicePool] = {}
        self.routes = RouteTable()
        self.models = ModelTable()
        """The services by the model each serves (``models`` in the gateway config)."""
        self._subscribers: list[PoolSubscriber] = []
        self._version = 0
        self.propose_ejection = propose_ejection
        """A mirror's: where passive detection sends ejections (service, upstream, reason),
        for the deciding pool to take or refuse, instead of ejecting here."""
        self.peers: set[int] = set()
        self.peer_inflight: dict[int, dict[tuple[str, str], int]] = {}
        """Each peer's last reported in-flight counts, (service, upstream) -> count."""
        self.peer_held: dict[int, dict[str, int]] = {}
        """Each peer's last reported held requests, service -> count."""
        self.max_held = MAX_HELD
        """Requests a service holds at most in this process (``ServicePool.queue``)."""
        self.share = 1
        """Processes that serve this pool's services (each worker its share of rate limits
        and of ``max_in_flight_per_replica``): set by a worker before it installs any."""
        self.on_waiting: Callable[[str], object] | None = None
        """Called with a service's name when it begins holding requests (the first held
        here, or a peer's report of some where it had none): the autoscaler's cue."""
        self.request_counts: Callable[[str], RequestCounts] | None = None
        """A service's requests so far per revision, every process's, where they are
        counted (``GatewayMetrics.attach`` sets it): what a canary's analysis reads."""

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, looked up once (each lookup costs a ``getpid`` on 3.11)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _loop_time(self) -> float:
        return self.loop.time()

    def subscribe(self, subscriber: PoolSubscriber) -> None:
        self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: PoolSubscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def _emit(
        self,
        kind: EventKind,
        service: str,
        upstream: Upstream | None = None,
        previous: Upstream | None = None,
        reason: str = "",
        clean: bool = True,
    ) -> None:
        event = PoolEvent(kind, service, self.clock(), upstream, previous, reason, clean)
        for subscriber in list(self._subscribers):
            try:
                subscriber.on_pool_event(event)
            except Exception:
                log.exception("pool subscriber %r failed on %s", subscriber, kind)

    # -- services -----------------------------------------------------------------------------

    def set_service(self, routing: ServiceRouting) -> ServicePool:
        """Add a service or change its routing config; its upstreams stay as they are."""
        pool = self.services.get(routing.name)
        if pool is None:
            pool = self.services[routing.name] = ServicePool(self, routing)
        else:
            pool.routing = routing
            pool.configure()
            for outlier in pool.outliers.values():
                outlier.config = routing.outlier
        self._rebuild_routes()
        self._emit("service_set", routing.name)
        return pool

    def remove_service(self, name: str) -> None:
        """Forget a service and its upstreams at once (drain them first to be gentle)."""
        pool = self.services.pop(name, None)
        if pool is None:
            return
        for upstream in pool.snapshot.upstreams:
            self._emit("removed", name, upstream, upstream, "service removed")
        self._rebuild_routes()
        self._emit("service_removed", name)

    def _rebuild_routes(self) -> None:
        self.routes = RouteTable.build(
            Route(name, pool.routing.route) for name, pool in self.services.items()
        )
        self.models = ModelTable.build(
            (name, pool.routing.model)
            for name, pool in self.services.items()
            if pool.routing.model is not None
        )

    def service(self, name: str) -> ServicePool:
        return self.services[name]

    def upstream(self, service: str, upstream_id: str) -> Upstream | None:
        pool = self.services.get(service)
        return pool.snapshot.get(upstream_id) if pool else None

    # -- upstreams ----------------------------------------------------------------------------

    def add_upstream(self, upstream: Upstream) -> Upstream:
        """Add an upstream; it starts with health unknown and gets no traffic until probed."""
        pool = self.services[upstream.service]
        if pool.snapshot.get(upstream.id) is not None:
            raise ValueError(f"upstream {upstream.id!r} already in service {upstream.service!r}")
        upstream = upstream.replace(health=Health.UNKNOWN, ejected=False)
        pool.outliers[upstream.id] = OutlierState(pool.routing.outlier)
        pool._publish((*pool.snapshot.upstreams, upstream))
        self._emit("added", upstream.service, upstream, None, "added")
        return upstream

    def remove_upstream(self, service: str, upstream_id: str, reason: str = "removed") -> None:
        """Take an upstream out of the pool now. In-flight leases run on; drain first."""
        pool = self.services.get(service)
        if pool is None:
            return
        old = pool.snapshot.get(upstream_id)
        if old is None:
            return
        pool._publish(u for u in pool.snapshot.upstreams if u.id != upstream_id)
        pool.outliers.pop(upstream_id, None)
        drain = pool._drains.pop(upstream_id, None)
        if drain is not None:
            if drain.timer is not None:
                drain.timer.cancel()
            if not drain.done.done():
                # Nothing would resolve it any more: clean only if nothing was in flight.
                drain.done.set_result(not pool.inflight.get(upstream_id) and not drain.waiting)
        self._emit("removed", service, old, old, reason)

    def set_health(self, service: str, upstream_id: str, health: Health, reason: str = "") -> None:
        pool = self.services.get(service)
        if pool is not None:
            pool._update(upstream_id, reason or f"health {health.value}", health=health)

    def set_failure(self, service: str, failure: str) -> None:
        """Say why the service has nothing to route to ("" once it may again): held requests
        are answered 503 with it at once, and new ones are while nothing is routable."""
        pool = self.services.get(service)
        if pool is None or pool.snapshot.failure == failure:
            return
        pool._publish(pool.snapshot.upstreams, failure=failure)
        self._emit("service_set", service, reason=failure or "failure cleared")

    def set_split(self, service: str, split: tuple[int, int] | None) -> None:
        """Split the service's traffic: (revision, weight) sends ``weight`` percent of its
        requests to ``revision``'s routable upstreams and the rest to the others; None: by
        the policy alone (``Split``)."""
        pool = self.services.get(service)
        if pool is None or pool.snapshot.weights == split:
            return
        pool._publish(pool.snapshot.upstreams, split=split)
        reason = "split cleared" if split is None else f"revision {split[0]} at {split[1]}%"
        self._emit("service_set", service, reason=reason)

    def probe_passed(self, service: str, upstream_id: str) -> None:
        """An active probe passed: lift an ejection whose time is up."""
        pool = self.services.get(service)
        if pool is None:
            return
        outlier = pool.outliers.get(upstream_id)
        if outlier is not None and outlier.probe_passed(self.clock()):
            pool._update(upstream_id, "ejection lifted by a passing probe", ejected=False)

    def report(self, service: str, upstream_id: str, outcome: str) -> Ejection | None:
        """Passive detection: record a real request's outcome; eject on a failure streak."""
        pool = self.services.get(service)
        if pool is None:
            return None
        if outcome == "ok":
            self.succeeded(pool, upstream_id)
            return None
        outlier = pool.outliers.get(upstream_id)
        if outlier is None:
            return None
        ejection = outlier.record(outcome, self.clock())
        if ejection is None:
            return None
        if self.propose_ejection is not None:
            # A mirror: the deciding pool ejects (or refuses to) and publishes the result.
            self.propose_ejection(service, upstream_id, ejection.reason)
            return None
        return self._eject(pool, upstream_id, outlier, ejection)

    def succeeded(self, pool: ServicePool, upstream_id: str) -> None:
        """``report(..., "ok")`` for a request of ``pool``: it only ends a failure streak
        (looked at first: nearly every request is one, with no streak to end)."""
        outlier = pool.outliers.get(upstream_id)
        if outlier is not None and (outlier.connect_failures or outlier.errors_5xx):
            outlier.record("ok", 0.0)

    def eject(self, service: str, upstream_id: str, reason: str) -> Ejection | None:
        """A peer's passive detection proposes an ejection; take it unless it is refused.

        Refused when the upstream is already ejected (peers see the same failures) or when
        it would take more than ``max_ejection_percent`` of the pool. The duration is this
        pool's: it grows with this upstream's earlier ejections.
        """
        pool = self.services.get(service)
        outlier = pool.outliers.get(upstream_id) if pool is not None else None
        if pool is None or outlier is None or outlier.ejected_until is not None:
            return None
        return self._eject(pool, upstream_id, outlier, outlier.proposed(self.clock(), reason))

    def _eject(
        self, pool: ServicePool, upstream_id: str, outlier: OutlierState, ejection: Ejection
    ) -> Ejection | None:
        ejected = sum(1 for u in pool.snapshot.upstreams if u.ejected)
        if not may_eject(
            ejected, len(pool.snapshot.upstreams), pool.routing.outlier.max_ejection_percent
        ):
            return None
        outlier.eject(ejection)
        pool._update(upstream_id, f"ejected: {ejection.reason}", ejected=True)
        return ejection

    # -- mirrors and peers --------------------------------------------------------------------

    def install(self, routing: ServiceRouting, snapshot: PoolSnapshot) -> ServicePool:
        """A mirror takes the deciding pool's snapshot of a service as it is.

        Leases held here keep running; passive-detection streaks carry over for upstreams
        that stay. Subscribers hear ``service_set`` and the upstreams added, changed and
        removed, as they would from the deciding pool.
        """
        pool = self.services.get(routing.name)
        if pool is None or pool.routing != routing:
            pool = self.set_service(routing)
        old = {u.id: u for u in pool.snapshot.upstreams}
        new = {u.id: u for u in snapshot.upstreams}
        gone = old.keys() - new.keys()
        for uid in gone:
            pool.outliers.pop(uid, None)
        pool._publish(snapshot.upstreams, snapshot.version, snapshot.failure, snapshot.weights)
        for uid, upstream in new.items():
            previous = old.get(uid)
            if previous is None:
                pool.outliers[uid] = OutlierState(routing.outlier)
                self._emit("added", routing.name, upstream, None, "installed")
            elif previous != upstream:
                self._emit("changed", routing.name, upstream, previous, "installed")
        for uid in gone:
            self._emit("removed", routing.name, old[uid], old[uid], "installed")
        return pool

    def peer_joined(self, peer: int) -> None:
        """A process that takes leases of its own from a mirror of this pool (a worker)."""
        self.peers.add(peer)

    def peer_left(self, peer: int) -> None:
        """A peer is gone: its leases went with it, so no drain waits for it any more."""
        self.peers.discard(peer)
        self.peer_inflight.pop(peer, None)
        self.peer_held.pop(peer, None)
        for pool in list(self.services.values()):
            for uid, drain in list(pool._drains.items()):
                drain.waiting.discard(peer)
                pool._settle(uid)

    def peer_idle(self, peer: int, service: str, upstream_id: str, version: int) -> None:
        """A peer holds no lease of a draining upstream, as of its snapshot ``version``."""
        pool = self.services.get(service)
        drain = pool._drains.get(upstream_id) if pool is not None else None
        if pool is None or drain is None or version < drain.version:
            return  # no drain, or a report about an earlier one
        drain.waiting.discard(peer)
        pool._settle(upstream_id)

    def peer_report(
        self,
        peer: int,
        inflight: dict[tuple[str, str], int],
        held: dict[str, int] | None = None,
        counts: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """A peer's in-flight counts, for status and metrics (drains use ``peer_idle``); its
        held requests now and (completed, waited) since its last report, per service."""
        if peer not in self.peers:
            return
        self.peer_inflight[peer] = inflight
        if counts:
            for service, (completed, waited) in counts.items():
                sp = self.services.get(service)
                if sp is not None:
                    sp.peer_counts[0] += completed
                    sp.peer_counts[1] += waited
        if held is not None:
            before = self.peer_held.get(peer, {})
            self.peer_held[peer] = held
            if self.on_waiting is not None:
                for service, count in held.items():
                    if count and not before.get(service):
                        self.on_waiting(service)

    # -- drain --------------------------------------------------------------------------------

    def drain(self, service: str, upstream_id: str, timeout: float) -> asyncio.Future[bool]:
        """Stop new requests to an upstream; the future resolves when its leases are done.

        Resolves True when everything in flight finished, False when ``timeout`` cut the
        rest off (their ``abort`` was called). Draining an unknown upstream resolves True.
        Draining twice returns the same future.
        """
        loop = asyncio.get_running_loop()
        pool = self.services.get(service)
        if pool is None or pool.snapshot.get(upstream_id) is None:
            done = loop.create_future()
            done.set_result(True)
            return done
        existing = pool._drains.get(upstream_id)
        if existing is not None:
            return existing.done
        drain = Drain(loop.create_future(), 0, set(self.peers))
        pool._drains[upstream_id] = drain
        pool._update(upstream_id, "draining", admin=AdminState.DRAINING)
        drain.version = pool.snapshot.version
        pool._settle(upstream_id)
        if not drain.done.done():
            drain.timer = loop.call_later(timeout, self._drain_timeout, pool, upstream_id)
        drain.done.add_done_callback(lambda fut: self._drained(pool, upstream_id, fut))
        return drain.done

    def _drain_timeout(self, pool: ServicePool, upstream_id: str) -> None:
        drain = pool._drains.get(upstream_id)
        if drain is None or drain.done.done():
            return
        # Resolved first: a lease cut off at once (``Lease.abort``, or an exchange served
        # without a task) is released within ``abort``, and the drain must not read as clean
        # then.
        drain.done.set_result(False)
        pool.abort(upstream_id)

    def _drained(self, pool: ServicePool, upstream_id: str, fut: asyncio.Future[bool]) -> None:
        drain = pool._drains.get(upstream_id)
        # Only this drain's own timer: after undrain and a new drain the entry is another one.
        if drain is not None and drain.done is fut and drain.timer is not None:
            drain.timer.cancel()
        if fut.cancelled():
            return
        upstream = pool.snapshot.get(upstream_id)
        clean = fut.result()
        self._emit(
            "drained",
            pool.routing.name,
            upstream,
            upstream,
            "drained" if clean else "drain timeout",
            clean,
        )

    def undrain(self, service: str, upstream_id: str) -> None:
        """Return a draining upstream to active (a manual drain taken back)."""
        pool = self.services.get(service)
        if pool is None:
            return
        drain = pool._drains.pop(upstream_id, None)
        if drain is not None:
            if drain.timer is not None:
                drain.timer.cancel()
            if not drain.done.done():
                drain.done.cancel()
        pool._update(upstream_id, "undrained", admin=AdminState.ACTIVE)

    def __repr__(self) -> str:
        return f"<Pool services={len(self.services)} subscribers={len(self._subscribers)}>"
