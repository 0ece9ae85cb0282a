"""ClusterBackend: the leader's backend, whose replicas run on the cluster's nodes.

The leader places a replica by writing its placement (``replicas``: the keys) for a node with
room (``placement.place``), fenced by its leadership, and hears back from that node's agent
(``agent``): a running record, a failed record, then one day an exit record. What it knows
comes from six feeds (``feed.Feed``: loaded, then watched): nodes, capacities, placements,
running, failed and exit records.

Invariants:
- Every write is one transaction carrying ``fence()``: a deposed leader places, stops and
  cleans up nothing. A refused fence raises ``Deposed``.
- Each replica's exit is reported once to the exit handler: from its exit record, or as
  "node NAME is gone" when the node's key disappears (its lease ended); then its records are
  removed (fenced). Exit records of replicas that are not placed (withdrawn starts, replicas
  already reported gone) are removed without a report. A gone node's running records stay
  (it adopts and stops its replicas if it comes back) until it has been gone ``forget_after``
  seconds (``books.forgotten``): then they are deleted, fenced.
- ``start`` returns only on the node's answer, or raises; with no answer within
  ``answer_timeout`` the placement is withdrawn (the node stops the replica if it started it).
- Nothing is decided before every feed has loaded once (``open``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from controller.backends.base import Exit, ExitHandler, Launch, Running
from controller.cluster.books import Books, change_record, forgotten, load_records
from controller.cluster.feed import RETRY, Feed
from controller.cluster.placement import NoRoom, place
from controller.cluster.replicas import (
    CapacityRecord,
    ExitRecord,
    FailedRecord,
    Keys,
    Placement,
    RunningRecord,
)
from controller.errors import BackendError, Deposed, NoCapacity, StartFailed
from controller.etcd import (
    Compare,
    Delete,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Get,
    Op,
    Put,
)
from controller.tasks import cancel_task, guarded_task

if TYPE_CHECKING:
    from controller.backends.base import Backend

log = logging.getLogger(__name__)

ANSWER_TIMEOUT = 15.0
"""Seconds a node has to answer a placement (it spawns the replica, then writes)."""
NO_CAPACITY_RETRY_AFTER = 5.0

Fence = Callable[[], list[Compare]]


@dataclass(eq=False)
class _Start:
    """A start waiting for the node's answer."""

    placement: Placement
    answer: asyncio.Future[Running]
    exit: ExitRecord | None = None
    """An exit record seen before the running record (two watches, no common order)."""


def _conforms(backend: ClusterBackend) -> Backend:  # pragma: no cover - checked by mypy
    return backend


