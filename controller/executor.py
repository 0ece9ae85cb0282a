"""The executor: performs the I/O of the planner's decisions through the backends, the pool
and the store. It decides nothing.

The reconciler has already applied a decision to the service's state when it hands it over
(a start is ``requested``, a drain is ``draining``); the executor does what that takes and
never blocks the loop: the slow part (spawning, stopping, waiting for a drain) runs in a
named, guarded task whose outcome goes back to the reconciler as an observation. Errors of
the backend become the failure of the one replica concerned.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any, Literal

from gateway import Health, Pool, Upstream

from . import tokens
from .backends.base import Backend, Launch, Running
from .errors import BackendError, HostFault, StoreUnavailable
from .planning.actions import (
    AbandonRollout,
    Action,
    BeginRollout,
    CompleteRollout,
    Drain,
    FailReplica,
    FailRollout,
    Forget,
    Judge,
    MarkServing,
    NextStep,
    PauseRollout,
    Promote,
    Rescale,
    ResumeRollout,
    SetDegraded,
    SetSplit,
    SetWeight,
    Stop,
    Undrain,
)
from .planning.model import Observed, Replica, ReplicaState, Rollout, strategy_state
from .planning.transitions import DrainDone, HealthChanged, Observation, Placed, StartFailed
from .spec import ServiceSpec
from .state import ServiceState
from .store import Store

log = logging.getLogger(__name__)

RolloutOutcome = Literal["complete", "rolled_back", "failed", "aborted"]

RolloutListener = Callable[[str, RolloutOutcome, float], None]
"""Called with (service, outcome, duration) when a rollout ends (metrics)."""

Report = Callable[[ServiceState, Observation], None]
"""Where outcomes go: the reconciler applies them to the service's state."""


