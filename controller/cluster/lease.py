"""LeaseKeeper: this node's etcd lease, granted, kept alive and replaced when etcd drops it.

Everything that must vanish with the node (its registration, its capacity, its report) is
bound to this lease; the leadership is not (``election``). The keeper renews it every TTL/3 and
feeds every answer to a ``LeaseClock`` (its local deadline), and tells its listeners what
happened to the lease:

- ``granted``: a new lease; register again with it (everything bound to an old one is gone);
- ``lost``: etcd says the lease is gone (it expired, or was revoked): so is all bound to it;
  also sent by ``stop`` (the node no longer holds it, revoked or left to expire);
- ``lapsed``: the local deadline passed with no renewal (etcd unreachable, the process paused):
  the lease may still exist, the node cannot vouch for it;
- ``restored``: a renewal succeeded after a lapse: etcd still had the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from controller.cluster.leadership import LeaseClock
from controller.etcd import EtcdClient, EtcdError, EtcdUnavailable

log = logging.getLogger(__name__)

LeaseEventKind = Literal["granted", "lost", "lapsed", "restored"]


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    kind: LeaseEventKind
    lease: int
    reason: str


LeaseListener = Callable[[LeaseEvent], None]


def default_margin(ttl: float) -> float:
    """The safety margin of the local deadline: a tenth of the TTL, at least 0.2 s."""
    return max(0.2, ttl / 10)


class LeaseKeeper:
    """Grants this node's lease and keeps it alive; see the module docstring."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        ttl: int = 5,
        margin: float | None = None,
        clock: Callable[[], float] | None = None,
        retry: float | None = None,
    ) -> None:
        """``clock`` is monotonic seconds on the loop's time scale (``loop.time`` when None);
        ``retry`` is the pause after a failed grant or keepalive (TTL/10 by default)."""
        self.client = client
        self.ttl = ttl
        self.interval = ttl / 3
        self.retry = ttl / 10 if retry is None else retry
        self.state = LeaseClock(default_margin(ttl) if margin is None else margin)
        self.unreachable = ""
        """Why the last grant or keepalive failed; empty after one succeeded."""
        self.renewals = 0
        self._clock = clock
        self._listeners: list[LeaseListener] = []
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._valid = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._next_renewal = 0.0
        self._lapsed = False

    def __repr__(self) -> str:
        return (
            f"<LeaseKeeper lease={self.state.lease:x} ttl={self.ttl} renewals={self.renewals} "
            f"deadline={self.state.deadline:g}{' lapsed' if self._lapsed else ''}>"
        )

    def now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    @property
    def lease(self) -> int:
        """The current lease (0: none yet, or lost and not yet replaced)."""
        return self.state.lease

    def valid(self) -> bool:
        """The lease is held, by its local deadline."""
        return self.state.valid(self.now())

    def subscribe(self, listener: LeaseListener) -> Callable[[], None]:
        """Call ``listener`` with every LeaseEvent; returns the function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    async def wait_valid(self) -> int:
        """The current lease, once there is one held (by the local deadline)."""
        while not self.valid():
            self._valid.clear()
            await self._valid.wait()
        return self.state.lease

    def report_lost(self, lease: int, reason: str = "etcd does not know the lease") -> None:
        """Someone's write with ``lease`` got LeaseNotFound: replace it now, not at the next
        renewal."""
        if lease and lease == self.state.lease:
            self._lost(lease, reason)
            self._wake.set()

    def start(self) -> None:
        """Start granting and renewing, in a task of its own (``wait_valid`` for the lease)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="cluster:lease")
            self._task.add_done_callback(_ended)

    async def stop(self, *, revoke: bool = True) -> None:
        """Stop renewing; with ``revoke`` end the lease now (what is bound to it goes at
        once) instead of letting it expire after the TTL."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._timer is not None:
            self._timer.cancel()
        lease = self.state.lease
        if lease:
            if revoke:
                try:
                    await self.client.revoke(lease)
                except (EtcdUnavailable, EtcdError) as e:
                    log.warning("could not revoke lease %x (it expires in its TTL): %s", lease, e)
            self._lost(lease, "the node stopped")

    # --- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self.state.lease:
                await self._grant()
                continue
            delay = self._next_renewal - self.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            self._wake.clear()
            if self.state.lease:
                await self._renew(self.state.lease)

    async def _grant(self) -> None:
        sent = self.now()
        try:
            lease = await self.client.grant(self.ttl)
        except (EtcdUnavailable, EtcdError) as e:
            self._failed(f"grant: {e}")
            await asyncio.sleep(self.retry)
            return
        self.unreachable = ""
        self.state.granted(lease, self.ttl, sent)
        self._lapsed = False
        self._next_renewal = sent + self.interval
        self._arm()
        log.info("lease %x granted (TTL %d s)", lease, self.ttl)
        self._emit(LeaseEvent("granted", lease, "granted"))

    async def _renew(self, lease: int) -> None:
        sent = self.now()
        try:
            left = await self.client.keepalive(lease)
        except (EtcdUnavailable, EtcdError) as e:
            self._failed(f"keepalive: {e}")
            self._next_renewal = self.now() + self.retry
            return
        self.unreachable = ""
        self.renewals += 1
        if left <= 0:
            self._lost(lease, "etcd no longer has the lease (expired)")
            return
        lapsed = self._lapsed or self.now() >= self.state.deadline
        self.state.renewed(lease, left, sent)
        self._next_renewal = sent + self.interval
        self._arm()
        if lapsed:
            self._lapsed = False
            log.info("lease %x renewed after it lapsed: etcd still has it", lease)
            self._emit(LeaseEvent("restored", lease, "renewed after a lapse"))

    def _failed(self, why: str) -> None:
        if self.unreachable != why:
            log.warning("lease %x: %s", self.state.lease, why)
        self.unreachable = why

    def _lost(self, lease: int, reason: str) -> None:
        if lease != self.state.lease:
            return  # told already (a keepalive answer and a LeaseNotFound can both say so)
        self.state.lost(lease)
        self._lapsed = False
        log.warning("lease %x lost: %s", lease, reason)
        self._emit(LeaseEvent("lost", lease, reason))

    def _arm(self) -> None:
        """Wake at the local deadline, to end a term there if no renewal came."""
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, self.state.deadline - self.now())
        self._timer = loop.call_later(delay, self._deadline_passed)
        self._valid.set()

    def _deadline_passed(self) -> None:
        self._timer = None
        lease = self.state.lease
        if not lease or self._lapsed:
            return
        now = self.now()
        if now < self.state.deadline:  # a renewal came meanwhile
            self._arm()
            return
        self._lapsed = True
        log.warning("lease %x lapsed: no renewal before its local deadline", lease)
        self._emit(LeaseEvent("lapsed", lease, self.unreachable or "not renewed"))

    def _emit(self, event: LeaseEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("lease listener failed on %s", event.kind)


def _ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the lease keeper ended", exc_info=task.exception())
