"""The reconcile loop: one task per service, woken by events, that plans and hands over.

Each service's ``ServiceState`` holds its desired state (from applies) and its observed state
(from the backend, the pool and the executor). Observations arrive here synchronously on the
event loop (a health transition, a replica exit, a finished drain), update the observed
records and wake the service's loop; the loop calls the pure planner with ``loop.time()`` and
gives the actions to the executor, which marks their effect in the observed state at once so
the next plan does not repeat them.

A failure here is about one replica: it sets that replica failed, counts against the active
rollout when the replica is of its target revision, and feeds the backoff. It never touches
another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway import Health, PoolEvent

from .backends.base import Exit, Running
from .journal import Journal
from .model import Backoff, Observed, Replica, ReplicaState, RolloutStatus
from .planner import Desired, plan
from .spec import ServiceSpec
from .store import Store

if TYPE_CHECKING:
    from .executor import Executor

log = logging.getLogger(__name__)

KEEP_TERMINAL = 20
"""Stopped and failed replicas kept per service for status and the planner's history."""


@dataclass(eq=False)
class ServiceState:
    """The control state of one service. Mutated only on the event loop."""

    name: str
    spec: ServiceSpec
    revisions: dict[int, ServiceSpec]
    desired: Desired
    observed: Observed = field(default_factory=Observed)
    running: dict[str, Running] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    wake_at: float | None = None
    forgotten: bool = False
    task: asyncio.Task[None] | None = None

    def replica(self, replica_id: str) -> Replica | None:
        for r in self.observed.replicas:
            if r.id == replica_id:
                return r
        return None

    def put(self, replica: Replica) -> None:
        """Add or replace a replica record, keeping only the newest terminal ones."""
        others = [r for r in self.observed.replicas if r.id != replica.id]
        replicas = [*others, replica]
        terminal = [r for r in replicas if r.terminal]
        if len(terminal) > KEEP_TERMINAL:
            drop = {r.id for r in sorted(terminal, key=lambda r: r.since)[:-KEEP_TERMINAL]}
            replicas = [r for r in replicas if r.id not in drop]
        self.observed = self.observed.replace(replicas=tuple(replicas))

    def __repr__(self) -> str:
        live = sum(1 for r in self.observed.replicas if r.live)
        return (
            f"<ServiceState {self.name} target=r{self.desired.revision} "
            f"serving={self.observed.serving_revision} live={live}/{self.desired.replicas}>"
        )


class Reconciler:
    """Runs the loops and takes in observations. Implements ``gateway.PoolSubscriber``."""

    def __init__(self, store: Store, journal: Journal, clock: Callable[[], float]) -> None:
        self.store = store
        self.journal = journal
        self.clock = clock
        self.services: dict[str, ServiceState] = {}
        self.executor: Executor | None = None
        self._owner: dict[str, str] = {}  # replica id -> service name

    # -- loops --------------------------------------------------------------------------------

    def add(self, state: ServiceState) -> None:
        self.services[state.name] = state
        for r in state.observed.replicas:
            self._owner[r.id] = state.name
        state.task = asyncio.create_task(self._run(state), name=f"reconcile:{state.name}")
        state.task.add_done_callback(self._loop_ended)

    def wake(self, name: str) -> None:
        state = self.services.get(name)
        if state is not None:
            state.wake.set()

    def own(self, replica_id: str, service: str) -> None:
        self._owner[replica_id] = service

    async def _run(self, state: ServiceState) -> None:
        assert self.executor is not None
        while not state.forgotten:
            state.wake.clear()
            state.wake_at = None
            now = self.clock()
            actions = plan(state.observed, state.desired, now)
            for action in actions:
                try:
                    self.executor.execute(state, action)
                except Exception:
                    log.exception("%s: action %r failed", state.name, action)
            if state.forgotten:
                break
            timeout = None if state.wake_at is None else max(0.0, state.wake_at - self.clock())
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
            # arrives as the wait ends (CPython gh-86296), and close() would never return.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await state.wake.wait()
        self.services.pop(state.name, None)
        for rid in [rid for rid, svc in self._owner.items() if svc == state.name]:
            del self._owner[rid]

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("reconcile loop %s ended", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = [s.task for s in self.services.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- observations -------------------------------------------------------------------------

    def note_failure(self, state: ServiceState, replica: Replica, reason: str) -> None:
        """A replica failed: back off its revision's starts; count it against the rollout."""
        if replica.revision != state.desired.revision:
            return
        now = self.clock()
        observed = state.observed.replace(backoff=state.observed.backoff.failed(now, reason))
        rollout = observed.rollout
        if (
            rollout is not None
            and rollout.status is RolloutStatus.PROGRESSING
            and rollout.to_revision == replica.revision
        ):
            rollout = rollout.replace(failures=rollout.failures + 1)
            observed = observed.replace(rollout=rollout)
            try:
                self.store.update_rollout(rollout.id, retries_used=rollout.failures, reason=reason)
            except Exception as e:  # the store being down must not stop the loop
                log.warning("%s: rollout failure count not persisted: %s", state.name, e)
        state.observed = observed

    def on_pool_event(self, event: PoolEvent) -> None:
        if event.kind != "changed" or event.upstream is None or event.previous is None:
            return
        if event.upstream.health is event.previous.health:
            return
        state = self.services.get(event.service)
        if state is None:
            return
        replica = state.replica(event.upstream.id)
        if replica is None or not replica.live:
            return
        now = self.clock()
        health = event.upstream.health
        if health is Health.HEALTHY and replica.state in (
            ReplicaState.STARTING,
            ReplicaState.UNHEALTHY,
        ):
            state.put(replica.replace(state=ReplicaState.READY, since=now, ready_since=now))
            if replica.revision == state.desired.revision:
                state.observed = state.observed.replace(backoff=Backoff())
            self.journal.replica(
                state.name, "replica_ready", replica, f"ready at {replica.address}"
            )
        elif health is Health.UNHEALTHY and replica.state is ReplicaState.READY:
            state.put(replica.replace(state=ReplicaState.UNHEALTHY, since=now))
            self.journal.replica(
                state.name, "replica_unhealthy", replica, f"unhealthy: {event.reason}"
            )
        else:
            return
        state.wake.set()

    def on_exit(self, exit: Exit) -> None:
        """A backend reports that a replica ended."""
        name = self._owner.get(exit.replica_id)
        state = self.services.get(name) if name else None
        if state is None:
            return
        replica = state.replica(exit.replica_id)
        if replica is None or replica.terminal:
            return
        assert self.executor is not None
        self.executor.forget_replica(state, replica, f"replica exited ({exit.reason})")
        now = self.clock()
        if replica.state is ReplicaState.STOPPING or exit.requested:
            final = ReplicaState.FAILED if replica.failure else ReplicaState.STOPPED
            state.put(replica.replace(state=final, since=now, exit_code=exit.code))
            self.journal.replica(state.name, "replica_stopped", replica, "stopped")
        else:
            reason = f"replica {exit.reason}"
            state.put(
                replica.replace(
                    state=ReplicaState.FAILED, since=now, failure=reason, exit_code=exit.code
                )
            )
            self.note_failure(state, replica, reason)
            self.journal.replica(state.name, "replica_failed", replica, f"failed: {reason}")
        state.wake.set()

    def __repr__(self) -> str:
        return f"<Reconciler services={len(self.services)} replicas={len(self._owner)}>"
