"""The cluster's pools in etcd: the leader publishes them, every other node follows them.

Keys (``prefix`` ends with ``/``; records and reports are ``membership``'s JSON):

- ``<prefix>pools/<service>``: the leader's pool record of a service (``Publisher``), written
  only when its content changed, several services in one transaction, each fenced by the
  leadership; deleted when the service is removed.
- ``<prefix>reports/<node>``: a follower's report (``Follower``), bound to the node's lease,
  so a node that dies stops counting on its own.

``Follower`` loads the records, then watches them (never polls) and makes its own pool match
(``membership.plan``); its own prober decides health. With etcd unreachable it changes
nothing and serves what it has, then resumes the watch where it was (reloading everything
when that revision was compacted). ``Peers`` (on the leader) makes each reporting node a peer
of the leader's pool: a drain there waits for every live node's idle report, and a node
whose report disappears holds nothing any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal

from controller.cluster.membership import (
    AddUpstream,
    DrainUpstream,
    NodeReport,
    PeerTable,
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
from controller.etcd import (
    Compacted,
    Compare,
    Delete,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    Op,
    Put,
    WatchEvent,
)
from gateway import AdminState, Pool, PoolEvent

log = logging.getLogger(__name__)

DEBOUNCE = 0.05
"""Seconds changes are gathered before one write: a rollout step makes several at once."""
RETRY = (0.1, 2.0)
"""The first and the longest pause before trying etcd again (doubling in between)."""
MAX_OPS = 100
"""Writes in one transaction at most (etcd refuses more than 128 by default)."""
DRAIN_TIMEOUT = 30.0
"""A follower's drain timeout when the record gives none (the spec's default)."""

Status = Literal["starting", "watching", "unreachable", "stopped"]


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
        self._task = _guarded(self._run(), f"cluster publisher {self.prefix}")

    async def stop(self) -> None:
        self.pool.unsubscribe(self)
        await _cancel(self._task)
        self._task = None

    async def flushed(self) -> None:
        """Return once every change so far is in etcd (or the publisher was deposed)."""
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
        kvs, _ = await self.client.get(pools_key(self.prefix), prefix=True)
        self.requests += 1
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
        """One fenced transaction with the records that changed (``MAX_OPS`` at most)."""
        try:
            fence = self.fence()
        except Deposed as exc:  # the election knows already
            raise _Deposed from exc
        ops: list[Op] = []
        done: dict[str, PoolRecord | None] = {}
        for service in sorted(self._dirty):
            if len(ops) == MAX_OPS:
                break
            self._dirty.discard(service)
            record = self.record(service)
            if record is None:
                if service in self._written:
                    ops.append(Delete(pools_key(self.prefix, service)))
                    done[service] = None
            elif self._written.get(service) != record.content:
                ops.append(Put(pools_key(self.prefix, service), record.encode()))
                done[service] = record.content
        if not ops:
            return
        try:
            result = await self.client.txn(fence, ops)
        except BaseException:
            self._dirty.update(done)
            raise
        finally:
            self.requests += 1
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
    timeout here when the record gives none. ``on_status`` hears ``watching`` once the records
    are loaded and the watch is open, ``unreachable`` when etcd is not, ``stopped``.
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
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.pool = pool
        self.node = node
        self.lease = lease
        self.drain_timeout = drain_timeout
        self.on_status = on_status
        self.delay = delay
        self.retry = retry
        self.lease_check = lease_check
        """Seconds between looks at ``lease()``: a new lease (the old one expired with the
        report) makes the report written again."""
        self.status: Status = "starting"
        self.requests = 0
        """etcd requests made (reads, watches opened, reports written)."""
        self.records: dict[str, PoolRecord] = {}
        """The records applied, by service: the services this follower keeps."""
        self.revision = 0
        """The etcd revision the pools are known at."""
        self._drains: dict[tuple[str, str], asyncio.Future[bool]] = {}
        self._reported: tuple[NodeReport, int] | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Follow in the background: load the records (or, started again, resume the watch
        after the last revision seen) and report."""
        self.pool.subscribe(self)
        self._wake.set()  # the first report goes out at once, empty if need be
        self._tasks = [
            _guarded(self._follow(), f"cluster follower {self.node}"),
            _guarded(self._report(), f"cluster report {self.node}"),
        ]

    async def stop(self) -> None:
        """Stop following (the pool stays as it is) and take the report away."""
        self.pool.unsubscribe(self)
        for task in self._tasks:
            await _cancel(task)
        self._tasks = []
        self._set_status("stopped")
        if self._reported is not None:
            with contextlib.suppress(EtcdUnavailable, EtcdError):
                self.requests += 1
                await self.client.delete(reports_key(self.prefix, self.node))
            self._reported = None

    def on_pool_event(self, event: PoolEvent) -> None:
        self._wake.set()

    def _set_status(self, status: Status) -> None:
        if status != self.status:
            self.status = status
            if self.on_status is not None:
                self.on_status(status)

    # -- the records --------------------------------------------------------------------------

    async def _follow(self) -> None:
        pause = self.retry[0]
        load = not self.revision  # started again: resume the watch where it was
        while True:
            try:
                if load:
                    kvs, revision = await self.client.get(pools_key(self.prefix), prefix=True)
                    self.requests += 1
                    self._load(kvs)
                    self.revision = revision
                    load = False
                self.requests += 1
                watch = self.client.watch(
                    pools_key(self.prefix), prefix=True, start_revision=self.revision + 1
                )
                self._set_status("watching")
                pause = self.retry[0]
                async for events in watch:
                    self._events(events)
            except Compacted:
                log.info("pool records: revision %d compacted, loading again", self.revision)
                load = True
            except (EtcdUnavailable, EtcdError) as exc:
                self._set_status("unreachable")
                log.warning("pool records: etcd: %s; serving what is known", exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.retry[1])

    def _service(self, key: bytes) -> str:
        return key.decode()[len(pools_key(self.prefix)) :]

    def _load(self, kvs: Sequence[KeyValue]) -> None:
        present: set[str] = set()
        for kv in kvs:
            service = self._service(kv.key)
            present.add(service)
            self._put(service, kv.value)
        for service in list(self.records.keys() - present):
            self.apply(service, None)

    def _events(self, events: Sequence[WatchEvent]) -> None:
        for event in events:
            service = self._service(event.kv.key)
            if event.type == "DELETE":
                self.apply(service, None)
            else:
                self._put(service, event.kv.value)
            self.revision = max(self.revision, event.kv.mod_revision)

    def _put(self, service: str, value: bytes) -> None:
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
            self._take(service, step)
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
                done = pool.drain(service, upstream_id, timeout or self.drain_timeout)
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
        snapshots = [sp.snapshot for name, sp in self.pool.services.items() if name in self.records]
        return report_of(snapshots, self.records, drained)

    async def _report(self) -> None:
        pause = self.retry[0]
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.lease_check)
                await asyncio.sleep(self.delay)  # gather the rest of this change
            self._wake.clear()
            lease = self.lease()
            report = self.report()
            if not lease or self._reported == (report, lease):
                continue
            try:
                self.requests += 1
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

    def __repr__(self) -> str:
        return (
            f"<Follower {self.node} {self.status} services={len(self.records)} "
            f"revision={self.revision} drains={len(self._drains)} requests={self.requests}>"
        )


