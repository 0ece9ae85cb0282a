"""Election: one leader among the nodes, through a key bound to the leader's lease.

The key ``<prefix>leader`` holds the leader's name, bound to its lease. A campaign is one
transaction: if the key does not exist (create revision 0), put our name with our lease; in
either branch read it back. The node leads when the key it reads is its own (name and current
lease, so a campaign retried after a timeout still wins); the key's create revision is the
term. Followers watch the key and campaign again once it is deleted (its lease ended, or the
leader resigned). A leader's term also ends by its own clock (``Leadership``, rule 1): it stops
acting before etcd lets another node win.

The fence: every write the leader makes carries ``fence()`` (the leader key's create revision
still equals its term) in the same transaction, so a write of a deposed leader fails in etcd
even if the node has not noticed yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from controller.cluster.leadership import Transition
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
    LeaseNotFound,
    Put,
)

log = logging.getLogger(__name__)

LeadershipListener = Callable[[Transition], None]


def leader_key(prefix: str | bytes) -> bytes:
    raw = prefix.encode() if isinstance(prefix, str) else prefix
    return raw + (b"" if raw.endswith(b"/") else b"/") + b"leader"


class Election:
    """This node's side of the election. ``start`` it after its ``LeaseKeeper``."""

    def __init__(
        self,
        client: EtcdClient,
        keeper: LeaseKeeper,
        name: str,
        prefix: str | bytes,
        *,
        retry: float | None = None,
    ) -> None:
        self.client = client
        self.keeper = keeper
        self.name = name
        self.key = leader_key(prefix)
        self.retry = keeper.retry if retry is None else retry
        self.campaigns = 0
        self._leader: str | None = None
        self._listeners: list[LeadershipListener] = []
        self._changed = asyncio.Event()
        """Set and replaced at every change of what this node knows of the leadership."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return (
            f"<Election {self.name} leading={self.leading} leader={self._leader} "
            f"term={self.keeper.state.term} campaigns={self.campaigns}>"
        )

    # --- what it knows -----------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        """This node leads now: its term runs and its lease holds by the local deadline."""
        return self.keeper.state.leading(self.keeper.now())

    @property
    def leader(self) -> str | None:
        """The name of the node that leads, as last seen (None: nobody, or not known)."""
        if self._leader == self.name and not self.leading:
            return None
        return self._leader

    @property
    def term(self) -> int:
        """The create revision of our leader key while we lead; 0 otherwise."""
        return self.keeper.state.term if self.leading else 0

    @property
    def reason(self) -> str:
        """Why this node does not lead (empty while it leads)."""
        if self.leading:
            return ""
        if self._leader and self._leader != self.name:
            return f"{self._leader} leads"
        return self.keeper.state.reason or "not elected"

    def fence(self) -> list[Compare]:
        """The compares every write of the leader carries: the leader key is still the one
        our campaign created. Raises ``Deposed`` when this node does not lead now."""
        term = self.term
        if not term:
            raise Deposed(f"{self.name} does not lead: {self.reason}")
        return [Compare(self.key, "CREATE", "EQUAL", term)]

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
            left = self.keeper.state.deadline - self.keeper.now()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(left, 0.0)):
                    await self._changed.wait()

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
        """Stop campaigning and watching (the key stays until the lease ends: see resign)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def resign(self) -> None:
        """Stop, and if this node leads, delete the leader key (fenced) so that another node
        leads at once rather than after the lease's TTL."""
        await self.stop()
        term = self.term
        self._deposed("resigned")
        if not term:
            return
        try:
            result = await self.client.txn(
                [Compare(self.key, "CREATE", "EQUAL", term)], [Delete(self.key)]
            )
        except (EtcdUnavailable, EtcdError) as e:
            log.warning("%s resigned; the leader key stays until its lease ends: %s", self.name, e)
            return
        if result.succeeded:
            self._leader = None
            log.info("%s resigned the leadership", self.name)

    def _on_lease(self, event: LeaseEvent) -> None:
        if event.transition is not None:
            self._announce(event.transition)
        # A new or restored lease: campaign again (the key may be ours still, or gone).
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            revision = await self._campaign()
            if revision is None:
                continue
            watcher = asyncio.create_task(self._until_changed(revision))
            waker = asyncio.create_task(self._wake.wait())
            try:
                await asyncio.wait({watcher, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (watcher, waker):
                    task.cancel()
                await asyncio.gather(watcher, waker, return_exceptions=True)
            if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
                log.warning("%s: watching the leader key: %s", self.name, watcher.exception())
                await asyncio.sleep(self.retry)

    async def _campaign(self) -> int | None:
        """One campaign; the revision it read the key at, None to try again."""
        lease = await self.keeper.wait_valid()
        self._wake.clear()  # lease events so far are in this campaign; later ones wake us
        self.campaigns += 1
        try:
            result = await self.client.txn(
                [Compare(self.key, "CREATE", "EQUAL", 0)],
                [Put(self.key, self.name.encode(), lease=lease), Get(self.key)],
                [Get(self.key)],
            )
        except LeaseNotFound:
            self.keeper.report_lost(lease)
            return None
        except (EtcdUnavailable, EtcdError) as e:
            log.warning("%s: campaign: %s", self.name, e)
            await asyncio.sleep(self.retry)
            return None
        kvs = result.ranges[-1] if result.ranges else []
        if not kvs:
            return None  # deleted between the compare and the read: campaign again
        self._seen(kvs[0], lease)
        return result.revision

    def _seen(self, kv: KeyValue, lease: int) -> None:
        """The leader key as read: ours (a term starts), or another node's."""
        self._leader = kv.value.decode(errors="replace")
        now = self.keeper.now()
        if self._leader == self.name and kv.lease == lease:
            transition = self.keeper.state.won(lease, kv.create_revision, now)
            if transition is not None:
                log.info("%s leads (term %d)", self.name, kv.create_revision)
                self._announce(transition)
            else:
                self._notify()
        else:
            self._deposed(f"{self._leader} leads")

    async def _until_changed(self, revision: int) -> None:
        """Return when the leader key is deleted (after ``revision``)."""
        try:
            async for batch in self.client.watch(self.key, start_revision=revision + 1):
                for event in batch:
                    if event.type == "DELETE":
                        self._leader = None
                        self._deposed("the leader key was deleted")
                        return
                    self._seen(event.kv, self.keeper.lease)
        except Compacted:
            return  # campaign again: it reads the key as it is now

    def _deposed(self, reason: str) -> None:
        transition = self.keeper.state.deposed(self.keeper.now(), reason)
        if transition is not None:
            log.warning("%s no longer leads: %s", self.name, reason)
            self._announce(transition)
        else:
            self._notify()

    def _announce(self, transition: Transition) -> None:
        for listener in list(self._listeners):
            try:
                listener(transition)
            except Exception:
                log.exception("leadership listener failed")
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _ended(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the election ended", exc_info=task.exception())
