"""Agent: runs the replicas the leader placed on this node, through the node's own backend.

The agent reads ``<prefix>placements/<node>/`` (``replicas``: the keys) whole, then watches it
(no polling), and answers through records it writes itself (not fenced: the placements are):
running, failed, and exit records, and its capacity, bound to the node's lease.

Invariants:
- A replica is started only for a placement without ``stop`` and without an answer yet; it is
  stopped only because its placement says so (``stop`` set: that grace) or is gone (the
  default grace). With etcd unreachable nothing is started or stopped: the watch resumes
  where it was (a compacted revision: everything is loaded again and compared).
- Every record is written in order, retried until etcd takes it: a replica that exits while
  etcd is away gets its exit record once etcd is back. The exit record's write deletes the
  running record.
- After a restart, the replicas of this node's running records are adopted (or, gone, get an
  exit record), and those whose placements are gone or stopping are stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from controller.backends.base import Backend, Exit, Launch, Running
from controller.cluster.feed import RETRY
from controller.cluster.replicas import (
    CapacityRecord,
    ExitRecord,
    FailedRecord,
    Keys,
    Placement,
    RunningRecord,
)
from controller.errors import ControllerError, NoCapacity
from controller.etcd import (
    Compacted,
    Delete,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Get,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    WatchEvent,
)
from controller.spec import ReplicaTemplate
from controller.tasks import cancel_task, guarded_task

log = logging.getLogger(__name__)
R = TypeVar("R", RunningRecord, FailedRecord, ExitRecord)

STOP_GRACE = 10.0
"""Seconds between SIGTERM and SIGKILL for a replica whose placement was deleted."""


@dataclass(eq=False)
class _Local:
    """A replica this agent started or adopted, until its exit is recorded."""

    launch: Launch
    starting: bool = True
    stop: float | None = None
    """The grace of the stop asked for (None: none asked)."""
    stopping: bool = False
    exit: Exit | None = None
    """An exit reported while ``starting``: recorded after the running record."""


@dataclass(eq=False)
class _Outbox:
    """Writes in order; the capacity record rides separately (only its latest counts)."""

    items: list[list[Op]] = field(default_factory=list)
    capacity_dirty: bool = True
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Agent:
    """This node's side of the replicas: see the module docstring. ``open``, then ``close``."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str | bytes,
        node: str,
        backend: Backend,
        lease: Callable[[], int],
        *,
        stop_grace: float = STOP_GRACE,
        retry: tuple[float, float] = RETRY,
    ) -> None:
        self.client = client
        self.keys = Keys.of(prefix)
        self.node = node
        self.backend = backend
        self.lease = lease
        """The node's current lease (0: none now); the capacity record is bound to it."""
        self.stop_grace = stop_grace
        self.retry = retry
        self.revision = 0
        self.loaded = asyncio.Event()
        self._placements: dict[str, Placement] = {}
        self._local: dict[str, _Local] = {}
        self._answered: set[str] = set()
        """Replicas with a failed or exit record: not started again while placed."""
        self._outbox = _Outbox()
        self._tasks: list[asyncio.Task[None]] = []
        self._work: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return (
            f"<Agent {self.node} placed={len(self._placements)} local={len(self._local)} "
            f"outbox={len(self._outbox.items)} revision={self.revision}>"
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> None:
        """Start watching the placements; return once they were loaded and acted on."""
        self.backend.set_exit_handler(self._on_exit)
        if not self._tasks:
            self._tasks.append(guarded_task(self._watch(), f"agent:{self.node}:watch"))
            self._tasks.append(guarded_task(self._flush(), f"agent:{self.node}:outbox"))
        await self.loaded.wait()

    async def close(self) -> None:
        """Stop watching and writing; the replicas keep running (a restart adopts them)."""
        for task in [*self._tasks, *self._work]:
            await cancel_task(task)
        self._tasks.clear()

    async def stop_all(self, grace: float | None = None) -> None:
        """Stop every replica this node runs (a node leaving for good: ``replicas_on_exit:
        stop``), their exit records written (not requested: the leader places them again
        elsewhere) before it returns, as far as etcd takes them."""
        grace = self.stop_grace if grace is None else grace
        await asyncio.gather(
            *(self.backend.stop(rid, grace) for rid in list(self._local)),
            return_exceptions=True,
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                while self._outbox.items:  # noqa: ASYNC110 - no "written" event; bounded
                    await asyncio.sleep(0.02)

    def republish(self) -> None:
        """Write the capacity record again (call it when the node has a new lease)."""
        self._outbox.capacity_dirty = True
        self._outbox.wake.set()

    # -- loading and watching -----------------------------------------------------------------

    async def _watch(self) -> None:
        pause = self.retry[0]
        load = True
        prefix = self.keys.placements(self.node)
        while True:
            try:
                if load:
                    await self._load()
                    load = False
                watch = self.client.watch(prefix, prefix=True, start_revision=self.revision + 1)
                pause = self.retry[0]
                async for events in watch:
                    for event in events:
                        self._on_event(event)
                        self.revision = max(self.revision, event.kv.mod_revision)
            except Compacted:
                log.info("agent %s: revision %d compacted, loading again", self.node, self.revision)
                load = True
            except (EtcdUnavailable, EtcdError) as e:
                log.warning("agent %s: etcd: %s; again in %.1f s", self.node, e, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.retry[1])

    async def _load(self) -> None:
        """Placements and this node's records, at one revision; then make them agree."""
        keys = self.keys
        gets: list[Op] = [
            Get(keys.placements(self.node), prefix=True),
            Get(keys.running, prefix=True),
            Get(keys.failed, prefix=True),
            Get(keys.exits, prefix=True),
        ]
        result = await self.client.txn([], gets)
        placed_kvs, running_kvs, failed_kvs, exit_kvs = result.ranges
        placements = {}
        for kv in placed_kvs:
            placement = self._parse(kv)
            if placement is not None:
                placements[placement.launch.replica_id] = placement
        running = self._mine(running_kvs, keys.running, RunningRecord.from_json)
        answered = set(self._mine(failed_kvs, keys.failed, FailedRecord.from_json))
        answered |= set(self._mine(exit_kvs, keys.exits, ExitRecord.from_json))
        self._placements = placements
        # Kept from before a reload too: an answer still in the outbox is not in etcd yet.
        self._answered = {rid for rid in answered | self._answered if rid in placements}
        self.revision = result.revision
        for rid, record in running.items():
            if rid not in self._local and rid not in self._answered:
                self._adopt(rid, record)
        for rid, local in list(self._local.items()):
            placement = placements.get(rid)
            if placement is None or placement.stop is not None:
                self._stop(rid, local, placement)
        for placement in placements.values():
            self._act(placement)
        self._outbox.capacity_dirty = True
        self._outbox.wake.set()
        self.loaded.set()

    def _mine(
        self, kvs: list[KeyValue], base: bytes, parse: Callable[[bytes], R | None]
    ) -> dict[str, R]:
        records = {}
        for kv in kvs:
            record = parse(kv.value)
            if record is not None and record.node == self.node:
                records[kv.key[len(base) :].decode(errors="replace")] = record
        return records

    def _parse(self, kv: KeyValue) -> Placement | None:
        split = self.keys.split_placement(kv.key)
        if split is None or split[0] != self.node:
            return None
        placement = Placement.from_json(self.node, kv.value)
        if placement is None or placement.launch.replica_id != split[1]:
            return None
        return placement

    def _on_event(self, event: WatchEvent) -> None:
        if event.type == "DELETE":
            split = self.keys.split_placement(event.kv.key)
            if split is None:
                return
            rid = split[1]
            self._placements.pop(rid, None)
            self._answered.discard(rid)
            local = self._local.get(rid)
            if local is not None:
                self._stop(rid, local, None)
            return
        placement = self._parse(event.kv)
        if placement is not None:
            self._placements[placement.launch.replica_id] = placement
            self._act(placement)

    def _act(self, placement: Placement) -> None:
        """What a placement asks of this node now."""
        rid = placement.launch.replica_id
        local = self._local.get(rid)
        if local is not None:
            if placement.stop is not None:
                self._stop(rid, local, placement)
        elif rid in self._answered:
            pass
        elif placement.stop is not None:
            # Asked to stop what does not run here (it ended while the agent was away).
            self._record_exit(rid, Exit(rid, None, "not running on the node", requested=True))
        else:
            # Held before the first await: a stop in the same batch finds it.
            local = self._local[rid] = _Local(placement.launch)
            self._spawn(self._start(rid, local), f"agent:{self.node}:start:{rid}")

    # -- running replicas ---------------------------------------------------------------------

    async def _start(self, rid: str, local: _Local) -> None:
        launch = local.launch
        try:
            running = await self.backend.start(launch)
        except NoCapacity as e:
            failed = FailedRecord(self.node, "no_capacity", e.message, e.retry_after)
            self._record_failed(rid, failed)
            return
        except ControllerError as e:
            self._record_failed(rid, FailedRecord(self.node, "start_failed", e.message))
            return
        except Exception as e:
            log.exception("agent %s: starting %s", self.node, rid)
            self._record_failed(rid, FailedRecord(self.node, "start_failed", str(e)))
            return
        finally:
            local.starting = False
        self._record_running(rid, launch, running)
        if local.exit is not None:
            self._on_exit(local.exit)
        elif local.stop is not None:
            self._stop(rid, local, self._placements.get(rid))

    def _adopt(self, rid: str, record: RunningRecord) -> None:
        placement = self._placements.get(rid)
        if placement is not None:
            launch = placement.launch
        else:
            launch = Launch(record.service, record.revision, rid, ReplicaTemplate())
        running = self.backend.adopt(launch, record.handle)
        if running is None:
            requested = placement is None or placement.stop is not None
            reason = "exited while the node's agent was away"
            self._record_exit(rid, Exit(rid, None, reason, requested))
            return
        self._local[rid] = _Local(launch, starting=False)
        log.info("agent %s: adopted %s", self.node, rid)

    def _stop(self, rid: str, local: _Local, placement: Placement | None) -> None:
        grace = placement.stop if placement is not None else None
        local.stop = self.stop_grace if grace is None else grace
        if local.starting or local.stopping:
            return  # _start stops it once started
        local.stopping = True
        self._spawn(self.backend.stop(rid, local.stop), f"agent:{self.node}:stop:{rid}")

    def _on_exit(self, event: Exit) -> None:
        """The local backend's exit handler."""
        rid = event.replica_id
        local = self._local.get(rid)
        if local is not None and local.starting:
            local.exit = event
            return
        self._local.pop(rid, None)
        self._record_exit(rid, event)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = guarded_task(coro, name)
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    # -- records ------------------------------------------------------------------------------

    def _record_running(self, rid: str, launch: Launch, running: Running) -> None:
        record = RunningRecord(
            node=self.node,
            service=launch.service,
            revision=launch.revision,
            host=running.host,
            port=running.port,
            pid=running.pid,
            handle=running.handle,
        )
        self._send([Put(self.keys.running_key(rid), record.to_json())])

    def _record_failed(self, rid: str, record: FailedRecord) -> None:
        self._local.pop(rid, None)
        self._answered.add(rid)
        log.info("agent %s: could not start %s: %s", self.node, rid, record.message)
        self._send([Put(self.keys.failed_key(rid), record.to_json())])

    def _record_exit(self, rid: str, event: Exit) -> None:
        self._answered.add(rid)
        record = ExitRecord(self.node, event.code, event.reason, event.requested)
        self._send(
            [Put(self.keys.exit_key(rid), record.to_json()), Delete(self.keys.running_key(rid))]
        )

    def _send(self, ops: list[Op]) -> None:
        self._outbox.items.append(ops)
        self._outbox.capacity_dirty = True
        self._outbox.wake.set()

    async def _flush(self) -> None:
        outbox = self._outbox
        pause = self.retry[0]
        while True:
            await outbox.wake.wait()
            outbox.wake.clear()
            while outbox.items or outbox.capacity_dirty:
                try:
                    if outbox.items:
                        await self.client.txn([], outbox.items[0])
                        outbox.items.pop(0)
                    elif not await self._write_capacity():
                        break  # no lease now: republish() or the next write tries again
                except (EtcdUnavailable, EtcdError) as e:
                    log.warning("agent %s: writing: %s; again in %.1f s", self.node, e, pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, self.retry[1])
                    continue
                pause = self.retry[0]

    async def _write_capacity(self) -> bool:
        lease = self.lease()
        if not lease:
            return False
        self._outbox.capacity_dirty = False
        record = CapacityRecord(self.backend.capacity, self.backend.in_use)
        try:
            await self.client.put(self.keys.capacity_key(self.node), record.to_json(), lease=lease)
        except LeaseNotFound:
            if self.lease() == lease:
                return False  # the node gets a new lease and calls republish()
            self._outbox.capacity_dirty = True
            return True
        except BaseException:
            self._outbox.capacity_dirty = True
            raise
        return True


__all__ = ["STOP_GRACE", "Agent"]
