"""One service's pool: its snapshot, the in-flight leases on each upstream, the picks, the
queues of requests that wait (for a routable upstream, or for a slot under a per-replica
cap), and its rate-limit rules.

``Pool`` (``pool.py``) owns the services' pools, publishes their changes and runs drains;
``ServicePool`` is what a request works with: ``pick``, ``lease``, ``wait_routable``,
``wait_slot``, and the counts the metrics and the autoscaler read.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import Hsts, ServiceRouting, UpstreamTlsConfig
from ..errors import NoRoutableUpstream
from . import balancer, hashring, inference, prefixes, ratelimit
from .events import EventKind
from .outlier import OutlierState
from .snapshot import PoolSnapshot
from .upstream import Upstream

log = logging.getLogger(__name__)


class Owner(Protocol):
    """What a service's pool reads of the ``Pool`` that holds it (``pool.Pool``)."""

    rng: random.Random
    clock: Callable[[], float]
    """The monotonic clock (the loop's), injected for tests."""
    share: int
    """The worker processes the pool's limits are shared by (1: one process)."""
    max_held: int
    on_waiting: Callable[[str], object] | None
    peers: set[int]
    peer_inflight: dict[int, dict[tuple[str, str], int]]
    peer_held: dict[int, dict[str, int]]

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def _next_version(self) -> int: ...

    def _emit(
        self,
        kind: EventKind,
        service: str,
        upstream: Upstream | None = None,
        previous: Upstream | None = None,
        reason: str = "",
        clean: bool = True,
    ) -> None: ...


@dataclass(slots=True)
class Drain:
    """A drain of one upstream under way (``Pool.drain``)."""

    done: asyncio.Future[bool]
    version: int
    """The snapshot version that made the upstream draining; older peer reports are stale."""
    waiting: set[int]
    """Peers that may still hold leases of the upstream."""
    timer: asyncio.TimerHandle | None = None


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


def token_digests(tokens: dict[str, str]) -> dict[bytes, str]:
    """``AuthRouting.tokens`` (SHA-256 hex digest -> id) by the digest itself: a request's
    token is looked up by ``sha256(token).digest()``, without making its hex form. Only
    the keys a hex digest could equal (lower-case hex of 32 bytes) are kept."""
    out: dict[bytes, str] = {}
    for key, token_id in tokens.items():
        try:
            digest = bytes.fromhex(key)
        except ValueError:
            continue
        if len(digest) == 32 and digest.hex() == key:
            out[digest] = token_id
    return out


