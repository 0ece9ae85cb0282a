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

Longer than most modules: snapshots, leases, drains and peers are one state, changed together
under the invariants above.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from . import balancer, hashring, ratelimit
from .config import ServiceRouting
from .errors import NoRoutableUpstream
from .events import EventKind, PoolEvent, PoolSubscriber
from .outlier import Ejection, OutlierState, may_eject
from .router import Route, RouteTable
from .upstream import AdminState, Health, Upstream, by_fields

log = logging.getLogger(__name__)

MAX_HELD = 1000

RequestCounts = tuple[tuple[float, ...], dict[int, tuple[int, int, tuple[int, ...]]]]
"""The latency buckets' bounds, and per revision: (requests answered, of them 5xx, requests
per latency bucket, +Inf last). Running totals."""
"""Requests one service holds at most per process while nothing is routable; beyond, 503."""


@dataclass(frozen=True, slots=True)
class Split:
    """Traffic split by revision (a canary, a blue/green switch): ``weight`` percent of the
    requests go to the routable upstreams of ``revision`` (``chosen``), the rest to the other
    routable ones (``rest``), whatever the replica counts; then the service's policy picks
    among them. A side with nothing routable gives its share to the other: a weight never
    makes a 503. Both sides are worked out once per snapshot, so a pick only draws."""

    revision: int
    weight: int
    chosen: tuple[Upstream, ...] = ()
    rest: tuple[Upstream, ...] = ()
    threshold: float = 0.0
    """``weight / 100``: a draw in [0, 1) below it takes ``chosen``."""

    @classmethod
    def of(cls, revision: int, weight: int, routable: Iterable[Upstream] = ()) -> Split:
        chosen: list[Upstream] = []
        rest: list[Upstream] = []
        for upstream in routable:
            (chosen if upstream.revision == revision else rest).append(upstream)
        return cls(revision, weight, tuple(chosen), tuple(rest), weight / 100)

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return by_fields(self)

    def group(self, draw: float) -> tuple[Upstream, ...]:
        """The upstreams a request with ``draw`` (uniform in [0, 1)) goes to."""
        if draw < self.threshold:
            return self.chosen or self.rest
        return self.rest or self.chosen


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A service's upstreams at one moment. ``routable`` is precomputed for the hot path."""

    service: str
    version: int
    upstreams: tuple[Upstream, ...] = ()
    routable: tuple[Upstream, ...] = ()
    failure: str = ""
    """Why the service has nothing to route to, as the controller said (a cold start that
    failed): while it stands and nothing is routable, requests get 503 with it at once."""
    split: Split | None = None
    """The traffic split by revision the controller set; None: by the policy alone."""

    @classmethod
    def of(
        cls,
        service: str,
        version: int,
        upstreams: Iterable[Upstream],
        failure: str = "",
        split: tuple[int, int] | None = None,
    ) -> PoolSnapshot:
        """``split``: (revision, weight) to split the routable upstreams by."""
        ups = tuple(upstreams)
        routable = tuple(u for u in ups if u.routable)
        by = None if split is None else Split.of(split[0], split[1], routable)
        return cls(service, version, ups, routable, failure, by)

    @property
    def weights(self) -> tuple[int, int] | None:
        """(revision, weight) of the split, or None."""
        split = self.split
        return None if split is None else (split.revision, split.weight)

    def of_revision(self, revision: int) -> tuple[Upstream, ...]:
        """The routable upstreams of ``revision`` (a preview route's)."""
        return tuple(u for u in self.routable if u.revision == revision)

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return by_fields(self)

    def get(self, upstream_id: str) -> Upstream | None:
        for upstream in self.upstreams:
            if upstream.id == upstream_id:
                return upstream
        return None

    def counts(self) -> dict[str, int]:
        """How many upstreams are in each state (for 503 bodies and status)."""
        out: dict[str, int] = {}
        for upstream in self.upstreams:
            out[upstream.state] = out.get(upstream.state, 0) + 1
        return out


class Holder(Protocol):
    """What holds a request in flight on an upstream (``ServicePool.hold``)."""

    def abort(self) -> None:
        """Cut the request off: a drain of its upstream timed out."""


