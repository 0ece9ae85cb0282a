"""NodeRegistry: this node's registration, and a watch-fed view of the live nodes.

Each node keeps ``<prefix>nodes/<name>`` → a JSON ``NodeRecord`` bound to its lease, so a node
that dies disappears from the cluster by itself once its lease ends: nobody has to notice it.
The registry puts its record again with every new lease (the old lease took the key with it),
after ``update`` and when someone deleted it.

The view is one read of the prefix and a watch from the revision after it (no polling); a
compacted watch reloads, an unreachable etcd keeps the last view and tries again. Each change
makes a new ``nodes`` mapping, never changed afterwards, so readers hold it without a lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any

from controller.cluster.lease import LeaseEvent, LeaseKeeper
from controller.etcd import (
    Compacted,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    LeaseNotFound,
    WatchEvent,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node says of itself under ``<prefix>nodes/<name>``."""

    name: str
    address: str
    """The URL of its admin API (other nodes forward requests there)."""
    listen: tuple[str, ...] = ()
    """The addresses its listeners serve traffic on."""
    started_at: float = 0.0
    """Wall-clock seconds (Unix time) the process started."""
    capacity: int | None = None
    """How many replicas it can run (None: not said)."""
    replicas: int | None = None
    """How many replicas it runs now (None: not reported)."""
    lease: int = field(default=0, compare=False)
    """The lease the key is bound to (read from etcd, not written in the JSON)."""

    def to_json(self) -> bytes:
        data = asdict(self)
        del data["lease"]
        data["listen"] = list(self.listen)
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_kv(cls, kv: KeyValue) -> NodeRecord | None:
        """The record of ``kv``; None (logged) when it is not one. Unknown fields are
        ignored, so a newer node's record still reads."""
        try:
            data = json.loads(kv.value)
            return cls(
                name=str(data["name"]),
                address=str(data["address"]),
                listen=tuple(str(a) for a in data.get("listen", ())),
                started_at=float(data.get("started_at", 0.0)),
                capacity=_optional_int(data.get("capacity")),
                replicas=_optional_int(data.get("replicas")),
                lease=kv.lease,
            )
        except (ValueError, KeyError, TypeError) as e:
            log.warning("not a node record at %r: %s", kv.key, e)
            return None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


NodesListener = Callable[[Mapping[str, NodeRecord]], None]


def nodes_prefix(prefix: str | bytes) -> bytes:
    raw = prefix.encode() if isinstance(prefix, str) else prefix
    return raw + (b"" if raw.endswith(b"/") else b"/") + b"nodes/"