class ClusterBackend:
    """A Backend over the cluster's nodes; used by the leader. ``open`` before use."""

    name: str = "cluster"

    def __init__(
        self,
        client: EtcdClient,
        prefix: str | bytes,
        fence: Fence,
        *,
        answer_timeout: float = ANSWER_TIMEOUT,
        retry: tuple[float, float] = RETRY,
        absent_grace: float = 0.0,
        forget_after: float = 600.0,
    ) -> None:
        self.client = client
        self.absent_grace = absent_grace
        """Seconds a node with placements may be missing when the backend opens (its lease
        ended while etcd was away, and it registers again once etcd is back) before its
        replicas count as gone. A node whose key disappears later is gone at once."""
        self.forget_after = forget_after
        """Seconds a gone node's running records are kept before they are deleted."""
        self._gone_at: dict[str, float] = {}
        """When each gone node was seen gone (loop time), until its records are forgotten."""
        self.keys = Keys.of(prefix)
        self.fence = fence
        """The compares of the leadership, put in every write; raises Deposed when the node
        does not lead."""
        self.answer_timeout = answer_timeout
        self.retry = retry
        self._books = Books()
        self._starts: dict[str, _Start] = {}
        self._ended: dict[str, asyncio.Future[None]] = {}
        """Stops waiting for the replica's exit report."""
        self._retired: set[str] = set()
        """Replicas reported ended or withdrawn, until their placement's delete is seen: an
        older write of their placement, seen late, does not bring them back."""
        self._exit_handler: ExitHandler | None = None
        self._feeds = self._make_feeds()
        self._tasks: list[asyncio.Task[None]] = []
        self._cleanups: dict[str, list[Op]] = {}
        self._cleanup_wake = asyncio.Event()
        self._settled = False
        self._closed = False
        self._changed = asyncio.Event()

    def _make_feeds(self) -> list[Feed]:
        keys = self.keys
        b = self._books
        feeds = [
            (keys.nodes, self._nodes_loaded, self._node_changed),
            (
                keys.capacity,
                lambda kvs: load_records(b.capacity, kvs, CapacityRecord.from_json),
                lambda name, raw: change_record(b.capacity, name, raw, CapacityRecord.from_json),
            ),
            (keys.placements(), self._placements_loaded, self._placement_changed),
            (keys.running, self._running_loaded, self._running_changed),
            (keys.failed, self._failed_loaded, self._failed_changed),
            (keys.exits, self._exits_loaded, self._exit_changed),
        ]
        return [
            Feed(self.client, prefix, self._told(on_load), self._told(on_change), retry=self.retry)
            for prefix, on_load, on_change in feeds
        ]

    def _told(self, callback: Callable[..., None]) -> Callable[..., None]:
        """``callback``, then wake those who ``wait``."""

        def told(*args: Any) -> None:
            callback(*args)
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

        return told

    async def wait(self, predicate: Callable[[ClusterBackend], bool]) -> None:
        """Return once ``predicate(self)`` holds (checked after every change a feed tells)."""
        while not predicate(self):
            await self._changed.wait()

    @property
    def nodes(self) -> dict[str, CapacityRecord | None]:
        """The live nodes, each with its agent's capacity record (None: no agent)."""
        b = self._books
        return {node: b.capacity.get(node) for node in sorted(b.nodes)}

    def placed(self) -> dict[str, str]:
        """Each placed replica's node."""
        return {rid: p.node for rid, p in self._books.placements.items()}

    def __repr__(self) -> str:
        b = self._books
        return (
            f"<ClusterBackend nodes={sorted(b.nodes)} placed={len(b.placements)} "
            f"running={len(b.running)} starting={len(self._starts)} in_use={self.in_use} "
            f"capacity={self.capacity}{' closed' if self._closed else ''}>"
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> None:
        """Start the feeds; return once each has loaded (adopt reads what they loaded)."""
        if not self._tasks:
            for i, feed in enumerate(self._feeds):
                self._tasks.append(guarded_task(feed.run(), f"cluster-backend:feed:{i}"))
            self._tasks.append(guarded_task(self._clean(), "cluster-backend:cleanup"))
        await asyncio.gather(*(feed.loaded.wait() for feed in self._feeds))
        self._settle()

    async def close(self) -> None:
        """Stop watching; the replicas keep running on their nodes."""
        self._closed = True
        for task in self._tasks:
            await cancel_task(task)
        self._tasks.clear()
        for start in self._starts.values():
            if not start.answer.done():
                start.answer.set_exception(StartFailed("the cluster backend closed"))
        for ended in self._ended.values():
            if not ended.done():
                ended.set_exception(BackendError("the cluster backend closed"))

    # -- the Backend protocol ----------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        total = 0
        for node in self._live():
            record = self._books.capacity.get(node)
            if record is None:
                continue
            if record.capacity is None:
                return None
            total += record.capacity
        return total

    @property
    def in_use(self) -> int:
        return sum(self._books.in_use(node) for node in self._live())

    def set_exit_handler(self, handler: ExitHandler) -> None:
        self._exit_handler = handler

    async def start(self, launch: Launch) -> Running:
        """Place the replica on a node with room and wait for that node's answer."""
        if self._closed:
            raise StartFailed("the cluster backend is closed")
        rid = launch.replica_id
        if rid in self._books.placements or rid in self._starts:
            raise StartFailed(f"replica {rid} is already placed")
        chosen = place(self._books.loads(launch))
        if isinstance(chosen, NoRoom):
            raise NoCapacity(chosen.reason, retry_after=NO_CAPACITY_RETRY_AFTER)
        placement = Placement(chosen, launch)
        fence = self.fence()  # Deposed: nothing written
        start = _Start(placement, asyncio.get_running_loop().create_future())
        # Held from now on: a concurrent start counts this one in the node's load.
        self._starts[rid] = start
        self._books.placements[rid] = placement
        try:
            await self._place(placement, fence)
        except (StartFailed, Deposed):
            self._starts.pop(rid, None)  # not written: nothing to withdraw
            if self._books.placements.get(rid) is placement:
                del self._books.placements[rid]
            raise
        except BaseException:  # cancelled: it may have been written
            self._starts.pop(rid, None)
            self._withdraw(placement)
            raise
        try:
            async with asyncio.timeout(self.answer_timeout):
                running = await asyncio.shield(start.answer)
        except TimeoutError:
            self._withdraw(placement)
            raise StartFailed(
                f"node {chosen} did not answer within {self.answer_timeout:g} s"
            ) from None
        except BaseException:
            self._withdraw(placement)
            raise
        finally:
            self._starts.pop(rid, None)
            if start.exit is not None:
                exit_record = start.exit
                asyncio.get_running_loop().call_soon(self._on_exit, rid, exit_record)
        return running

    async def _place(self, placement: Placement, fence: list[Compare]) -> None:
        node, rid = placement.node, placement.launch.replica_id
        key = self.keys.placement(node, rid)
        node_key = self.keys.node(node)
        compare = [
            *fence,
            Compare(key, "CREATE", "EQUAL", 0),
            Compare(node_key, "CREATE", "GREATER", 0),
        ]
        success: list[Op] = [
            Put(key, placement.to_json()),
            Delete(self.keys.running_key(rid)),
            Delete(self.keys.failed_key(rid)),
            Delete(self.keys.exit_key(rid)),
        ]
        try:
            result = await self.client.txn(compare, success, [Get(key), Get(node_key)])
        except EtcdUnavailable as e:
            # It may have been written: the node's answer (or the timeout) tells.
            log.warning("placing %s on %s: %s; waiting for an answer", rid, node, e)
            return
        except EtcdError as e:
            raise StartFailed(f"placing {rid} on {node}: {e}") from e
        if result.succeeded:
            log.info("placed %s on node %s", rid, node)
            return
        placed, alive = result.ranges
        if placed:
            raise StartFailed(f"replica {rid} is already placed")
        if not alive:
            raise StartFailed(f"node {node} is gone")
        raise Deposed(f"placing {rid}: the leadership fence was refused")

    def _withdraw(self, placement: Placement) -> None:
        rid = placement.launch.replica_id
        current = self._books.placements.get(rid)
        if current is not None and current.node == placement.node:
            del self._books.placements[rid]
        self._retired.add(rid)
        # Its records go too; a node that started it late sees the placement go and stops it.
        self._cleanup(rid, self._record_deletes(rid, placement.node))

    async def stop(self, replica_id: str, grace: float) -> None:
        """Ask its node to stop the replica (fenced); return once its exit was reported."""
        placement = self._books.placements.get(replica_id)
        if placement is None or replica_id in self._retired:
            return
        ended = self._ended.get(replica_id)
        if ended is None:
            ended = self._ended[replica_id] = asyncio.get_running_loop().create_future()
        if placement.stop is None:
            stopping = replace(placement, stop=max(grace, 0.0))
            key = self.keys.placement(placement.node, replica_id)
            compare = [*self.fence(), Compare(key, "CREATE", "GREATER", 0)]
            try:
                result = await self.client.txn(compare, [Put(key, stopping.to_json())], [Get(key)])
            except (EtcdUnavailable, EtcdError) as e:
                raise BackendError(f"stopping {replica_id} on {placement.node}: {e}") from e
            if not result.succeeded:
                if result.ranges and result.ranges[0]:
                    raise Deposed(f"stopping {replica_id}: the leadership fence was refused")
                return  # its placement is gone: it was reported, or is being
            if self._books.placements.get(replica_id) == placement:
                self._books.placements[replica_id] = stopping
        limit = max(grace, 0.0) + self.answer_timeout
        try:
            async with asyncio.timeout(limit):
                await asyncio.shield(ended)
        except TimeoutError:
            # Told as ended; the node, if it comes back, sees the placement gone and stops it.
            node = placement.node
            reason = f"node {node} did not report the stop within {limit:g} s"
            log.warning("replica %s: %s", replica_id, reason)
            self._books.placements.pop(replica_id, None)
            self._report(Exit(replica_id, None, reason, requested=True))
            self._cleanup(replica_id, self._placement_deletes(replica_id, node))

    def adopt(self, launch: Launch, handle: dict[str, Any]) -> Running | None:
        """The replica, if its node is alive, has its placement and says it runs it."""
        rid = launch.replica_id
        node = handle.get("node")
        b = self._books
        record = b.running.get(rid)
        placement = b.placements.get(rid)
        if (
            not isinstance(node, str)
            or node not in b.nodes
            or record is None
            or record.node != node
            or placement is None
            or placement.node != node
            or rid in b.exits
        ):
            return None
        return self._running(rid, record)

    def logs(self, replica_id: str, tail: int) -> list[str]:
        """Logs stay on the node that ran the replica: none here."""
        return []

    # -- what the feeds tell ------------------------------------------------------------------

    def _nodes_loaded(self, kvs: dict[str, bytes]) -> None:
        self._books.nodes = set(kvs)
        if self._settled:
            self._settle()

    def _node_changed(self, name: str, raw: bytes | None) -> None:
        if raw is not None:
            self._books.nodes.add(name)
            self._gone_at.pop(name, None)
            return
        self._books.nodes.discard(name)
        if self._settled:
            self._node_gone(name)

    def _placements_loaded(self, kvs: dict[str, bytes]) -> None:
        placements: dict[str, Placement] = {}
        for name, raw in kvs.items():
            parsed = self._placement(name, raw)
            if parsed is not None:
                placements[parsed.launch.replica_id] = parsed
        self._retired &= set(placements)
        for rid in self._retired:
            del placements[rid]
        for rid, start in self._starts.items():  # not written yet, or the write not seen yet
            placements.setdefault(rid, start.placement)
        self._books.placements = placements

    def _placement_changed(self, name: str, raw: bytes | None) -> None:
        if raw is None:
            _, _, rid = name.partition("/")
            self._retired.discard(rid)
            if rid not in self._starts:
                self._books.placements.pop(rid, None)
            return
        parsed = self._placement(name, raw)
        if parsed is not None and parsed.launch.replica_id not in self._retired:
            self._books.placements[parsed.launch.replica_id] = parsed

    def _placement(self, name: str, raw: bytes) -> Placement | None:
        node, sep, rid = name.partition("/")
        parsed = Placement.from_json(node, raw) if sep else None
        if parsed is None or parsed.launch.replica_id != rid:
            return None
        return parsed

    def _running_loaded(self, kvs: dict[str, bytes]) -> None:
        load_records(self._books.running, kvs, RunningRecord.from_json)
        for rid, record in self._books.running.items():
            self._answer_running(rid, record)

    def _running_changed(self, rid: str, raw: bytes | None) -> None:
        change_record(self._books.running, rid, raw, RunningRecord.from_json)
        record = self._books.running.get(rid)
        if record is not None:
            self._answer_running(rid, record)

    def _answer_running(self, rid: str, record: RunningRecord) -> None:
        start = self._starts.get(rid)
        if start is not None and record.node == start.placement.node and not start.answer.done():
            start.answer.set_result(self._running(rid, record))

    def _failed_loaded(self, kvs: dict[str, bytes]) -> None:
        load_records(self._books.failed, kvs, FailedRecord.from_json)
        for rid, record in list(self._books.failed.items()):
            self._on_failed(rid, record)

    def _failed_changed(self, rid: str, raw: bytes | None) -> None:
        change_record(self._books.failed, rid, raw, FailedRecord.from_json)
        record = self._books.failed.get(rid)
        if record is not None:
            self._on_failed(rid, record)

    def _on_failed(self, rid: str, record: FailedRecord) -> None:
        start = self._starts.get(rid)
        if start is not None and record.node == start.placement.node:
            if not start.answer.done():
                error: Exception
                if record.kind == "no_capacity":
                    message = f"node {record.node}: {record.message}"
                    error = NoCapacity(message, retry_after=record.retry_after)
                else:
                    error = StartFailed(f"node {record.node}: {record.message}")
                start.answer.set_exception(error)
            return  # start() withdraws the placement; this record goes with it
        if start is None and self._settled:
            self._books.placements.pop(rid, None)
            self._retired.add(rid)
            self._cleanup(rid, self._record_deletes(rid, record.node))

    def _exits_loaded(self, kvs: dict[str, bytes]) -> None:
        load_records(self._books.exits, kvs, ExitRecord.from_json)
        if self._settled:
            self._settle()

    def _exit_changed(self, rid: str, raw: bytes | None) -> None:
        change_record(self._books.exits, rid, raw, ExitRecord.from_json)
        record = self._books.exits.get(rid)
        if record is not None and self._settled:
            self._on_exit(rid, record)

    # -- deciding -----------------------------------------------------------------------------

    def _settle(self) -> None:
        """Once every feed has loaded: act on the exits and the gone nodes seen so far."""
        if not all(feed.loaded.is_set() for feed in self._feeds):
            return
        self._settled = True
        for rid, record in list(self._books.exits.items()):
            self._on_exit(rid, record)
        for rid, failed in list(self._books.failed.items()):
            if rid not in self._starts:
                self._books.placements.pop(rid, None)
                self._retired.add(rid)
                self._cleanup(rid, self._record_deletes(rid, failed.node))
        placed_on = {p.node for p in self._books.placements.values()}
        for node in sorted(placed_on - self._books.nodes):
            if self.absent_grace > 0:
                asyncio.get_running_loop().call_later(self.absent_grace, self._absent, node)
            else:
                self._node_gone(node)
        for held in self._books.running.values():  # nodes gone before this term
            if held.node not in self._books.nodes:
                self._gone(held.node)

    def _gone(self, node: str) -> None:
        """``node`` is seen gone: its running records are forgotten ``forget_after`` on."""
        if node in self._gone_at:
            return
        loop = asyncio.get_running_loop()
        self._gone_at[node] = loop.time()
        loop.call_later(self.forget_after, self._forget)

    def _forget(self) -> None:
        if self._closed:
            return
        now = asyncio.get_running_loop().time()
        books = self._books
        for rid in forgotten(books.running, books.nodes, self._gone_at, now, self.forget_after):
            node = books.running[rid].node
            log.info("replica %s: its record forgotten (node %s gone for long)", rid, node)
            self._cleanup(rid, [Delete(self.keys.running_key(rid))])
        for node in list(self._gone_at):
            if now - self._gone_at[node] >= self.forget_after:
                del self._gone_at[node]

    def _absent(self, node: str) -> None:
        """A node missing since the backend opened: gone if it has not registered again."""
        if not self._closed and node not in self._books.nodes:
            self._node_gone(node)

    def _on_exit(self, rid: str, record: ExitRecord) -> None:
        start = self._starts.get(rid)
        if start is not None:
            if record.node == start.placement.node:
                start.exit = record  # reported once start() returns
            return
        placement = self._books.placements.pop(rid, None)
        if placement is not None and placement.node == record.node:
            self._report(record.exit(rid))
        elif placement is not None:
            self._books.placements[rid] = placement  # an older life's record elsewhere
        self._cleanup(rid, self._record_deletes(rid, record.node))

    def _node_gone(self, node: str) -> None:
        """The node's key is gone (its lease ended): so are its replicas."""
        log.warning("node %s is gone", node)
        self._gone(node)
        for start in list(self._starts.values()):
            if start.placement.node == node and not start.answer.done():
                start.answer.set_exception(StartFailed(f"node {node} is gone"))
        for rid, placement in list(self._books.placements.items()):
            if placement.node != node or rid in self._starts:
                continue
            del self._books.placements[rid]
            reason = f"node {node} is gone"
            self._report(Exit(rid, None, reason, requested=placement.stop is not None))
            self._cleanup(rid, self._placement_deletes(rid, node))

    def _report(self, event: Exit) -> None:
        rid = event.replica_id
        if rid in self._retired:
            return
        self._retired.add(rid)
        log.info("replica %s: %s", rid, event.reason)
        if self._exit_handler is not None:
            try:
                self._exit_handler(event)
            except Exception:
                log.exception("exit handler failed for replica %s", rid)
        ended = self._ended.pop(rid, None)
        if ended is not None and not ended.done():
            ended.set_result(None)

    def _placement_deletes(self, rid: str, node: str) -> list[Op]:
        """All but the running record: a node that comes back adopts and stops the replica."""
        return [
            Delete(self.keys.placement(node, rid)),
            Delete(self.keys.failed_key(rid)),
            Delete(self.keys.exit_key(rid)),
        ]

    def _record_deletes(self, rid: str, node: str) -> list[Op]:
        return [
            Delete(self.keys.placement(node, rid)),
            Delete(self.keys.running_key(rid)),
            Delete(self.keys.failed_key(rid)),
            Delete(self.keys.exit_key(rid)),
        ]

    # -- cleaning up --------------------------------------------------------------------------

    def _cleanup(self, rid: str, ops: list[Op]) -> None:
        """Delete these keys (fenced), soon; retried while etcd is unreachable."""
        held = self._cleanups.setdefault(rid, [])
        held.extend(op for op in ops if op not in held)
        self._cleanup_wake.set()

    async def _clean(self) -> None:
        pause = self.retry[0]
        while True:
            await self._cleanup_wake.wait()
            self._cleanup_wake.clear()
            while self._cleanups:
                rid, ops = next(iter(self._cleanups.items()))
                try:
                    fence = self.fence()
                    result = await self.client.txn(fence, ops)
                except Deposed as e:
                    log.info("not cleaning up after %s: %s", rid, e)
                    self._cleanups.clear()
                    break
                except (EtcdUnavailable, EtcdError) as e:
                    log.warning("cleaning up after %s: %s; again in %.1f s", rid, e, pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, self.retry[1])
                    continue
                pause = self.retry[0]
                if self._cleanups.get(rid) is ops:
                    del self._cleanups[rid]
                if not result.succeeded:
                    log.info("not cleaning up after %s: the leadership fence was refused", rid)
                    self._cleanups.clear()
                    break

    # -- helpers ------------------------------------------------------------------------------

    def _live(self) -> Iterable[str]:
        return sorted(self._books.nodes)

    def _running(self, rid: str, record: RunningRecord) -> Running:
        return Running(
            replica_id=rid,
            host=record.host,
            port=record.port,
            pid=record.pid,
            handle={"node": record.node, **record.handle},
        )


__all__ = ["ANSWER_TIMEOUT", "ClusterBackend", "Fence"]
