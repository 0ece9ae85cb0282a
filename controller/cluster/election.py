"""Election: one leader among the nodes, through a leader record that it renews.

The key ``<prefix>leader`` holds the leader record (``leadership.Record``: name, term, TTL, the
holder's lease), bound to no lease: leadership never waits for etcd to expire one. The leader
rewrites it every TTL/3 with a transaction that compares the record's mod revision with the
one its last write made (a compare-and-swap). Every node watches the key; a follower takes over
when the record is absent, or once its mod revision has not changed for the record's TTL plus
a margin by the follower's own monotonic clock, with a transaction that compares the mod
revision it saw (``leadership``: the decisions and why they are safe). A leader's term ends by
its own clock too: it stops acting before any follower may take over.

The fence: every write the leader makes carries ``fence()`` (the record's value is still ours:
our name, term and lease) in the same transaction, so a write of a deposed leader fails in etcd
even if the node has not noticed yet: a takeover rewrites the value, a resignation deletes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from controller.cluster.leadership import Leadership, Record, Step, Transition
from controller.cluster.lease import LeaseEvent, LeaseKeeper
from controller.errors import Deposed
from controller.etcd import (
    Compacted,
    Compare,
    Delete,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Get,
    KeyValue,
    Put,
)

log = logging.getLogger(__name__)

LeadershipListener = Callable[[Transition], None]


def leader_key(prefix: str | bytes) -> bytes:
    raw = prefix.encode() if isinstance(prefix, str) else prefix
    return raw + (b"" if raw.endswith(b"/") else b"/") + b"leader"


class Election:
    """This node's side of the election. ``start`` it after its ``LeaseKeeper``: a node
    campaigns only with a valid lease (its registration, which other nodes need to reach it,
    is bound to it)."""

    def __init__(
        self,
        client: EtcdClient,
        keeper: LeaseKeeper,
        name: str,
        prefix: str | bytes,
        *,
        retry: float | None = None,
        margin: float | None = None,
    ) -> None:
        self.client = client
        self.keeper = keeper
        self.name = name
        self.key = leader_key(prefix)
        self.retry = keeper.retry if retry is None else retry
        self.state = Leadership(name, keeper.ttl, keeper.state.margin if margin is None else margin)
        self.campaigns = 0
        self.renewals = 0
        self._listeners: list[LeadershipListener] = []
        self._changed = asyncio.Event()
        """Set and replaced at every change of what this node knows of the leadership."""
        self._wake = asyncio.Event()
        self._unreachable = ""
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return (
            f"<Election {self.name} leading={self.leading} leader={self.leader} "
            f"term={self.state.term} campaigns={self.campaigns} renewals={self.renewals}>"
        )

    # --- what it knows -----------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        """This node leads now: its term runs, by its own clock."""
        return self.state.leading(self.keeper.now())

    @property
    def leader(self) -> str | None:
        """The name of the node that leads, as last seen (None: nobody, not known, or its
        record went silent past its TTL)."""
        return self.state.leader(self.keeper.now())

    @property
    def term(self) -> int:
        """Our term's number while we lead; 0 otherwise."""
        return self.state.term if self.leading else 0

    @property
    def reason(self) -> str:
        """Why this node does not lead (empty while it leads)."""
        if self.leading:
            return ""
        leader = self.leader
        if leader and leader != self.name:
            return f"{leader} leads"
        return self.state.reason or "not elected"

    def fence(self) -> list[Compare]:
        """The compares every write of the leader carries: the leader record is still the one
        this node's term wrote. Raises ``Deposed`` when this node does not lead now."""
        ours = self.state.ours
        if ours is None or not self.leading:
            raise Deposed(f"{self.name} does not lead: {self.reason}")
        return [Compare(self.key, "VALUE", "EQUAL", ours.encode())]

    # --- being told --------------------------------------------------------------------------

    def subscribe(self, listener: LeadershipListener) -> Callable[[], None]:
        """Call ``listener`` with every Transition (elected: leading True; deposed: False);
        they alternate. Returns the function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    async def elected(self) -> None:
        """Return once this node leads."""
        while not self.leading:
            await self._changed.wait()

    async def deposed(self) -> None:
        """Return once this node no longer leads (at once if it does not)."""
        while self.leading:
            # The deadline passes with no event if nothing runs (a paused loop): wake by then.
            left = self.state.deadline - self.keeper.now()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(left, 0.0)):
                    await self._changed.wait()
        self._apply(self.state.expire(self.keeper.now()))  # told before this returns

    async def wait_leader(self) -> str:
        """The name of the node that leads, once one does (as this node sees it)."""
        while (leader := self.leader) is None:
            await self._changed.wait()
        return leader

    # --- running -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._unsubscribe = self.keeper.subscribe(self._on_lease)
            self._task = asyncio.create_task(self._run(), name=f"cluster:election:{self.name}")
            self._task.add_done_callback(_ended)

    async def stop(self) -> None:
        """Stop campaigning, renewing and watching. A leader's term ends by its clock (the
        record stays until another node takes over: see resign)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def resign(self) -> None:
        """Stop, and if the leader record is this node's, delete it (compared with its value)
        so that another node leads at once rather than after the record's TTL."""
        await self.stop()
        ours = self.state.ours or self.state.wrote  # a term ended by the clock: still ours
        self._apply(self.state.resigned(self.keeper.now()))
        if ours is None:
            return
        try:
            result = await self.client.txn(
                [Compare(self.key, "VALUE", "EQUAL", ours.encode())], [Delete(self.key)]
            )
        except (EtcdUnavailable, EtcdError) as e:
            log.warning(
                "%s resigned; the leader record stays until another takes over: %s", self.name, e
            )
            return
        if result.succeeded:
            log.info("%s resigned the leadership", self.name)

    def _on_lease(self, event: LeaseEvent) -> None:
        self._wake.set()  # a new or restored lease: a campaign may be due

    async def _run(self) -> None:
        watcher = asyncio.create_task(self._watch(), name=f"cluster:election:{self.name}:watch")
        try:
            while True:
                self._wake.clear()
                now = self.keeper.now()
                self._apply(self.state.expire(now))
                lease = self.keeper.lease if self.keeper.valid() else 0
                step = self.state.decide(now, lease)
                if step.kind == "campaign":
                    await self._write(step, campaign=True)
                elif step.kind == "renew":
                    await self._write(step, campaign=False)
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, step.at - now)):
                            await self._wake.wait()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _write(self, step: Step, *, campaign: bool) -> None:
        """A campaign or a renewal: write ``step.record`` if the record's mod revision is
        still ``step.revision``; otherwise read the record as it is."""
        record = step.record
        assert record is not None
        if campaign:
            self.state.trying(record)
            self.campaigns += 1
        sent = self.keeper.now()
        try:
            result = await self.client.txn(
                [Compare(self.key, "MOD", "EQUAL", step.revision)],
                [Put(self.key, record.encode())],
                [Get(self.key)],
                within=step.within,
            )
        except (EtcdUnavailable, EtcdError) as e:
            # The write may have been applied: the watch will show it, and a record this
            # node wrote is taken back at once (or, while leading, renewed from its revision).
            why = f"{'campaign' if campaign else 'renewal'}: {e}"
            if why != self._unreachable:
                log.warning("%s: %s", self.name, why)
            self._unreachable = why
            # Writes start ``retry`` apart at most: one that waited out its time goes again
            # at once (rule 7), one refused at once waits.
            await asyncio.sleep(max(0.0, sent + self.retry - self.keeper.now()))
            return
        self._unreachable = ""
        now = self.keeper.now()
        if not result.succeeded:
            # Another's record, or ours written by an earlier attempt whose answer was lost:
            # observed, never counted from this attempt's send time.
            self._observe(result.ranges[-1] if result.ranges else [], result.revision)
        elif campaign:
            self._apply(self.state.won(record, result.revision, sent, now))
        else:
            self.renewals += 1
            self._apply(self.state.renewed(result.revision, sent, now))

    async def _watch(self) -> None:
        """Feed the record as it changes to the state: read it, then watch from there."""
        while True:
            try:
                kvs, revision = await self.client.get(self.key)
                self._observe(kvs, revision)
                async for batch in self.client.watch(self.key, start_revision=revision + 1):
                    for event in batch:
                        if event.type == "DELETE":
                            self._observe([], event.kv.mod_revision)
                        else:
                            self._observe([event.kv], event.kv.mod_revision)
            except Compacted:
                continue  # read it as it is now
            except (EtcdUnavailable, EtcdError) as e:
                log.info("%s: watching the leader record: %s", self.name, e)
                await asyncio.sleep(self.retry)

    def _observe(self, kvs: list[KeyValue], revision: int) -> None:
        """The record as read (``kvs`` empty: absent at ``revision``)."""
        now = self.keeper.now()
        if kvs:
            record: Record | None = Record.decode(kvs[0].value)
            revision = kvs[0].mod_revision
        else:
            record = None
        self._apply(self.state.observed(record, revision, now))
        self._wake.set()

    def _apply(self, transition: Transition | None) -> None:
        if transition is not None:
            if transition.leading:
                log.info("%s leads (term %d)", self.name, self.state.term)
            else:
                log.warning("%s no longer leads: %s", self.name, transition.reason)
            for listener in list(self._listeners):
                try:
                    listener(transition)
                except Exception:
                    log.exception("leadership listener failed")
        self._arm()
        self._notify()

    def _arm(self) -> None:
        """While a term runs, wake at its deadline to end it there even if the loop waits
        on etcd (a renewal hanging on an unreachable member)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.state.ours is not None:
            delay = max(0.0, self.state.deadline - self.keeper.now())
            self._timer = asyncio.get_running_loop().call_later(delay, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._timer = None
        self._apply(self.state.expire(self.keeper.now()))  # re-arms if a renewal came
        self._wake.set()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _ended(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the election ended", exc_info=task.exception())