class NodeRegistry:
    """Registers this node (``me``) under its lease and watches the others."""

    def __init__(
        self,
        client: EtcdClient,
        keeper: LeaseKeeper,
        prefix: str | bytes,
        me: NodeRecord,
        *,
        retry: float | None = None,
    ) -> None:
        self.client = client
        self.keeper = keeper
        self.prefix = nodes_prefix(prefix)
        self.me = me
        self.key = self.prefix + me.name.encode()
        self.retry = keeper.retry if retry is None else retry
        self.nodes: Mapping[str, NodeRecord] = MappingProxyType({})
        """The live nodes by name, as last seen (kept while etcd is unreachable)."""
        self.revision = 0
        """The etcd revision the view is at."""
        self.registrations = 0
        self._version = 1  # of ``me``: bumped by update and when the key must be written again
        self._written = (0, 0)  # (lease, version) of the last successful put
        self._written_at = 0  # the etcd revision of that put
        self._put_sent = False
        """A put of our record was sent (so every written one was): it may be in etcd even if
        its answer never came."""
        self._deleted_at = 0
        """The latest revision at which the view saw our record deleted or missing: a put
        answered after the view saw a deletion that followed it is written again."""
        self._listeners: list[NodesListener] = []
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return (
            f"<NodeRegistry {self.me.name} nodes={sorted(self.nodes)} revision={self.revision}"
            f" registrations={self.registrations}>"
        )

    @property
    def registered(self) -> bool:
        """Our record is in etcd, bound to the current lease (as far as we know)."""
        return self.keeper.lease != 0 and self._written == (self.keeper.lease, self._version)

    def subscribe(self, listener: NodesListener) -> Callable[[], None]:
        """Call ``listener`` with the new ``nodes`` after every change."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    async def wait(self, predicate: Callable[[Mapping[str, NodeRecord]], bool]) -> None:
        """Return once ``predicate(nodes)`` holds (checked after every change of the view and
        every registration)."""
        while not predicate(self.nodes):
            await self._changed.wait()

    async def update(self, **changes: Any) -> None:
        """Change our record (``replicas=3``...); written with the current lease soon."""
        self.me = replace(self.me, **changes)
        self._rewrite()

    def start(self) -> None:
        if self._tasks:
            return
        self._unsubscribe = self.keeper.subscribe(self._on_lease)
        for coro, name in ((self._register(), "register"), (self._watch(), "watch")):
            task = asyncio.create_task(coro, name=f"cluster:nodes:{name}")
            task.add_done_callback(_ended)
            self._tasks.append(task)

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop; with ``deregister`` delete our record now (other nodes see us go at once,
        not when the lease ends)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        # Whenever a put was sent, answered or not (the stop may have cancelled the wait for
        # its answer): other nodes may see the record, and it would stay until the lease ends.
        if deregister and self._put_sent:
            try:
                await self.client.delete(self.key)
            except (EtcdUnavailable, EtcdError) as e:
                log.warning("%s: could not deregister (gone when its lease ends): %s", self.key, e)
        self._written = (0, 0)
        self._written_at = self._deleted_at = 0
        self._put_sent = False

    # --- registration ------------------------------------------------------------------------

    def _rewrite(self) -> None:
        self._version += 1
        self._wake.set()

    def _on_lease(self, event: LeaseEvent) -> None:
        if event.kind in ("granted", "restored", "lost"):
            self._wake.set()

    async def _register(self) -> None:
        while True:
            self._wake.clear()
            lease = await self.keeper.wait_valid()
            version = self._version
            if self._written != (lease, version):
                self._put_sent = True
                try:
                    revision = await self.client.put(self.key, self.me.to_json(), lease=lease)
                except LeaseNotFound:
                    self.keeper.report_lost(lease)
                    continue
                except (EtcdUnavailable, EtcdError) as e:
                    log.warning("%s: could not register: %s", self.me.name, e)
                    await asyncio.sleep(self.retry)
                    continue
                self._written = (lease, version)
                self._written_at = revision
                self.registrations += 1
                self._notify()
                log.info("node %s registered (lease %x)", self.me.name, lease)
                if self._deleted_at > revision:
                    self._rewrite()  # deleted after this put, seen before its answer came
            await self._wake.wait()

    # --- the view ----------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                kvs, revision = await self.client.get(self.prefix, prefix=True)
                self._reset(kvs, revision)
                async for batch in self.client.watch(
                    self.prefix, prefix=True, start_revision=revision + 1
                ):
                    self._apply(batch)
            except Compacted:
                continue  # reload at once
            except EtcdUnavailable as e:
                log.warning("%s: node view: %s", self.me.name, e)
            await asyncio.sleep(self.retry)

    def _reset(self, kvs: list[KeyValue], revision: int) -> None:
        nodes = {}
        for kv in kvs:
            record = self._record(kv)
            if record is not None:
                nodes[record.name] = record
        self.revision = revision
        if self.me.name not in nodes:
            self._deleted_at = max(self._deleted_at, revision)
            if self._written[0] and revision >= self._written_at:
                self._rewrite()  # deleted while the watch was down (see _apply)
        self._publish(nodes)

    def _apply(self, batch: list[WatchEvent]) -> None:
        nodes = dict(self.nodes)
        for event in batch:
            name = event.kv.key[len(self.prefix) :].decode(errors="replace")
            if event.type == "DELETE":
                nodes.pop(name, None)
                if event.kv.key == self.key:
                    self._deleted_at = max(self._deleted_at, event.kv.mod_revision)
                if self._deletes_ours(event.kv):
                    # Deleted by someone, or by the end of a lease: put it back (a put with
                    # a lease etcd dropped gets LeaseNotFound, and the keeper replaces it).
                    self._rewrite()
            else:
                record = self._record(event.kv)
                if record is not None:
                    nodes[name] = record
            self.revision = max(self.revision, event.kv.mod_revision)
        self._publish(nodes)

    def _deletes_ours(self, kv: KeyValue) -> bool:
        """A deletion of our record as last written: one older than our last put (the end of
        the lease that put replaced, seen late) deletes nothing that is there now."""
        return kv.key == self.key and self._written[0] != 0 and kv.mod_revision > self._written_at

    def _record(self, kv: KeyValue) -> NodeRecord | None:
        record = NodeRecord.from_kv(kv)
        name = kv.key[len(self.prefix) :].decode(errors="replace")
        if record is not None and record.name != name:
            log.warning("node record %r names %r: ignored", kv.key, record.name)
            return None
        return record

    def _publish(self, nodes: dict[str, NodeRecord]) -> None:
        self.nodes = MappingProxyType(nodes)
        for listener in list(self._listeners):
            try:
                listener(self.nodes)
            except Exception:
                log.exception("nodes listener failed")
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s ended", task.get_name(), exc_info=task.exception())
