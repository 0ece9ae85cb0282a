"""The executor: performs the planner's actions through the backends, the pool and the store.

``execute`` runs on the event loop and never blocks: it records the action's immediate effect
in the observed state (a start is ``requested``, a drain is ``draining``) and hands the slow
part (spawning, stopping, waiting for a drain) to a named, guarded task whose outcome comes
back as an observation. Errors of the backend become failures of the one replica concerned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from gateway import Health, Pool, Upstream

from .actions import (
    Action,
    CompleteRollout,
    Drain,
    FailReplica,
    FailRollout,
    Forget,
    SetDegraded,
    Start,
    Stop,
    WakeAt,
)
from .backends.base import Backend, Launch, Running
from .errors import BackendError
from .journal import Journal
from .model import Backoff, Replica, ReplicaState, Rollout, RolloutStatus
from .reconciler import Reconciler, ServiceState
from .store import RolloutKind, Store

log = logging.getLogger(__name__)

RolloutListener = Callable[[str, str, float], None]
"""Called with (service, outcome, duration) when a rollout ends (metrics)."""


class Executor:
    def __init__(
        self,
        pool: Pool,
        backends: Mapping[str, Backend],
        store: Store,
        journal: Journal,
        reconciler: Reconciler,
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.backends = backends
        self.store = store
        self.journal = journal
        self.reconciler = reconciler
        self.clock = clock
        self.rollout_listeners: list[RolloutListener] = []
        self._tasks: set[asyncio.Task[None]] = set()
        reconciler.executor = self

    def execute(self, state: ServiceState, action: Action) -> None:
        match action:
            case Start(revision):
                self._start(state, revision)
            case Drain(replica_id, reason):
                self._drain(state, replica_id, reason)
            case FailReplica(replica_id, reason):
                self._fail_replica(state, replica_id, reason)
            case Stop(replica_id):
                self._stop(state, replica_id)
            case CompleteRollout(rollout_id):
                self._complete(state, rollout_id)
            case FailRollout(rollout_id, reason):
                self._fail_rollout(state, rollout_id, reason)
            case SetDegraded(reason):
                state.observed = state.observed.replace(degraded=reason)
                if reason is None:
                    self.journal.record(state.name, "service_recovered", "all replicas ready")
                else:
                    self.journal.record(state.name, "service_degraded", f"degraded: {reason}")
            case Forget():
                self._forget(state)
            case WakeAt(at):
                state.wake_at = at if state.wake_at is None else min(state.wake_at, at)

    # -- replicas -----------------------------------------------------------------------------

    def _start(self, state: ServiceState, revision: int) -> None:
        spec = state.revisions[revision]
        replica_id = f"{state.name}-{revision}-{secrets.token_hex(3)}"
        now = self.clock()
        replica = Replica(replica_id, revision, ReplicaState.REQUESTED, created=now, since=now)
        state.put(replica)
        self.reconciler.own(replica_id, state.name)
        launch = Launch(state.name, revision, replica_id, spec.replica)
        self._spawn(self._do_start(state, launch, spec.backend), f"start:{replica_id}")

    async def _do_start(self, state: ServiceState, launch: Launch, backend_name: str) -> None:
        backend = self.backends[backend_name]
        spec = state.revisions[launch.revision]
        try:
            running = await backend.start(launch)
        except BackendError as e:
            self._start_failed(state, launch.replica_id, e.message)
            return
        except Exception as e:
            log.exception("%s: start of %s raised", state.name, launch.replica_id)
            self._start_failed(state, launch.replica_id, f"start failed: {e}")
            return
        replica = state.replica(launch.replica_id)
        if state.forgotten or replica is None or replica.terminal:
            await backend.stop(launch.replica_id, spec.rollout.stop_grace)
            return
        state.running[launch.replica_id] = running
        upstream = self.upstream_of(state, launch.replica_id, launch.revision, running)
        address = upstream.address
        try:
            self.store.put_replica(
                state.name, launch.replica_id, launch.revision, backend_name, _json(running)
            )
        except Exception as e:
            log.warning("%s: replica %s not persisted: %s", state.name, launch.replica_id, e)
        now = self.clock()
        if replica.state is ReplicaState.REQUESTED:
            state.put(replica.replace(state=ReplicaState.STARTING, since=now, address=address))
            self.pool.add_upstream(upstream)
            self.journal.record(
                state.name,
                "replica_started",
                f"replica {launch.replica_id} of revision {launch.revision} started at {address}",
                launch.revision,
                launch.replica_id,
            )
        else:
            # Drained (or given up) while the backend was still starting it: nothing was ever
            # routed to it, so it may be stopped at once.
            state.put(replica.replace(address=address, drained=True))
        state.wake.set()

    @staticmethod
    def upstream_of(
        state: ServiceState, replica_id: str, revision: int, running: Running
    ) -> Upstream:
        """The data plane's view of a running replica, probed as its revision says."""
        return Upstream(
            id=replica_id,
            service=state.name,
            host=running.host,
            port=running.port,
            revision=revision,
            probes=state.revisions[revision].effective_probes,
        )

    def _start_failed(self, state: ServiceState, replica_id: str, reason: str) -> None:
        replica = state.replica(replica_id)
        if replica is None or replica.terminal:
            return
        now = self.clock()
        failure = replica.failure or reason
        state.put(replica.replace(state=ReplicaState.FAILED, since=now, failure=failure))
        if not replica.failure and replica.state is ReplicaState.REQUESTED:
            self.reconciler.note_failure(state, replica, reason)
        self.journal.replica(state.name, "replica_failed", replica, f"failed: {reason}")
        state.wake.set()

    def _drain(self, state: ServiceState, replica_id: str, reason: str) -> None:
        replica = state.replica(replica_id)
        if replica is None or not replica.live:
            return
        now = self.clock()
        state.put(replica.replace(state=ReplicaState.DRAINING, since=now))
        self.journal.replica(state.name, "replica_draining", replica, f"draining: {reason}")
        if replica.state is ReplicaState.REQUESTED:
            return  # _do_start marks it drained when the backend returns
        timeout = state.revisions[replica.revision].rollout.drain_timeout
        done = self.pool.drain(state.name, replica_id, timeout)
        done.add_done_callback(lambda fut: self._drained(state, replica_id, fut))

    def _drained(self, state: ServiceState, replica_id: str, fut: asyncio.Future[bool]) -> None:
        replica = state.replica(replica_id)
        if replica is None or replica.state is not ReplicaState.DRAINING:
            return
        clean = not fut.cancelled() and fut.result()
        state.put(replica.replace(drained=True))
        if not clean:
            self.journal.replica(
                state.name,
                "replica_drain_timeout",
                replica,
                "drain timeout, in-flight requests were cut off",
            )
        state.wake.set()

    def _fail_replica(self, state: ServiceState, replica_id: str, reason: str) -> None:
        replica = state.replica(replica_id)
        if replica is None or not replica.live:
            return
        self.reconciler.note_failure(state, replica, reason)
        state.put(replica.replace(failure=reason))
        self.journal.replica(state.name, "replica_failed", replica, f"failed: {reason}")
        self._drain(state, replica_id, reason)

    def _stop(self, state: ServiceState, replica_id: str) -> None:
        replica = state.replica(replica_id)
        if replica is None or replica.state is not ReplicaState.DRAINING:
            return
        now = self.clock()
        self.pool.remove_upstream(state.name, replica_id, "stopping")
        if replica_id not in state.running:
            final = ReplicaState.FAILED if replica.failure else ReplicaState.STOPPED
            state.put(replica.replace(state=final, since=now))
            state.wake.set()
            return
        state.put(replica.replace(state=ReplicaState.STOPPING, since=now))
        spec = state.revisions[replica.revision]
        backend = self.backends[spec.backend]
        self._spawn(backend.stop(replica_id, spec.rollout.stop_grace), f"stop:{replica_id}")

    def forget_replica(self, state: ServiceState, replica: Replica, reason: str) -> None:
        """A replica is gone: out of the pool, the running set and the store."""
        self.pool.remove_upstream(state.name, replica.id, reason)
        state.running.pop(replica.id, None)
        try:
            self.store.remove_replica(state.name, replica.id)
        except Exception as e:
            log.warning("%s: replica %s not removed from the store: %s", state.name, replica.id, e)

    # -- rollouts -----------------------------------------------------------------------------

    def _complete(self, state: ServiceState, rollout_id: int) -> None:
        rollout = state.observed.rollout
        if rollout is None or rollout.id != rollout_id:
            return
        self.store.finish_rollout(rollout.id, "complete", "", serving_revision=rollout.to_revision)
        state.observed = state.observed.replace(rollout=None, serving_revision=rollout.to_revision)
        self.journal.record(
            state.name,
            "rollout_complete",
            f"{rollout.kind} {rollout.id} complete: revision {rollout.to_revision} serving",
            rollout.to_revision,
        )
        self._rollout_ended(
            state, rollout, "rolled_back" if rollout.kind == "rollback" else "complete"
        )

    def _fail_rollout(self, state: ServiceState, rollout_id: int, reason: str) -> None:
        rollout = state.observed.rollout
        if rollout is None or rollout.id != rollout_id:
            return
        strategy = state.desired.strategy
        if strategy.on_failure == "pause" and rollout.kind != "rollback":
            self.store.update_rollout(rollout.id, status="paused", reason=reason)
            state.observed = state.observed.replace(
                rollout=rollout.replace(status=RolloutStatus.PAUSED, reason=reason)
            )
            self.journal.record(
                state.name,
                "rollout_paused",
                f"rollout {rollout.id} paused on failure: {reason}",
                rollout.to_revision,
            )
            return
        serving = state.observed.serving_revision
        self.store.finish_rollout(rollout.id, "failed", reason, serving_revision=serving)
        self.journal.record(
            state.name,
            "rollout_failed",
            f"{rollout.kind} {rollout.id} to revision {rollout.to_revision} failed: {reason}",
            rollout.to_revision,
        )
        self._rollout_ended(state, rollout, "failed")
        back_to = rollout.from_revision
        if rollout.kind == "rollback" or back_to is None or back_to not in state.revisions:
            # Nothing to return to: keep the target and keep retrying, degraded.
            state.observed = state.observed.replace(rollout=None)
            return
        self.begin_rollout(state, back_to, "rollback", from_revision=rollout.to_revision)

    def begin_rollout(
        self, state: ServiceState, to_revision: int, kind: RolloutKind, from_revision: int | None
    ) -> Rollout:
        """Point the service at ``to_revision`` with a new rollout record (rollback, undo)."""
        row = self.store.create_rollout(state.name, from_revision, to_revision, kind)
        rollout = Rollout(
            row.id, from_revision, to_revision, kind, RolloutStatus.PROGRESSING, self.clock()
        )
        state.desired = dataclasses.replace(state.desired, revision=to_revision)
        state.observed = state.observed.replace(rollout=rollout, backoff=Backoff())
        self.journal.record(
            state.name,
            "rollout_started",
            f"{kind} {row.id}: revision {from_revision} -> {to_revision}",
            to_revision,
        )
        self._reclaim(state, to_revision)
        state.wake.set()
        return rollout

    def _reclaim(self, state: ServiceState, revision: int) -> None:
        """Back to ``revision``: its replicas still draining (the rollout being undone was
        replacing them) serve again, up to the desired count, instead of being stopped while
        fresh ones start. Otherwise a failed rollout could leave no routable replica: the
        last old one draining, the new ones crashing (the zero-downtime harness, 3c)."""
        wanted = state.desired.replicas - sum(
            1 for r in state.observed.replicas if r.live and r.revision == revision
        )
        draining = [
            r
            for r in state.observed.replicas
            if r.state is ReplicaState.DRAINING
            and r.revision == revision
            and not r.drained
            and not r.failure
            and r.id in state.running
        ]
        now = self.clock()
        for replica in sorted(draining, key=lambda r: r.since, reverse=True)[: max(wanted, 0)]:
            upstream = self.pool.upstream(state.name, replica.id)
            if upstream is None:
                continue
            healthy = upstream.health is Health.HEALTHY
            back = ReplicaState.READY if healthy else ReplicaState.UNHEALTHY
            state.put(replica.replace(state=back, since=now))
            self.pool.undrain(state.name, replica.id)  # cancels the drain: _drained ignores it
            self.journal.replica(
                state.name,
                "replica_undrained",
                replica,
                f"serves again: back to revision {revision}",
            )

    def _rollout_ended(self, state: ServiceState, rollout: Rollout, outcome: str) -> None:
        duration = self.clock() - rollout.started
        for listener in self.rollout_listeners:
            try:
                listener(state.name, outcome, duration)
            except Exception:
                log.exception("rollout listener failed")

    def _forget(self, state: ServiceState) -> None:
        self.pool.remove_service(state.name)
        self.store.delete_service(state.name)
        state.forgotten = True
        self.journal.record(state.name, "service_deleted", "service deleted")

    # -- tasks --------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        """Wait briefly for starts and stops in progress, then cancel them."""
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def __repr__(self) -> str:
        return f"<Executor tasks={len(self._tasks)} backends={sorted(self.backends)}>"


def _json(running: Running) -> str:
    return json.dumps({"host": running.host, "port": running.port, **running.handle})
