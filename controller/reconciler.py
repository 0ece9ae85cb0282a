"""The reconcile loop: one task per service, woken by events; the only writer of its state.

Each service's loop observes, plans and applies: what was observed (a health verdict, a
replica exit, a finished drain, a start's outcome) and what the user asked (``submit``) go
through the pure transitions at once and wake the loop; the loop calls the pure planner with
the clock's ``now``, applies each decision to the state, then hands it to the executor for
its I/O. Decisions and their records live in ``planner`` and ``transitions``; nothing here
chooses anything.

A failure here is about one replica: it sets that replica failed, counts against the active
rollout when the replica is of its target revision, and feeds the backoff. It never touches
another replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping

from gateway import Health, Pool, PoolEvent, ProbeResult

from .backends.base import Backend, Exit
from .executor import Executor
from .journal import Journal
from .planning.actions import Action, BeginRollout, Forget, Start, WakeAt
from .planning.analysis import NO_TRAFFIC, Counts, Traffic
from .planning.autoscaler import Sample
from .planning.model import ReplicaState, restore_strategy
from .planning.planner import plan
from .planning.transitions import (
    Change,
    Counted,
    Exited,
    HealthChanged,
    Observation,
    ProbeFailed,
    Sampled,
    Step,
    decide,
    intend,
    observe,
)
from .spec import ServiceSpec
from .state import ServiceState
from .store import Store
from .tasks import wait_set

log = logging.getLogger(__name__)

SAMPLE_INTERVAL = 1.0
"""Seconds between two samples of an autoscaled service's traffic."""