class ServicePool:
    """One service: its routing config, its current snapshot and its in-flight leases."""

    def __init__(self, owner: Owner, routing: ServiceRouting) -> None:
        self._owner = owner
        self.routing = routing
        self.snapshot = PoolSnapshot.of(routing.name, 0, ())
        self.inflight: dict[str, int] = {}
        self.leases: dict[str, set[Holder]] = {}
        self.outliers: dict[str, OutlierState] = {}
        self.cursor = 0
        self._drains: dict[str, Drain] = {}
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
        self.reports: dict[str, inference.ReplicaLoad] = {}
        """What each upstream last reported of its load (``load_metrics``, the prober's)."""
        self.sent = prefixes.Sent()
        """Which replicas the blocks of the prompt prefixes were sent to lately
        (``_prefix_pick``); a replica that leaves is forgotten."""
        self._sent_of: tuple[Upstream, ...] = ()
        self._ring: hashring.Ring | None = None
        self._ring_of: tuple[Upstream, ...] = ()
        self.cap = 0
        self.total_timeout = 0.0
        self.read_timeout = 0.0
        self.upstream_tls: UpstreamTlsConfig | None = None
        self.max_body_size = 0
        self.previews = False
        self.https_redirect = False
        self.hsts: Hsts | None = None
        self.guarded = False
        self.rate_limited = False
        self.affinity: str | None = None
        self.inference = False
        self.prefix_chars = 0
        self.max_load_factor = 1.0
        self.auth_on = False
        self.auth_header = b""
        self.auth_digests: dict[bytes, str] = {}
        """``auth.tokens`` by digest (``token_digests``)."""
        self.auth_strip = False
        self.configure()

    def configure(self) -> None:
        """Take in what ``routing`` says (when it is set or changed): the per-process cap, and
        the settings every request reads, kept as plain attributes (a field of a config
        model is read through pydantic's ``__getattr__`` hook: a slow attribute, and a
        request read a dozen of them)."""
        routing = self.routing
        cap = routing.limits.max_in_flight_per_replica
        self.cap = max(1, cap // self._owner.share) if cap else 0
        self.total_timeout = routing.timeouts.total or 0.0
        """``timeouts.total``; 0: none."""
        self.read_timeout = routing.timeouts.read
        self.upstream_tls = routing.upstream_tls
        """``upstream_tls``; None: plain connections to the replicas."""
        self.max_body_size = routing.limits.max_body_size
        self.previews = routing.preview.allow != "off"
        """Preview routes are on: a request may ask for a revision."""
        self.https_redirect = routing.route.https_redirect
        self.hsts = routing.route.hsts
        self.rate_limited = bool(routing.rate_limits)
        self.affinity = routing.affinity
        self.inference = routing.load_balancing == "inference"
        """Picks by load and prompt prefix (``inference``); the key is the prompt's text."""
        self.prefix_chars = routing.inference.prefix_chars
        self.max_load_factor = routing.inference.max_load_factor
        self.guarded = routing.auth is not None or self.rate_limited or self.affinity is not None
        """A request is checked by ``proxy.guard`` (auth, rate limits, an affinity key)."""
        auth = routing.auth
        self.auth_on = auth is not None
        self.auth_header = auth.header.encode() if auth is not None else b""
        """The header that bears the token (lower-cased)."""
        self.auth_digests = token_digests(auth.tokens) if auth is not None else {}
        self.auth_strip = auth is not None and not auth.pass_token
        """The token's header is not sent upstream."""
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
        if self.inference:
            if key is None:
                return inference.pick(
                    candidates, self.inflight, self.reports, self._owner.clock(), self.cursor
                )
            return self._prefix_pick(candidates, key)
        if key is not None and candidates:
            return self._hashed(candidates, key)
        return balancer.pick(
            self.routing.load_balancing, candidates, self.inflight, self._owner.rng, self.cursor
        )

    def _hashed(self, candidates: tuple[Upstream, ...], key: bytes) -> Upstream:
        """The owner of ``key`` on the ring of the routable upstreams, or the next one round
        among ``candidates``: an upstream that leaves moves only its own keys."""
        routable = self.snapshot.routable
        ring = self._ring_now()
        skip: frozenset[str] | tuple[()] = ()
        if len(candidates) != len(routable):
            skip = frozenset(u.id for u in routable) - {u.id for u in candidates}
        uid = ring.lookup(hashring.key_hash(key), skip)
        for upstream in candidates:
            if upstream.id == uid:
                return upstream
        return candidates[0]

    def _prefix_pick(self, candidates: tuple[Upstream, ...], key: bytes) -> Upstream | None:
        """``inference.pick`` for a prompt prefix ``key``: by the leading blocks of it each
        candidate was sent lately; its blocks are remembered as sent to the one picked."""
        routable = self.snapshot.routable
        sent = self.sent
        if self._sent_of is not routable:
            sent.keep({u.id for u in routable})  # forgets the replicas that left
            self._sent_of = routable
        blocks = prefixes.blocks_of(key)
        chosen = inference.pick(
            candidates,
            self.inflight,
            self.reports,
            self._owner.clock(),
            self.cursor,
            sent.matched(blocks, [u.id for u in candidates]),
            self.max_load_factor,
        )
        if chosen is not None:
            sent.sent(blocks, chosen.id)
        return chosen

    def _ring_now(self) -> hashring.Ring:
        """The hash ring of the routable upstreams (made again when they change)."""
        routable = self.snapshot.routable
        ring = self._ring
        if ring is None or self._ring_of is not routable:
            ids = tuple(u.id for u in routable)
            if ring is None or ring.ids != ids:
                ring = self._ring = hashring.Ring(ids)
            self._ring_of = routable
        return ring

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