class Peers:
    """On the leader: every node that reports is a peer of the leader's pool.

    A node's drains complete when it reports itself idle on them (``peer_idle``, with the
    drain's ``since``); a node whose report is gone (its lease ended) leaves (``peer_left``):
    it holds nothing, so no drain waits for it. ``node`` is the leader's own name, whose
    report (from when it followed) is not a peer's. ``on_change(node)`` is called after each
    report is taken in, for the loop that waits for "routable everywhere".
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        pool: Pool,
        node: str = "",
        *,
        on_change: Callable[[str], object] | None = None,
        retry: tuple[float, float] = RETRY,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.pool = pool
        self.node = node
        self.on_change = on_change
        self.retry = retry
        self.table = PeerTable()
        self.requests = 0
        self.revision = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = _guarded(self._run(), f"cluster peers {self.prefix}")

    async def stop(self) -> None:
        """Stop, and let every node go: no drain of the pool waits for them any more."""
        await _cancel(self._task)
        self._task = None
        for node in list(self.table.reports):
            self._left(node)

    def routable_everywhere(self, service: str, upstream_id: str) -> bool:
        """Routable on every node that reports (one that has not reported it: not routable)."""
        return self.table.routable_everywhere(service, upstream_id)

    @property
    def nodes(self) -> list[str]:
        return sorted(self.table.reports)

    async def _run(self) -> None:
        pause = self.retry[0]
        load = True
        while True:
            try:
                if load:
                    kvs, revision = await self.client.get(reports_key(self.prefix), prefix=True)
                    self.requests += 1
                    self._load(kvs)
                    self.revision = revision
                    load = False
                self.requests += 1
                watch = self.client.watch(
                    reports_key(self.prefix), prefix=True, start_revision=self.revision + 1
                )
                pause = self.retry[0]
                async for events in watch:
                    for event in events:
                        self._event(event)
                        self.revision = max(self.revision, event.kv.mod_revision)
            except Compacted:
                load = True
            except (EtcdUnavailable, EtcdError) as exc:
                # The peers stay as they are: a node etcd does not hear from may still serve.
                log.warning("node reports: etcd: %s; again in %.1f s", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.retry[1])

    def _name(self, key: bytes) -> str:
        return key.decode()[len(reports_key(self.prefix)) :]

    def _load(self, kvs: Sequence[KeyValue]) -> None:
        present = {self._name(kv.key) for kv in kvs}
        for node in list(self.table.reports.keys() - present):
            self._left(node)
        for kv in kvs:
            self._take(self._name(kv.key), kv.value)

    def _event(self, event: WatchEvent) -> None:
        node = self._name(event.kv.key)
        if event.type == "DELETE":
            self._left(node)
        else:
            self._take(node, event.kv.value)

    def _take(self, node: str, value: bytes) -> None:
        if node == self.node:
            return
        try:
            report = NodeReport.decode(value)
        except ValueError as exc:
            log.error("report of node %s unreadable: %s", node, exc)
            return
        peer = self.table.number(node)
        if self.table.update(node, report):
            log.info("node %s reports (pool peer %d)", node, peer)
            self.pool.peer_joined(peer)
        for (service, uid), since in report.idle.items():
            self.pool.peer_idle(peer, service, uid, since)
        if self.on_change is not None:
            self.on_change(node)

    def _left(self, node: str) -> None:
        if self.table.remove(node):
            log.info("node %s no longer reports: it holds nothing", node)
            self.pool.peer_left(self.table.number(node))
            if self.on_change is not None:
                self.on_change(node)

    def __repr__(self) -> str:
        return f"<Peers {self.prefix} nodes={self.nodes} requests={self.requests}>"


def _guarded(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_unexpected_end)
    return task


def _log_unexpected_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s ended unexpectedly", task.get_name(), exc_info=task.exception())


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    await asyncio.wait([task])  # its CancelledError stays in it; ours, if any, goes on