class Reconciler:
    """Runs the loops and takes in observations. Implements ``gateway.PoolSubscriber``."""

    def __init__(
        self,
        pool: Pool,
        backends: Mapping[str, Backend],
        store: Store,
        journal: Journal,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.journal = journal
        self.clock = clock
        self.services: dict[str, ServiceState] = {}
        self.executor = Executor(pool, backends, store, clock, self.observe)
        self._owner: dict[str, str] = {}  # replica id -> service name
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self.pool = pool
        self._sampler: asyncio.Task[None] | None = None
        pool.on_waiting = self.on_waiting
        self.gate: Callable[[str, str], bool] | None = None
        """In a cluster, on the leader: whether an upstream healthy here is routable on every
        node that serves too (``cluster.peers``). A replica becomes ready only then, so that
        "a replacement is serving" holds on every node. None: this node is enough."""
        self._gated: set[tuple[str, str]] = set()
        self.elsewhere: Callable[[str], Sample] | None = None
        """In a cluster: a service's traffic on the other nodes now (``cluster.peers``), added
        to this node's in each sample. None: this node serves alone."""

    # -- loops ---------------------------------------------------------------------------------

    def add(self, state: ServiceState) -> None:
        """Run ``state``'s loop; an active rollout read back from the store (a restart, a new
        leader) first takes back how it moved (``_restore``)."""
        self._restore(state)
        self.services[state.name] = state
        for r in state.observed.replicas:
            self._owner[r.id] = state.name
        state.task = asyncio.create_task(self._run(state), name=f"reconcile:{state.name}")
        state.task.add_done_callback(self._loop_ended)
        if self._sampler is None:
            self._sampler = asyncio.create_task(self._sampling(), name="reconcile:samples")
            self._sampler.add_done_callback(self._loop_ended)

    def _restore(self, state: ServiceState) -> None:
        """The active rollout goes on at the step, weight and times its record keeps
        (``model.restore_strategy``). A record that keeps none, or cannot be read, leaves it
        as it is: a rolling update."""
        rollout = state.observed.rollout
        if rollout is None or not rollout.active:
            return
        try:
            row = self.store.rollout(rollout.id)
            if row is None or row.strategy_json is None:
                return
            traffic = self._traffic(state.name)
            restored = restore_strategy(rollout, row.strategy_json, self.clock(), traffic)
        except Exception as e:
            log.warning(
                "%s: rollout %d's strategy state not restored, it goes on as a rolling update: %s",
                state.name,
                rollout.id,
                e,
            )
            return
        state.observed = state.observed.replace(rollout=restored, traffic=traffic)
        if restored.staged:
            message = (
                f"{restored.kind} {restored.id} ({restored.strategy.replace('_', '/')}) goes on "
                f"at step {restored.step + 1}, revision {restored.to_revision} at "
                f"{restored.weight}%{' (promoted)' if restored.promoted else ''}"
            )
            self.journal.record(state.name, "service_restored", message, restored.to_revision)

    def wake(self, name: str) -> None:
        state = self.services.get(name)
        if state is not None:
            state.wake.set()

    async def _run(self, state: ServiceState) -> None:
        try:
            while not state.forgotten:
                state.wake.clear()
                state.wake_at = None
                waiters = self._waiters.pop(state.name, [])
                rollout = state.observed.rollout
                if rollout is not None and rollout.active and rollout.staged:
                    self.count(state, wake=False)  # the counts as of this plan
                now = self.clock()
                for action in plan(state.observed, state.desired, now):
                    try:
                        self._take(state, action, now)
                    except Exception:
                        log.exception("%s: action %r failed", state.name, action)
                _release(waiters)
                if state.forgotten:
                    break
                timeout = None if state.wake_at is None else max(0.0, state.wake_at - self.clock())
                await wait_set(state.wake, timeout)  # a cancel here is close()'s
        finally:
            _release(self._waiters.pop(state.name, []))
        self.services.pop(state.name, None)
        for rid in [rid for rid, svc in self._owner.items() if svc == state.name]:
            del self._owner[rid]

    def _take(self, state: ServiceState, action: Action, now: float) -> None:
        """Apply one decision to the state, then have the executor perform it."""
        match action:
            case WakeAt(at=at):
                state.wake_at = at if state.wake_at is None else min(state.wake_at, at)
            case Start(revision=revision):
                replica_id = self.executor.new_replica_id(state.name, revision)
                self._owner[replica_id] = state.name
                self._commit(
                    state, decide(state.desired, state.observed, action, now, new_id=replica_id)
                )
                self.executor.start(state, replica_id, revision)
            case BeginRollout(to_revision=to):
                # The rollout as it begins, its strategy state recorded with it.
                begun = decide(state.desired, state.observed, action, now).observed.rollout
                rollout_id = self.executor.record_rollout(state, action, begun)
                step = decide(state.desired, state.observed, action, now, rollout_id=rollout_id)
                self._commit(state, step)
                self._follow_template(state, to)
            case _:
                before = state.observed
                self._commit(state, decide(state.desired, state.observed, action, now))
                self.executor.perform(state, action, before)
                if isinstance(action, Forget):
                    state.forgotten = True

    def _follow_template(self, state: ServiceState, revision: int) -> None:
        """The service's spec runs the target's template (an undo or a rollback moved it)."""
        template = state.revisions[revision]
        state.desired = state.desired.replace(static=template.backend == "static")
        if template.template_key() == state.spec.template_key():
            return
        state.spec = with_template(state.spec, template)
        try:
            self.store.update_service(state.name, spec_json=state.spec.to_json())
        except Exception as e:
            log.warning("%s: spec not persisted: %s", state.name, e)

    def _commit(self, state: ServiceState, step: Step) -> None:
        before = state.observed.rollout
        state.desired, state.observed = step.desired, step.observed
        after = state.observed.rollout
        if after is not None and before is not None and after.id == before.id:
            if after.failures != before.failures:
                self.executor.count_failures(state, after)
        for e in step.events:
            self.journal.record(state.name, e.kind, e.message, e.revision, e.replica)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("reconcile loop %s ended", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
            self._sampler = None  # a cluster node that leads again adds services again
        self._gated.clear()
        tasks = [s.task for s in self.services.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.executor.close()

    # -- intents -------------------------------------------------------------------------------

    async def submit(
        self,
        state: ServiceState,
        changes: Iterable[Change],
        *,
        spec: ServiceSpec | None = None,
        revision: int | None = None,
    ) -> None:
        """Record what the user asked and wait until the loop has planned once with it.

        ``spec``: the newest applied spec (its routing applies at once); ``revision``: the
        number ``spec``'s template is known by, when it is a revision's."""
        if spec is not None:
            if spec.routing() != state.spec.routing():
                self.executor.set_routing(spec)
            state.spec = spec
            if revision is not None:
                state.revisions[revision] = spec
        self._commit(state, intend(state.desired, state.observed, changes))
        if state.task is None or state.task.done():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(state.name, []).append(waiter)
        state.wake.set()
        await waiter

    # -- observations --------------------------------------------------------------------------

    def observe(self, state: ServiceState, seen: Observation) -> None:
        """Take in what was seen of one of ``state``'s replicas, and plan again."""
        if state.forgotten:
            return
        self._commit(state, observe(state.desired, state.observed, seen, self.clock()))
        state.wake.set()

    async def _sampling(self) -> None:
        """Every ``SAMPLE_INTERVAL``, each autoscaled service's traffic, and the request
        counts of each service in a staged rollout (canary, blue/green), as observations."""
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL)
            for state in list(self.services.values()):
                if state.forgotten:
                    continue
                if state.desired.scaling is not None:
                    self.sample(state)
                rollout = state.observed.rollout
                if rollout is not None and rollout.active and rollout.staged:
                    self.count(state)

    def _traffic(self, service: str) -> Traffic:
        """``service``'s request counts per revision in the data plane now (none without a
        source of counts)."""
        counts = self.pool.request_counts
        if counts is None:
            return NO_TRAFFIC
        bounds, revisions = counts(service)
        return Traffic(
            self.clock(),
            bounds,
            tuple(
                (revision, Counts(requests, errors, latency, ttft))
                for revision, (requests, errors, latency, ttft) in sorted(revisions.items())
            ),
        )

    def count(self, state: ServiceState, *, wake: bool = True) -> None:
        """Take ``state``'s request counts per revision from the data plane (and plan)."""
        if self.pool.request_counts is None:
            return
        traffic = self._traffic(state.name)
        now = traffic.at
        if wake:
            self.observe(state, Counted(traffic))
        else:
            self._commit(state, observe(state.desired, state.observed, Counted(traffic), now))

    def sample(self, state: ServiceState) -> None:
        """Take a sample of ``state``'s traffic from the pool (every process's) and the other
        nodes' reports (``elsewhere``), and plan."""
        sp = self.pool.services.get(state.name)
        if sp is None:
            return
        inflight = sp.inflight_all()
        completed, waited = sp.totals()
        ready = sum(1 for r in state.observed.replicas if r.state is ReplicaState.READY)
        now = self.clock()
        waiting, reported, unreported = 0.0, 0, 0
        if sp.routing.load_metrics is not None:  # the replicas' own figures (``metric: queue``)
            for upstream in sp.snapshot.routable:
                report = sp.reports.get(upstream.id)
                if report is None or now >= report.expires:
                    unreported += 1
                else:
                    waiting += report.waiting
                    reported += 1
        sample = Sample(
            now,
            sum(inflight.values()),
            sp.held_all(),
            completed,
            waited,
            ready,
            tuple(sorted(inflight.items())),
            waiting,
            reported,
            unreported,
        )
        if self.elsewhere is not None:
            sample = sample.plus(self.elsewhere(state.name))
        self.observe(state, Sampled(sample))

    def on_waiting(self, service: str) -> None:
        """The pool began holding requests of ``service``: sample it now, not in a second."""
        state = self.services.get(service)
        if state is not None and state.desired.scaling is not None:
            self.sample(state)

    def on_pool_event(self, event: PoolEvent) -> None:
        if event.kind != "changed" or event.upstream is None or event.previous is None:
            return
        if event.upstream.health is event.previous.health:
            return
        state = self.services.get(event.service)
        if state is None or state.replica(event.upstream.id) is None:
            return
        if event.upstream.health is Health.UNKNOWN:
            return
        healthy = event.upstream.health is Health.HEALTHY
        key = (event.service, event.upstream.id)
        self._gated.discard(key)
        if healthy and self.gate is not None and not self.gate(*key):
            self._gated.add(key)  # ready once every node routes to it too: ``regate``
            return
        self.observe(state, HealthChanged(event.upstream.id, healthy, event.reason))

    def on_probe(self, result: ProbeResult) -> None:
        """A probe that failed for another reason than the replica's last: kept, so that a
        replica given up says what its probes meet now (an answer of 404, say), not the
        connect error that made it unhealthy as it started."""
        if result.ok or not result.reason:
            return
        state = self.services.get(result.service)
        r = state.replica(result.upstream_id) if state is not None else None
        if state is None or r is None or r.healthy or r.probe_failure == result.reason:
            return
        self.observe(state, ProbeFailed(result.upstream_id, result.reason))

    def regate(self) -> None:
        """Another node's view changed: replicas healthy here that every node now routes to
        become ready."""
        for key in list(self._gated):
            service, upstream_id = key
            state = self.services.get(service)
            upstream = self.pool.upstream(service, upstream_id)
            if state is None or upstream is None or upstream.health is not Health.HEALTHY:
                self._gated.discard(key)
                continue
            if self.gate is None or self.gate(service, upstream_id):
                self._gated.discard(key)
                self.observe(state, HealthChanged(upstream_id, True, "routable on every node"))

    def on_exit(self, exit: Exit) -> None:
        """A backend reports that a replica ended."""
        name = self._owner.get(exit.replica_id)
        state = self.services.get(name) if name else None
        if state is None:
            return
        replica = state.replica(exit.replica_id)
        if replica is None or replica.terminal:
            return
        self.executor.forget_replica(state, exit.replica_id, f"replica exited ({exit.reason})")
        self.observe(state, Exited(exit.replica_id, exit.code, exit.reason, exit.requested))

    def __repr__(self) -> str:
        return f"<Reconciler services={len(self.services)} replicas={len(self._owner)}>"


def with_template(spec: ServiceSpec, template: ServiceSpec) -> ServiceSpec:
    """``spec`` running ``template``'s revision: its backend, replica and probes."""
    fields = ("backend", "replica", "probes")
    return spec.model_copy(update={f: getattr(template, f) for f in fields})


def _release(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
