"""The cluster's pools in etcd: the leader publishes them, every other node follows them.

Keys (``prefix`` ends with ``/``; records and reports are ``membership``'s JSON):

- ``<prefix>pools/<service>``: the leader's pool record of a service (``Publisher``), written
  only when its content changed, several services in one transaction, each fenced by the
  leadership; deleted when the service is removed.
- ``<prefix>reports/<node>``: a follower's report (``Follower``), bound to the node's lease,
  so a node that dies stops counting on its own. The leader reads them (``peers.Peers``).
  Written when it changed (its traffic is looked at every second, at once when a service
  begins holding requests), and again within a third of ``fresh_for`` while the node has
  requests in flight or held, so that its demand never reads as stale while it lasts.

``Follower`` loads the records, then watches them (``feed.Feed``, never polling) and makes its
own pool match (``membership.plan``); its own prober decides health. With etcd unreachable
it changes nothing and serves what it has, then resumes the watch where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from controller.cluster.demand import Demand
from controller.cluster.feed import RETRY, Feed, Status
from controller.cluster.membership import (
    AddUpstream,
    DrainUpstream,
    NodeReport,
    PoolRecord,
    RemoveService,
    RemoveUpstream,
    SetFailure,
    SetService,
    SetSplit,
    Step,
    UndrainUpstream,
    plan,
    record_of,
    report_of,
)
from controller.errors import Deposed
from controller.etcd import Compare, Delete, EtcdClient, EtcdError, EtcdUnavailable, Op, Put
from controller.tasks import cancel_task, guarded_task, wait_set
from gateway import AdminState, Pool, PoolEvent

log = logging.getLogger(__name__)

DEBOUNCE = 0.05
"""Seconds changes are gathered before one write: a rollout step makes several at once."""
MAX_OPS = 100
"""Writes in one transaction at most (etcd refuses more than 128 by default)."""
MAX_BYTES = 512 * 1024
"""Record bytes one transaction gathers before it is sent (etcd refuses requests over 1.5
MiB by default; a record is written alone whatever its size)."""
DRAIN_TIMEOUT = 30.0
"""A follower's drain timeout when the record gives none (the spec's default)."""


def pools_key(prefix: str, service: str = "") -> bytes:
    return f"{prefix}pools/{service}".encode()


def reports_key(prefix: str, node: str = "") -> bytes:
    return f"{prefix}reports/{node}".encode()


class _Deposed(Exception):
    """A fenced write was refused: this node no longer leads."""


class Publisher:
    """On the leader: keeps ``<prefix>pools/<service>`` equal to its pool's records.

    A ``PoolSubscriber``. ``fence`` gives the compares that hold only while this node leads
    (put in every transaction); when one fails, or ``fence`` raises ``Deposed``, the publisher
    stops and calls ``on_deposed``.
    ``drain_timeout(service, upstream_id)`` is a drain's timeout for the followers, read when
    the drain begins (None: theirs). Records of services the pool does not have are left as
    they are unless ``prune``: a leader that has not loaded its services yet must not remove
    them from every node.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        pool: Pool,
        fence: Callable[[], Sequence[Compare]],
        *,
        drain_timeout: Callable[[str, str], float | None] | None = None,
        on_deposed: Callable[[], object] | None = None,
        prune: bool = False,
        delay: float = DEBOUNCE,
        retry: tuple[float, float] = RETRY,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.pool = pool
        self.fence = fence
        self.drain_timeout = drain_timeout
        self.on_deposed = on_deposed
        self.prune = prune
        self.delay = delay
        self.retry = retry
        self.requests = 0
        """etcd requests made (reads and transactions)."""
        self.writes = 0
        """Records written or deleted."""
        self.deposed = False
        self._written: dict[str, PoolRecord] = {}
        """Each service's record content as etcd has it."""
        self._drains: dict[tuple[str, str], tuple[int, float | None]] = {}
        """(service, upstream id) -> (since, timeout) of each draining upstream."""
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._flushed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read what etcd has (so what is there already is not written again), subscribe,
        and write what differs. etcd unreachable now: it is retried in the background."""
        for name, sp in self.pool.services.items():
            for upstream in sp.snapshot.upstreams:
                if upstream.admin is AdminState.DRAINING:
                    self._drains[name, upstream.id] = (sp.snapshot.version, None)
        self.pool.subscribe(self)
        self._task = guarded_task(self._run(), f"cluster publisher {self.prefix}")

    async def stop(self) -> None:
        self.pool.unsubscribe(self)
        await cancel_task(self._task)
        self._task = None

    async def flushed(self) -> None:
        """Return once every change so far is in etcd (or the publisher was deposed)."""
        if self.deposed:
            return
        if self._dirty or self._wake.is_set():
            self._flushed.clear()
        await self._flushed.wait()

    def on_pool_event(self, event: PoolEvent) -> None:
        if self.deposed:
            return
        service = event.service
        upstream = event.upstream
        if event.kind == "service_removed":
            for key in [k for k in self._drains if k[0] == service]:
                del self._drains[key]
        elif event.kind == "removed" and upstream is not None:
            self._drains.pop((service, upstream.id), None)
        elif upstream is not None and event.kind in ("added", "changed"):
            key = (service, upstream.id)
            if upstream.admin is not AdminState.DRAINING:
                self._drains.pop(key, None)
            elif key not in self._drains:
                # The event comes after the snapshot that made it draining: its version is
                # the drain's (``Pool.drain``), which the followers' idle reports must reach.
                sp = self.pool.services.get(service)
                since = sp.snapshot.version if sp is not None else 0
                timeout = self.drain_timeout(service, upstream.id) if self.drain_timeout else None
                self._drains[key] = (since, timeout)
        self._dirty.add(service)
        self._flushed.clear()
        self._wake.set()

    def record(self, service: str) -> PoolRecord | None:
        """The record of ``service`` as its pool is now (None: the pool has no such service)."""
        sp = self.pool.services.get(service)
        if sp is None:
            return None
        drains = {uid: d for (name, uid), d in self._drains.items() if name == service}
        return record_of(sp.routing, sp.snapshot, drains)

    async def _run(self) -> None:
        pause = self.retry[0]
        loaded = False
        while True:
            try:
                if not loaded:
                    await self._load()
                    loaded = True
                while self._dirty:
                    await self._flush()
            except _Deposed:
                self.deposed = True
                self._flushed.set()
                log.warning("pool records: a fenced write was refused, no longer leading")
                if self.on_deposed is not None:
                    self.on_deposed()
                return
            except (EtcdUnavailable, EtcdError) as exc:
                log.warning("pool records: etcd: %s; again in %.1f s", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.retry[1])
                continue
            pause = self.retry[0]
            self._flushed.set()
            await self._wake.wait()
            await asyncio.sleep(self.delay)  # gather the rest of this change
            self._wake.clear()

    async def _load(self) -> None:
        self.requests += 1
        kvs, _ = await self.client.get(pools_key(self.prefix), prefix=True)
        self._written = {}
        for kv in kvs:
            service = kv.key.decode()[len(pools_key(self.prefix)) :]
            try:
                self._written[service] = PoolRecord.decode(kv.value).content
            except ValueError:
                self._dirty.add(service)  # unreadable: written again (or deleted)
            if self.prune and service not in self.pool.services:
                self._dirty.add(service)
        self._dirty.update(self.pool.services)

    async def _flush(self) -> None:
        """One fenced transaction with the records that changed (``MAX_OPS`` and about
        ``MAX_BYTES`` at most; the rest stay dirty for the next)."""
        try:
            fence = self.fence()
        except Deposed as exc:  # the election knows already
            raise _Deposed from exc
        ops: list[Op] = []
        size = 0
        done: dict[str, PoolRecord | None] = {}
        for service in sorted(self._dirty):
            if len(ops) == MAX_OPS or size >= MAX_BYTES:
                break
            self._dirty.discard(service)
            record = self.record(service)
            if record is None:
                if service in self._written:
                    ops.append(Delete(pools_key(self.prefix, service)))
                    done[service] = None
            elif self._written.get(service) != record.content:
                value = record.encode()
                size += len(value)
                ops.append(Put(pools_key(self.prefix, service), value))
                done[service] = record.content
        if not ops:
            return
        self.requests += 1
        try:
            result = await self.client.txn(fence, ops)
        except BaseException:
            self._dirty.update(done)  # it may or may not have been applied: again
            raise
        if not result.succeeded:
            raise _Deposed
        self.writes += len(ops)
        for service, content in done.items():
            if content is None:
                self._written.pop(service, None)
            else:
                self._written[service] = content

    def __repr__(self) -> str:
        return (
            f"<Publisher {self.prefix} services={len(self._written)} dirty={len(self._dirty)} "
            f"requests={self.requests} writes={self.writes} deposed={self.deposed}>"
        )


class Follower:
    """On every node but the leader: its pool follows ``<prefix>pools/``, and its report
    (``<prefix>reports/<node>``, bound to ``lease()``) says what it routes to and which
    draining upstreams it holds nothing of.

    A ``PoolSubscriber`` of its own pool (for the report). ``drain_timeout`` is a drain's
    timeout here when the record gives none. ``on_status`` hears the feed's status changes
    (``feed.Status``). ``fresh_for``: how long the leader counts the report's demand (the
    node's lease TTL; 0: while the report is there).
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        pool: Pool,
        node: str,
        lease: Callable[[], int],
        *,
        drain_timeout: float = DRAIN_TIMEOUT,
        on_status: Callable[[Status], object] | None = None,
        delay: float = DEBOUNCE,
        retry: tuple[float, float] = RETRY,
        lease_check: float = 1.0,
        fresh_for: float = 0.0,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.pool = pool
        self.node = node
        self.lease = lease
        self.fresh_for = fresh_for
        self.drain_timeout = drain_timeout
        self.delay = delay
        self.retry = retry
        self.lease_check = lease_check
        """Seconds between looks at ``lease()`` and at the traffic: a new lease (the old one
        expired with the report) or new traffic makes the report written again."""
        self.feed = Feed(
            client, pools_key(prefix), self._load, self.change, on_status=on_status, retry=retry
        )
        self.reports = 0
        """Reports written (or tried)."""
        self.records: dict[str, PoolRecord] = {}
        """The records applied, by service: the services this follower keeps."""
        self._drains: dict[tuple[str, str], asyncio.Future[bool]] = {}
        self._reported: tuple[NodeReport, int] | None = None
        self._reported_at = 0.0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Follow in the background: load the records and report. Started again (after a
        term as leader) it loads them whole too: its pool moved on meanwhile, and replaying
        the records written since it last followed would take every upstream an older record
        lacks out and add it again, its health unknown (nothing routable for a moment)."""
        self.feed.revision = 0
        self.feed.loaded.clear()
        self.pool.subscribe(self)
        self._wake.set()  # the first report goes out at once, empty if need be
        self._tasks = [
            guarded_task(self.feed.run(), f"cluster follower {self.node}"),
            guarded_task(self._report(), f"cluster report {self.node}"),
        ]

    async def stop(self) -> None:
        """Stop following (the pool stays as it is) and take the report away."""
        self.pool.unsubscribe(self)
        for task in self._tasks:
            await cancel_task(task)
        self._tasks = []
        self.feed.set_status("stopped")
        if self._reported is not None:
            with contextlib.suppress(EtcdUnavailable, EtcdError):
                self.reports += 1
                await self.client.delete(reports_key(self.prefix, self.node))
            self._reported = None

    def on_pool_event(self, event: PoolEvent) -> None:
        self._wake.set()

    def wake(self) -> None:
        """Report now, not at the next look: a service began holding requests here."""
        self._wake.set()

    def handover(self) -> list[tuple[str, str]]:
        """On the node that now leads, once stopped and once its ``Peers`` are ``loaded``:
        begin again the drains this follower began, so they wait for every node that reports
        (a drain waits for the peers it began with, and a follower's had none but its
        workers). Undrained and drained again in one go: no request is picked in between, and
        the workers and the publisher only see the second. The (service, upstream id)s."""
        again: list[tuple[str, str]] = []
        for service, uid in list(self._drains):
            upstream = self.pool.upstream(service, uid)
            if upstream is None or upstream.admin is not AdminState.DRAINING:
                continue
            record = self.records.get(service)
            member = record.member(uid) if record is not None else None
            timeout = member.timeout if member is not None else None
            self.pool.undrain(service, uid)
            self.pool.drain(service, uid, self.drain_timeout if timeout is None else timeout)
            again.append((service, uid))
        self._drains.clear()
        return again

    @property
    def status(self) -> Status:
        return self.feed.status

    @property
    def requests(self) -> int:
        """etcd requests made: loads, watches opened, reports written."""
        return self.feed.requests + self.reports

    # -- the records --------------------------------------------------------------------------

    def _load(self, values: dict[str, bytes]) -> None:
        for service, value in values.items():
            self.change(service, value)
        for service in list(self.records.keys() - values.keys()):
            self.apply(service, None)

    def change(self, service: str, value: bytes | None) -> None:
        """The record of ``service`` is now ``value`` (None: deleted)."""
        if value is None:
            self.apply(service, None)
            return
        try:
            record = PoolRecord.decode(value)
        except ValueError as exc:
            log.error("pool record of %s unreadable, kept as it was: %s", service, exc)
            return
        if record.service != service:
            log.error("pool record under %s names %s: ignored", service, record.service)
            return
        self.apply(service, record)

    def apply(self, service: str, record: PoolRecord | None) -> list[Step]:
        """Make the local pool's ``service`` match ``record`` (None: remove it); the steps."""
        sp = self.pool.services.get(service)
        if record is None and service not in self.records:
            return []  # not one of the cluster's services
        steps = plan(sp.routing if sp else None, sp.snapshot if sp else None, record)
        for step in steps:
            try:
                self._take(service, step)
            except Exception:  # one step's failure must not stop the watch or the others
                log.exception("pool of %s: %r failed", service, step)
        if record is None:
            self.records.pop(service, None)
        else:
            self.records[service] = record
        self._wake.set()
        return steps

    def _take(self, service: str, step: Step) -> None:
        pool = self.pool
        match step:
            case SetService(routing):
                pool.set_service(routing)
            case RemoveService():
                # Resolve its drains first: nothing would once the service is gone.
                for key in [k for k in self._drains if k[0] == service]:
                    pool.remove_upstream(service, key[1], "service removed")
                    self._drains.pop(key, None)
                pool.remove_service(service)
            case AddUpstream(upstream):
                pool.add_upstream(upstream)
            case RemoveUpstream(upstream_id):
                pool.remove_upstream(service, upstream_id, "not in the cluster's pool")
                self._drains.pop((service, upstream_id), None)
            case DrainUpstream(upstream_id, timeout):
                key = (service, upstream_id)
                done = pool.drain(
                    service, upstream_id, self.drain_timeout if timeout is None else timeout
                )
                self._drains[key] = done
                done.add_done_callback(lambda _: self._wake.set())
            case UndrainUpstream(upstream_id):
                self._drains.pop((service, upstream_id), None)
                pool.undrain(service, upstream_id)
            case SetSplit(split):
                pool.set_split(service, split)
            case SetFailure(failure):
                pool.set_failure(service, failure)

    # -- the report ---------------------------------------------------------------------------

    def report(self) -> NodeReport:
        """What this node says now."""
        drained = [k for k, f in self._drains.items() if f.done() and not f.cancelled()]
        services = [(n, sp) for n, sp in self.pool.services.items() if n in self.records]
        demand = {}
        for name, sp in services:
            inflight = {uid: count for uid, count in sp.inflight_all().items() if count}
            demand[name] = Demand(inflight, sp.held_all(), *sp.totals())
        snapshots = [sp.snapshot for _, sp in services]
        return report_of(snapshots, self.records, drained, demand, self.fresh_for)

    async def _report(self) -> None:
        pause = self.retry[0]
        loop = asyncio.get_running_loop()
        while True:
            refresh = self.fresh_for / 3
            busy = self._reported is not None and self._reported[0].busy
            look = min(self.lease_check, refresh) if busy and refresh else self.lease_check
            # A cancel here is ``stop``'s (a follower may be started and stopped at once: a
            # term that begins as the last one ends).
            if await wait_set(self._wake, look):
                await asyncio.sleep(self.delay)  # gather the rest of this change
            self._wake.clear()
            lease = self.lease()
            report = self.report()
            due = report.busy and refresh and loop.time() - self._reported_at >= refresh
            if not lease or (self._reported == (report, lease) and not due):
                continue
            try:
                self.reports += 1
                await self.client.put(
                    reports_key(self.prefix, self.node), report.encode(), lease=lease
                )
            except (EtcdUnavailable, EtcdError) as exc:
                log.warning("node report: etcd: %s; again in %.1f s", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.retry[1])
                self._wake.set()
                continue
            pause = self.retry[0]
            self._reported = (report, lease)
            self._reported_at = loop.time()

    def __repr__(self) -> str:
        return (
            f"<Follower {self.node} {self.status} services={len(self.records)} "
            f"revision={self.feed.revision} drains={len(self._drains)} requests={self.requests}>"
        )