class Lease:
    """One request (or stream, or WebSocket) in flight on one upstream.

    Released exactly once, by ``release()`` or as a context manager. ``abort`` is what a drain
    timeout calls to cut the work off: it cancels the task that took the lease, unless
    ``on_abort`` says otherwise (a WebSocket closes with 1001 instead).

    A lease holds no reference to itself (no bound method of its own in an attribute), so it
    is freed by reference counting when its request ends: one made per request must not wait
    for the cyclic garbage collector, whose every pass costs the event loop time.
    """

    __slots__ = ("_pool", "_released", "on_abort", "service", "task", "upstream")

    def __init__(
        self, pool: ServicePool, upstream: Upstream, task: asyncio.Task[Any] | None
    ) -> None:
        self._pool = pool
        self._released = False
        self.service = pool.routing.name
        self.upstream = upstream
        self.task = task
        self.on_abort: Callable[[], object] | None = None

    def abort(self) -> None:
        if self.on_abort is not None:
            self.on_abort()
        elif self.task is not None and not self.task.done():
            self.task.cancel()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool.unhold(self.upstream.id, self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Lease {self.upstream.id} released={self._released}>"


@dataclass(slots=True)
class _SlotWaiter:
    """A request waiting in a service's slot queue (``ServicePool.wait_slot``)."""

    future: asyncio.Future[Lease]
    task: asyncio.Task[Any] | None
    key: bytes | None
    exclude: frozenset[str]


@dataclass(slots=True)
class _Drain:
    done: asyncio.Future[bool]
    version: int
    """The snapshot version that made the upstream draining; older peer reports are stale."""
    waiting: set[int]
    """Peers that may still hold leases of the upstream."""
    timer: asyncio.TimerHandle | None = None


class ServicePool:
    """One service: its routing config, its current snapshot and its in-flight leases."""

    def __init__(self, owner: Pool, routing: ServiceRouting) -> None:
        self._owner = owner
        self.routing = routing
        self.snapshot = PoolSnapshot.of(routing.name, 0, ())
        self.inflight: dict[str, int] = {}
        self.leases: dict[str, set[Holder]] = {}
        self.outliers: dict[str, OutlierState] = {}
        self.cursor = 0
        self._drains: dict[str, _Drain] = {}
        self._idle: dict[str, list[Callable[[], object]]] = {}
        self._routable_waiters: list[asyncio.Future[None]] = []
        self.held = 0
        """Requests held here now, waiting for a routable upstream (``queue``)."""
        self.waited = 0
        """Requests that found nothing routable here (held or refused): a running total."""
        self.completed = 0
        """Requests (attempts) finished on an upstream here: a running total."""
        self.peer_counts = [0, 0]
        """What the peers reported of the two totals above (completed, waited), summed."""
        self.counters: dict[str, float] = {}
        """Running totals of the guards (``proxy.guard``) and the slot queue: ``auth_ok``,
        ``auth_missing``, ``auth_wrong``, ``rate_limited``, ``queued``, ``queue_timeout``,
        ``queue_wait_seconds``."""
        self.peer_counters: dict[str, float] = {}
        """The peers' reports of ``counters``, summed."""
        self.peer_queued: dict[int, int] = {}
        """Each peer's slot queue as of its last report."""
        self._slot_waiters: deque[_SlotWaiter] = deque()
        self._rules: tuple[ratelimit.Rule, ...] = ()
        self._rules_of: object = None
        self._ring: hashring.Ring | None = None
        self._ring_of: tuple[Upstream, ...] = ()
        self.cap = 0
        self.configure()

    def configure(self) -> None:
        """Take in what ``routing`` says (when it is set or changed): the per-process cap."""
        cap = self.routing.limits.max_in_flight_per_replica
        self.cap = max(1, cap // self._owner.share) if cap else 0
        if self._slot_waiters:
            self._hand_slots()

    # -- picks and leases (hot path) --------------------------------------------------------

    def pick(
        self, exclude: frozenset[str] = frozenset(), key: bytes | None = None
    ) -> Upstream | None:
        """A routable upstream (not in ``exclude``, under the cap) by the service's policy;
        ``key``: the request's affinity key, for ``hash``."""
        snapshot = self.snapshot
        candidates = snapshot.routable
        self.cursor += 1
        split = snapshot.split
        if split is not None:
            candidates = split.group(self._owner.rng.random())
        cap = self.cap
        if cap:
            inflight = self.inflight
            candidates = tuple(
                u for u in candidates if u.id not in exclude and inflight.get(u.id, 0) < cap
            )
            if not candidates:
                return None
        elif exclude:
            candidates = tuple(u for u in candidates if u.id not in exclude)
        if len(candidates) == 1:
            return candidates[0]  # every policy's choice
        if key is not None and candidates:
            return self._hashed(candidates, key)
        return balancer.pick(
            self.routing.load_balancing, candidates, self.inflight, self._owner.rng, self.cursor
        )

    def _hashed(self, candidates: tuple[Upstream, ...], key: bytes) -> Upstream:
        """The owner of ``key`` on the ring of the routable upstreams, or the next one round
        among ``candidates``: an upstream that leaves moves only its own keys."""
        routable = self.snapshot.routable
        ring = self._ring
        if ring is None or self._ring_of is not routable:
            ids = tuple(u.id for u in routable)
            if ring is None or ring.ids != ids:
                ring = self._ring = hashring.Ring(ids)
            self._ring_of = routable
        skip: frozenset[str] | tuple[()] = ()
        if len(candidates) != len(routable):
            skip = frozenset(u.id for u in routable) - {u.id for u in candidates}
        uid = ring.lookup(hashring.key_hash(key), skip)
        for upstream in candidates:
            if upstream.id == uid:
                return upstream
        return candidates[0]

    def has_room(self, upstream: Upstream) -> bool:
        """Whether ``upstream`` may take one more request under the cap."""
        return not self.cap or self.inflight.get(upstream.id, 0) < self.cap

    def rate_rules(self) -> tuple[ratelimit.Rule, ...]:
        """The service's rate limits with their buckets here (made again when they change)."""
        limits = self.routing.rate_limits
        if self._rules_of is not limits:
            if self._rules_of != limits:
                self._rules = ratelimit.rules(limits, self._owner.share)
            self._rules_of = limits
        return self._rules

    def lease(
        self, exclude: frozenset[str] = frozenset(), key: bytes | None = None
    ) -> Lease | None:
        """Pick a routable upstream and count a request in flight on it, or None."""
        upstream = self.pick(exclude, key)
        if upstream is None:
            return None
        return self.lease_of(upstream, asyncio.current_task(self._owner.loop))

    def lease_of(self, upstream: Upstream, task: asyncio.Task[Any] | None = None) -> Lease:
        """Count a request in flight on ``upstream``, picked already, for ``task`` (what a
        drain timeout cancels; None: the lease's ``on_abort`` is set)."""
        lease = Lease(self, upstream, task)
        self.hold(upstream.id, lease)
        return lease

    def hold(self, uid: str, holder: Holder) -> None:
        """Count a request in flight on upstream ``uid``: ``holder`` is what a drain timeout
        aborts, and what ``unhold`` is given once the request is over. A ``Lease``, or the
        proxy's own record of a request it serves without a task (no lease made for it)."""
        inflight = self.inflight
        inflight[uid] = inflight.get(uid, 0) + 1
        leases = self.leases.get(uid)
        if leases is None:
            leases = self.leases[uid] = set()
        leases.add(holder)

    def unhold(self, uid: str, holder: Holder) -> None:
        """The request ``holder`` held on upstream ``uid`` is over (exactly once)."""
        self.completed += 1
        count = self.inflight.get(uid, 0) - 1
        leases = self.leases.get(uid)
        if leases is not None:
            leases.discard(holder)
        if count > 0:
            self.inflight[uid] = count
            if self._slot_waiters:
                self._hand_slots()
            return
        self.inflight.pop(uid, None)
        if self._slot_waiters:
            self._hand_slots()
        self.leases.pop(uid, None)
        if self._drains:
            self._settle(uid)
        if self._idle:
            for callback in self._idle.pop(uid, ()):
                callback()

    def abort(self, upstream_id: str) -> None:
        """A drain timed out: cut off every lease of the upstream held here (``Lease.abort``)."""
        leases = list(self.leases.get(upstream_id, ()))
        if not leases:
            return
        log.warning(
            "drain timeout for %s/%s: aborting %d in flight",
            self.routing.name,
            upstream_id,
            len(leases),
        )
        for lease in leases:
            try:
                lease.abort()
            except Exception:
                log.exception("abort of %r failed", lease)

    def when_idle(self, upstream_id: str, callback: Callable[[], object]) -> None:
        """Call ``callback`` once no lease of the upstream is held here (now, if none is)."""
        if self.inflight.get(upstream_id):
            self._idle.setdefault(upstream_id, []).append(callback)
        else:
            callback()

    def _settle(self, uid: str) -> None:
        """Complete the upstream's drain if nothing here or in a peer holds it any more."""
        drain = self._drains.get(uid)
        if (
            drain is not None
            and not drain.done.done()
            and not drain.waiting
            and not self.inflight.get(uid)
        ):
            drain.done.set_result(True)

    def inflight_all(self) -> dict[str, int]:
        """In-flight counts per upstream, this process's and its peers' last reports summed."""
        peers = self._owner.peer_inflight
        if not peers:
            return dict(self.inflight)
        out = dict(self.inflight)
        name = self.routing.name
        for counts in peers.values():
            for (service, uid), count in counts.items():
                if service == name:
                    out[uid] = out.get(uid, 0) + count
        return out

    def held_all(self) -> int:
        """Requests held now, here and in the peers (as of their last reports)."""
        name = self.routing.name
        return self.held + sum(h.get(name, 0) for h in self._owner.peer_held.values())

    def totals(self) -> tuple[int, int]:
        """(completed, waited) here and in the peers: running totals (the autoscaler's)."""
        return self.completed + self.peer_counts[0], self.waited + self.peer_counts[1]

    async def queue(self, within: float) -> None:
        """Hold a request until an upstream is routable, at most ``within`` seconds.

        Raises the 503 (``NoRoutableUpstream``) at once when the queue holds
        ``Pool.max_held`` already or the controller said why nothing can serve
        (``PoolSnapshot.failure``), and when that failure comes or the time is up while held.
        The first request held wakes ``Pool.on_waiting``: held requests are demand.
        """
        if self.snapshot.routable:
            return
        self.waited += 1
        if self.snapshot.failure or within <= 0:
            raise self.unavailable()
        owner = self._owner
        if self.held >= owner.max_held:
            raise self.unavailable(f"{self.held} requests held already, the most it holds")
        waiter: asyncio.Future[None] = owner.loop.create_future()
        self._routable_waiters.append(waiter)
        self.held += 1
        if self.held == 1 and owner.on_waiting is not None:
            owner.on_waiting(self.routing.name)
        try:
            async with asyncio.timeout(within):
                await waiter
        except TimeoutError:
            if not self.snapshot.routable:
                raise self.unavailable(f"held {within:g} s") from None
        finally:
            self.held -= 1
            if waiter in self._routable_waiters:
                self._routable_waiters.remove(waiter)
        if not self.snapshot.routable:
            raise self.unavailable()

    async def wait_routable(self, within: float) -> bool:
        """Wait up to ``within`` seconds for a routable upstream; True if there is one."""
        if self.snapshot.routable:
            return True
        if within <= 0:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._routable_waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), within)
        except TimeoutError:
            return bool(self.snapshot.routable)
        finally:
            if waiter in self._routable_waiters:
                self._routable_waiters.remove(waiter)
        return bool(self.snapshot.routable)

    # -- the slot queue (``limits.max_in_flight_per_replica``) ---------------------------------

    async def wait_slot(
        self, within: float, key: bytes | None = None, exclude: frozenset[str] = frozenset()
    ) -> Lease:
        """Wait, in FIFO order, for a routable upstream (not in ``exclude``) with room under
        the cap: the oldest waiter takes the first slot freed (``_hand_slots``). At most
        ``limits.max_queue`` wait; beyond, or after ``within`` seconds, the 503
        (``NoRoutableUpstream``)."""
        counters = self.counters
        waiters = self._slot_waiters
        if within <= 0 or len(waiters) >= self.routing.limits.max_queue:
            counters["queue_full"] = counters.get("queue_full", 0) + 1
            raise self.unavailable(
                f"every replica has {self.cap} requests in flight and {len(waiters)} wait already"
            )
        loop = self._owner.loop
        waiter = _SlotWaiter(loop.create_future(), asyncio.current_task(loop), key, exclude)
        waiters.append(waiter)
        counters["queued"] = counters.get("queued", 0) + 1
        began = loop.time()
        future = waiter.future
        try:
            async with asyncio.timeout(within):
                return await future
        except BaseException as exc:
            if future.done() and not future.cancelled():
                future.result().release()  # handed a slot, but leaving without it
            else:
                future.cancel()
                if waiter in waiters:
                    waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                counters["queue_timeout"] = counters.get("queue_timeout", 0) + 1
                raise self.unavailable(f"no slot free within {within:g} s") from None
            raise
        finally:
            counters["queue_wait_seconds"] = (
                counters.get("queue_wait_seconds", 0) + loop.time() - began
            )

    def _hand_slots(self) -> None:
        """Give the slots that are free to the oldest waiters that may take them, each its
        own lease. A waiter restricted to some upstreams (``exclude``: a preview route's
        revision) lets those behind it take a slot it may not; one that may take any and
        finds none ends the round: no slot is free."""
        waiters = self._slot_waiters
        i = 0
        while i < len(waiters):
            waiter = waiters[i]
            if waiter.future.done():
                del waiters[i]
                continue
            upstream = self.pick(waiter.exclude, waiter.key)
            if upstream is None:
                if not waiter.exclude:
                    return
                i += 1
                continue
            del waiters[i]
            waiter.future.set_result(self.lease_of(upstream, waiter.task))

    @property
    def queued(self) -> int:
        """Requests waiting for a slot here now."""
        return len(self._slot_waiters)

    def peer_counted(self, peer: int, counters: dict[str, float], queued: int) -> None:
        """A peer's ``counters`` since its previous report, and its slot queue now."""
        mine = self.peer_counters
        for name, value in counters.items():
            mine[name] = mine.get(name, 0) + value
        self.peer_queued[peer] = queued

    def counted_all(self) -> dict[str, float]:
        """``counters``, here and in the peers."""
        out = dict(self.counters)
        for name, value in self.peer_counters.items():
            out[name] = out.get(name, 0) + value
        return out

    def queued_all(self) -> int:
        """Requests waiting for a slot now, here and in the peers (their last reports)."""
        peers = self._owner.peers
        return self.queued + sum(n for p, n in self.peer_queued.items() if p in peers)

    def unavailable(self, why: str = "") -> NoRoutableUpstream:
        """The 503 error for this service, saying what its upstreams are doing (and ``why``,
        or the failure the controller gave)."""
        counts = self.snapshot.counts()
        total = len(self.snapshot.upstreams)
        detail = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none"
        message = (
            f"no routable upstream for service {self.routing.name!r} ({total} upstreams: {detail})"
        )
        reason = self.snapshot.failure or why
        if not reason:
            return NoRoutableUpstream(
                message, service=self.routing.name, upstreams=total, states=counts
            )
        return NoRoutableUpstream(
            f"{message}: {reason}",
            service=self.routing.name,
            upstreams=total,
            states=counts,
            reason=reason,
        )

    # -- changes ------------------------------------------------------------------------------

    def _publish(
        self,
        upstreams: Iterable[Upstream],
        version: int | None = None,
        failure: str | None = None,
        split: tuple[int, int] | bool | None = True,
    ) -> None:
        """A new snapshot of ``upstreams``; ``failure`` and ``split`` as they were unless
        given (``split``: True keeps it, None drops it)."""
        if version is None:
            version = self._owner._next_version()
        if failure is None:
            failure = self.snapshot.failure
        weights = self.snapshot.weights if isinstance(split, bool) else split
        self.snapshot = PoolSnapshot.of(self.routing.name, version, upstreams, failure, weights)
        if (self.snapshot.routable or failure) and self._routable_waiters:
            for waiter in self._routable_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._routable_waiters.clear()
        if self._slot_waiters:
            self._hand_slots()

    def _update(self, upstream_id: str, reason: str, **changes: object) -> Upstream | None:
        old = self.snapshot.get(upstream_id)
        if old is None:
            return None
        new = old.replace(**changes)
        if new == old:
            return old
        self._publish(new if u.id == upstream_id else u for u in self.snapshot.upstreams)
        self._owner._emit("changed", self.routing.name, new, old, reason)
        return new

    def __repr__(self) -> str:
        return (
            f"<ServicePool {self.routing.name} v{self.snapshot.version} "
            f"upstreams={len(self.snapshot.upstreams)} routable={len(self.snapshot.routable)} "
            f"inflight={sum(self.inflight.values())}>"
        )


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
        drain = _Drain(loop.create_future(), 0, set(self.peers))
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