class Executor:
    def __init__(
        self,
        pool: Pool,
        backends: Mapping[str, Backend],
        store: Store,
        clock: Callable[[], float],
        report: Report,
    ) -> None:
        self.pool = pool
        self.backends = backends
        self.store = store
        self.clock = clock
        self.report = report
        self.rollout_listeners: list[RolloutListener] = []
        self.running: dict[str, Running] = {}
        """Replicas the backends run, by id: started here or adopted at start-up."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.admin_digest: str | None = None
        """SHA-256 (hex) of the admin token: it opens preview routes allowed by token."""
        self.on_launch: Callable[[str, str], None] | None = None
        """Told (service, replica id) as a backend is asked to start a replica (its span's
        start: ``RolloutTraces.launching``)."""

    # -- decisions that need an identity first -------------------------------------------------

    @staticmethod
    def new_replica_id(service: str, revision: int) -> str:
        return f"{service}-{revision}-{secrets.token_hex(3)}"

    def record_rollout(
        self, state: ServiceState, action: BeginRollout, begun: Rollout | None = None
    ) -> int:
        """Persist a rollout about to begin (superseding the active one), with the strategy
        state of ``begun`` (the rollout as it begins), in the same transaction; its id."""
        row = self.store.create_rollout(
            state.name,
            action.from_revision,
            action.to_revision,
            action.kind,
            strategy_json=None if begun is None else strategy_state(begun),
        )
        return row.id

    # -- decisions -----------------------------------------------------------------------------

    def start(self, state: ServiceState, replica_id: str, revision: int) -> None:
        spec = state.revisions[revision]
        launch = Launch(state.name, revision, replica_id, spec.replica)
        self._spawn(self._do_start(state, launch, spec), f"start:{replica_id}")

    def perform(self, state: ServiceState, action: Action, before: Observed) -> None:
        """The I/O of ``action``, already applied to ``state`` (``before``: as it was)."""
        match action:
            case Drain(replica_id=rid) | FailReplica(replica_id=rid):
                self._drain(state, rid, before)
            case Undrain(replica_id=rid):
                self.pool.undrain(state.name, rid)  # cancels the drain: its outcome is ignored
            case Stop(replica_id=rid):
                self._stop(state, rid)
            case CompleteRollout() | FailRollout() | AbandonRollout() as ended:
                self._rollout_ended(state, ended, before)
            case MarkServing(revision=revision):
                self.store.update_service(state.name, serving_revision=revision)
            case PauseRollout(rollout_id=rid, reason=reason):
                strategy = self._strategy(state, rid)
                self.store.update_rollout(
                    rid, status="paused", reason=reason, strategy_json=strategy
                )
            case ResumeRollout(rollout_id=rid):
                # Its retries afresh, and its deadline from now (the strategy state's start).
                strategy = self._strategy(state, rid)
                self.store.update_rollout(
                    rid, status="progressing", reason="", retries_used=0, strategy_json=strategy
                )
            case (
                SetWeight(rollout_id=rid)
                | NextStep(rollout_id=rid)
                | Judge(rollout_id=rid)
                | Promote(rollout_id=rid)
            ):
                self._record_strategy(state, rid)
            case Forget():
                self.pool.remove_service(state.name)
                self.store.delete_service(state.name)
            case Rescale(count=count):
                try:
                    self.store.update_service(state.name, desired_replicas=count)
                except Exception as e:
                    log.warning("%s: autoscaled count not persisted: %s", state.name, e)
            case SetSplit(split=split):
                self.pool.set_split(state.name, split)
            case SetDegraded(reason=reason):
                # The data plane answers held requests with the reason a start failed.
                failure = reason if reason and state.observed.backoff.failures else ""
                self.pool.set_failure(state.name, failure)
            case _:
                pass

    def set_routing(self, spec: ServiceSpec) -> None:
        """Set the service's routing in the pool, with its bearer tokens' digests (and, for
        preview routes allowed by token, the admin token's and the service tokens')."""
        digests = self.token_digests(spec)
        routing = spec.routing(digests)
        preview = routing.preview
        if preview.allow == "token":
            tokens = [*preview.tokens, *(digests or ())]
            if self.admin_digest is not None:
                tokens.append(self.admin_digest)
            preview = replace(preview, tokens=tuple(dict.fromkeys(tokens)))
            routing = replace(routing, preview=preview)
        self.pool.set_service(routing)

    def token_digests(self, spec: ServiceSpec) -> dict[str, str] | None:
        """The digests of the service's tokens (``controller.tokens``): its config's, then
        the store's; None without auth. A store that cannot be read adds none (closed)."""
        if spec.auth is None:
            return None
        digests = tokens.configured(spec.auth)
        try:
            stored = self.store.tokens(spec.name)
        except StoreUnavailable as e:
            log.warning("%s: tokens of the store not read: %s", spec.name, e)
            stored = []
        for row in stored:
            digests.setdefault(row.digest, row.id)
        return digests

    @staticmethod
    def _strategy(state: ServiceState, rollout_id: int) -> str | None:
        """The strategy state of the service's rollout ``rollout_id`` as decided (None: it is
        no longer the active one)."""
        rollout = state.observed.rollout
        if rollout is None or rollout.id != rollout_id:
            return None
        return strategy_state(rollout)

    def _record_strategy(self, state: ServiceState, rollout_id: int) -> None:
        strategy = self._strategy(state, rollout_id)
        if strategy is None:
            return
        try:
            self.store.update_rollout(rollout_id, strategy_json=strategy)
        except Exception as e:  # the store being down must not stop the loop
            log.warning("%s: rollout %d's step not persisted: %s", state.name, rollout_id, e)

    def count_failures(self, state: ServiceState, rollout: Rollout) -> None:
        try:
            self.store.update_rollout(
                rollout.id, retries_used=rollout.failures, reason=state.observed.backoff.reason
            )
        except Exception as e:  # the store being down must not stop the loop
            log.warning("%s: rollout failure count not persisted: %s", state.name, e)

    # -- replicas ------------------------------------------------------------------------------

    async def _do_start(self, state: ServiceState, launch: Launch, spec: ServiceSpec) -> None:
        backend = self.backends[spec.backend]
        if self.on_launch is not None:
            self.on_launch(state.name, launch.replica_id)
        try:
            running = await backend.start(launch)
        except BackendError as e:
            host_fault = isinstance(e, HostFault)
            self.report(state, StartFailed(launch.replica_id, e.message, counts=not host_fault))
            return
        except Exception as e:
            log.exception("%s: start of %s raised", state.name, launch.replica_id)
            self.report(state, StartFailed(launch.replica_id, f"start failed: {e}"))
            return
        replica = state.replica(launch.replica_id)
        if state.forgotten or replica is None or replica.terminal:
            await backend.stop(launch.replica_id, spec.rollout.stop_grace)
            return
        self.running[launch.replica_id] = running
        upstream = self.upstream_of(state.name, spec, replica, running)
        try:
            self.store.put_replica(
                state.name, launch.replica_id, launch.revision, spec.backend, _json(running)
            )
        except Exception as e:
            log.warning("%s: replica %s not persisted: %s", state.name, launch.replica_id, e)
        self.report(state, Placed(launch.replica_id, upstream.address))
        placed = state.replica(launch.replica_id)
        if placed is not None and placed.state is ReplicaState.STARTING:
            self.pool.add_upstream(upstream)

    def adopt(self, state: ServiceState, replica: Replica, running: Running) -> None:
        """A replica still running from before a restart joins the pool, to be probed."""
        self.running[replica.id] = running
        spec = state.revisions[replica.revision]
        upstream = self.upstream_of(state.name, spec, replica, running)
        known = self.pool.upstream(state.name, replica.id)
        if known is not None and (known.host, known.port) == (upstream.host, upstream.port):
            # A cluster node that followed the leader has it, probed: it stays as it is, and
            # one its own probes pass is ready now (no health change will come to say so).
            if known.health is Health.HEALTHY:
                self.report(state, HealthChanged(replica.id, True, "routable here already"))
            return
        if known is not None:
            self.pool.remove_upstream(state.name, replica.id, "address changed")
        self.pool.add_upstream(upstream)

    @staticmethod
    def upstream_of(
        service: str, spec: ServiceSpec, replica: Replica, running: Running
    ) -> Upstream:
        """The data plane's view of a running replica, probed as its revision's ``spec`` says."""
        return Upstream(
            id=replica.id,
            service=service,
            host=running.host,
            port=running.port,
            revision=replica.revision,
            probes=spec.effective_probes,
        )

    def _drain(self, state: ServiceState, replica_id: str, before: Observed) -> None:
        was = next((r for r in before.replicas if r.id == replica_id), None)
        replica = state.replica(replica_id)
        if was is None or not was.live or replica is None or replica.address is None:
            return  # not placed yet: the start's outcome marks it drained
        timeout = state.revisions[replica.revision].rollout.drain_timeout
        done = self.pool.drain(state.name, replica_id, timeout)
        done.add_done_callback(lambda fut: self._drained(state, replica_id, fut))

    def _drained(self, state: ServiceState, replica_id: str, fut: asyncio.Future[bool]) -> None:
        if fut.cancelled():  # taken back (undrained): it serves again
            return
        self.report(state, DrainDone(replica_id, fut.result()))

    def _stop(self, state: ServiceState, replica_id: str) -> None:
        self.pool.remove_upstream(state.name, replica_id, "stopping")
        replica = state.replica(replica_id)
        if replica is None or replica.state is not ReplicaState.STOPPING:
            return
        spec = state.revisions[replica.revision]
        backend = self.backends[spec.backend]
        self._spawn(backend.stop(replica_id, spec.rollout.stop_grace), f"stop:{replica_id}")

    def forget_replica(self, state: ServiceState, replica_id: str, reason: str) -> None:
        """A replica is gone: out of the pool, the running set and the store."""
        self.pool.remove_upstream(state.name, replica_id, reason)
        self.running.pop(replica_id, None)
        try:
            self.store.remove_replica(state.name, replica_id)
        except Exception as e:
            log.warning("%s: replica %s not removed from the store: %s", state.name, replica_id, e)

    # -- rollouts ------------------------------------------------------------------------------

    def _rollout_ended(
        self,
        state: ServiceState,
        action: CompleteRollout | FailRollout | AbandonRollout,
        before: Observed,
    ) -> None:
        rollout = before.rollout
        if rollout is None or rollout.id != action.rollout_id:
            return
        outcome: RolloutOutcome
        match action:
            case CompleteRollout():
                to = rollout.to_revision
                self.store.finish_rollout(rollout.id, "complete", "", serving_revision=to)
                outcome = "rolled_back" if rollout.kind == "rollback" else "complete"
            case FailRollout(reason=reason):
                serving = before.serving_revision
                self.store.finish_rollout(rollout.id, "failed", reason, serving_revision=serving)
                outcome = "failed"
            case AbandonRollout(outcome="aborted", reason=reason):
                serving = before.serving_revision
                self.store.finish_rollout(rollout.id, "aborted", reason, serving_revision=serving)
                outcome = "aborted"
            case AbandonRollout():
                return  # superseded: the next rollout's record supersedes it
        duration = self.clock() - rollout.started
        for listener in self.rollout_listeners:
            try:
                listener(state.name, outcome, duration)
            except Exception:
                log.exception("rollout listener failed")

    # -- tasks ---------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def stop_all(self, states: Mapping[str, ServiceState]) -> None:
        """Stop every running replica (the gateway exits with ``replicas_on_exit: stop``)."""
        stops = []
        for state in states.values():
            for replica in state.observed.replicas:
                if replica.id not in self.running:
                    continue
                spec = state.revisions.get(replica.revision, state.spec)
                backend = self.backends[spec.backend]
                stops.append(backend.stop(replica.id, spec.rollout.stop_grace))
        for result in await asyncio.gather(*stops, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("a replica did not stop cleanly: %s", result)

    async def close(self) -> None:
        """Wait briefly for starts and stops in progress, then cancel them."""
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def __repr__(self) -> str:
        return (
            f"<Executor tasks={len(self._tasks)} running={len(self.running)} "
            f"backends={sorted(self.backends)}>"
        )


def _json(running: Running) -> str:
    return json.dumps({"host": running.host, "port": running.port, **running.handle})
