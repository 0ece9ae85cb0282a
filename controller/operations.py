"""The controller's operations: apply, scale, pause, resume, abort, undo, delete, restore.

Each operation validates, persists the user's spec and revision, and records the intent with
the reconciler (``Reconciler.submit``), which wakes the service's loop and returns once it
has planned with it; the planner decides what follows (a rollout begun, superseded, aborted).
Operations change no replica and no rollout themselves. Operations on one service are
serialised by a lock, so two applies racing each make a whole revision and rollout, one
after the other. A refused operation (bad spec, wrong state) raises before anything changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from gateway import Pool

from . import tokens as bearer
from .backends.base import Backend, Launch, Running
from .config import format_validation_error
from .errors import Conflict, ControllerError, NotFound, SpecError
from .executor import Executor
from .journal import Journal
from .planning.model import Desired, Observed, Replica, ReplicaState, Rollout, RolloutStatus
from .planning.transitions import AskPromote, Configure, Delete, Retarget, SetPaused
from .reconciler import Reconciler
from .rollout_traces import ApplySpan, RolloutTraces
from .spec import ServiceSpec, model_clash, upstream_tls_problem
from .state import ServiceState
from .store import Store
from .tokens import TokenInfo

log = logging.getLogger(__name__)

ApplyAction = Literal["created", "unchanged", "updated", "scaled", "rollout"]

_ROUTING_FIELDS = ("route", "load_balancing", "timeouts", "retries", "outlier", "limits",
                   "queue_timeout")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What an apply will do."""

    action: ApplyAction
    service: str
    revision: int
    previous_revision: int | None = None
    rollout_id: int | None = None
    changes: tuple[str, ...] = ()
    """Top-level spec fields that differ from the current target's."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"changes": list(self.changes)}


def diff_fields(old: ServiceSpec, new: ServiceSpec) -> tuple[str, ...]:
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    out = []
    for key in b:
        if a.get(key) != b.get(key):
            if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
                out += [
                    f"{key}.{k}"
                    for k in sorted(set(a[key]) | set(b[key]))
                    if a[key].get(k) != b[key].get(k)
                ]
            else:
                out.append(key)
    return tuple(out)


def validate_spec(data: Any) -> ServiceSpec:
    """A spec from the API; raises SpecError naming each field and reason."""
    if isinstance(data, ServiceSpec):
        return data
    if not isinstance(data, dict):
        raise SpecError("a service spec must be a JSON or YAML object")
    try:
        return ServiceSpec.model_validate(data)
    except ValidationError as e:
        errors = format_validation_error(e)
        raise SpecError(
            "invalid spec: " + "; ".join(f"{x['field']}: {x['reason']}" for x in errors), errors
        ) from None


@dataclass
class Controller:
    """The control plane's surface: what the admin API and the start-up config call."""

    pool: Pool
    backends: Mapping[str, Backend]
    store: Store
    journal: Journal
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    reconciler: Reconciler = field(init=False)
    traces: RolloutTraces | None = field(default=None, init=False)
    """Where applies' spans go (``tracing.otlp_endpoint`` set), with the rollouts'."""
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.reconciler = Reconciler(self.pool, self.backends, self.store, self.journal, self.clock)
        self.pool.subscribe(self.reconciler)
        self.journal.follow(self.pool)
        for backend in self.backends.values():
            backend.set_exit_handler(self.reconciler.on_exit)

    @property
    def executor(self) -> Executor:
        return self.reconciler.executor

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def state(self, name: str) -> ServiceState:
        state = self.reconciler.services.get(name)
        if state is None or state.forgotten:
            raise NotFound(f"no service {name!r}", service=name)
        return state

    def active_rollout(self, name: str) -> Rollout | None:
        """``name``'s rollout under way, if any (None too for a service it does not know)."""
        state = self.reconciler.services.get(name)
        return state.observed.rollout if state is not None else None

    # -- apply and scale -----------------------------------------------------------------------

    @contextmanager
    def applying(self, source: str, by: str = "") -> Iterator[ApplySpan]:
        """An apply's span (``rollout_traces.ApplySpan``), sent as the block ends: refused,
        an error, if the block raises."""
        span = ApplySpan(self.wall_clock, source, by)
        try:
            yield span
        except ControllerError as e:
            span.refused(e.message)
            raise
        except BaseException as e:  # a bug, or cancelled (its client went away)
            span.refused(repr(e))
            raise
        finally:
            if self.traces is not None:
                self.traces.applied(span)

    async def apply(self, data: Any, span: ApplySpan | None = None) -> ApplyResult:
        """Apply a spec. ``span``: the apply's, begun by the caller (``applying``); without
        one, the apply has a span of its own (source ``call``)."""
        if span is None:
            with self.applying("call") as own:
                return await self.apply(data, own)
        if isinstance(data, ServiceSpec):  # validated by the caller (its own phase)
            spec = data
        else:
            with span.phase("validate"):
                spec = validate_spec(data)
        span.named(spec.name)
        async with self._lock(spec.name):
            with span.phase("diff"):
                plan = self.plan_apply(spec)
            traced = self.traces.applying(span) if self.traces is not None else nullcontext()
            with traced:
                result = await self._apply(spec, plan, span)
        span.did(result.action, result.revision, result.previous_revision, result.changes)
        return result

    def plan_apply(self, data: Any) -> ApplyResult:
        """What ``apply(data)`` would do now, changing nothing (a dry run).

        Raises as ``apply`` would (SpecError, Conflict). For a new revision, ``revision`` is
        the number it would get and ``rollout_id`` is None.
        """
        spec = validate_spec(data)
        if spec.backend not in self.backends:
            raise SpecError(
                f"backend: {spec.backend!r} is not configured",
                [{"field": "backend", "reason": f"{spec.backend!r} is not configured"}],
            )
        clash = model_clash(
            spec,
            (s.spec for s in self.reconciler.services.values() if not s.forgotten),
        )
        if clash is not None:
            raise SpecError(clash, [{"field": "model", "reason": clash}])
        tls_problem = upstream_tls_problem(spec)
        if tls_problem is not None:
            field, reason = tls_problem
            raise SpecError(reason, [{"field": field, "reason": reason}])
        state = self.reconciler.services.get(spec.name)
        if state is not None and state.desired.deleting:
            raise Conflict(f"service {spec.name!r} is being deleted; apply again once it is gone")
        if state is None:
            # A deleted service's revisions remain: a re-created one continues their numbers.
            number = max((r.number for r in self.store.revisions(spec.name)), default=0) + 1
            return ApplyResult("created", spec.name, number)
        target_spec = state.revisions[state.desired.revision]
        changes = diff_fields(target_spec, spec)
        previous = state.desired.revision
        key = spec.template_key()
        if key != target_spec.template_key():
            # A template the service ran before keeps its revision (its number and identity),
            # as a rollback to an identical ReplicaSet does: back to what serves keeps its
            # replicas rather than replacing them all with an identical revision.
            same = [n for n, s in state.revisions.items() if s.template_key() == key]
            number = max(same) if same else max(state.revisions) + 1
            return ApplyResult("rollout", spec.name, number, previous, None, changes)
        if not changes:
            return ApplyResult("unchanged", spec.name, previous, previous)
        action: ApplyAction = "updated"
        if _count(spec, state) != state.desired.replicas:
            action = "scaled"
        return ApplyResult(action, spec.name, previous, previous, None, changes)

    async def _apply(self, spec: ServiceSpec, plan: ApplyResult, span: ApplySpan) -> ApplyResult:
        state = self.reconciler.services.get(spec.name)
        configure = _configure(spec)
        if plan.action == "created" or state is None:
            return await self._create(spec, span)
        if plan.action == "unchanged":
            return plan
        if plan.action == "rollout":
            number = plan.revision
            with span.phase("store write"):
                if number not in state.revisions:
                    number = self.store.add_revision(
                        spec.name, spec.template_key(), spec.to_json()
                    ).number
                self.store.update_service(
                    spec.name, spec_json=spec.to_json(), desired_replicas=_count(spec, state)
                )
            retarget = Retarget(number, "apply")
            with span.phase("plan"):
                await self.reconciler.submit(
                    state, [retarget, configure], spec=spec, revision=number
                )
            rollout = state.observed.rollout
            rollout_id = (
                rollout.id if rollout is not None and rollout.to_revision == number else None
            )
            return ApplyResult(
                "rollout", spec.name, number, plan.previous_revision, rollout_id, plan.changes
            )
        previous = state.desired.revision
        with span.phase("store write"):
            self.store.update_service(
                spec.name, spec_json=spec.to_json(), desired_replicas=_count(spec, state)
            )
        self.journal.record(
            spec.name, "service_updated", f"{plan.action}: {', '.join(plan.changes)}", previous
        )
        # Same template: the revision's record keeps its template, the rest applies now.
        with span.phase("plan"):
            await self.reconciler.submit(state, [configure], spec=spec, revision=previous)
        return ApplyResult(plan.action, spec.name, previous, previous, None, plan.changes)

    async def _create(self, spec: ServiceSpec, span: ApplySpan) -> ApplyResult:
        with span.phase("store write"):
            self.store.put_service(spec.name, spec.to_json(), spec.desired_replicas)
            revision = self.store.add_revision(spec.name, spec.template_key(), spec.to_json())
        self.executor.set_routing(spec)
        state = ServiceState(
            name=spec.name,
            spec=spec,
            revisions={revision.number: spec},
            desired=Desired(
                revision.number,
                spec.desired_replicas,
                spec.rollout,
                static=_static(spec),
                scaling=spec.autoscaling,
            ),
        )
        self.journal.record(
            spec.name,
            "service_created",
            f"service created at revision {revision.number} with {spec.desired_replicas} replicas",
            revision.number,
        )
        self.reconciler.add(state)
        with span.phase("plan"):
            await self.reconciler.submit(state, [])  # the loop begins its first rollout
        rollout = state.observed.rollout
        rollout_id = rollout.id if rollout is not None else None
        return ApplyResult("created", spec.name, revision.number, None, rollout_id)

    async def scale(self, name: str, replicas: int) -> ApplyResult:
        """Set the replica count; the template (and so the revision) stays as it is."""
        async with self._lock(name):
            state = self.state(name)
            if state.desired.deleting:
                raise Conflict(f"service {name!r} is being deleted")
            scaling = state.desired.scaling
            if scaling is not None:
                raise Conflict(
                    f"service {name!r} is autoscaled (replicas {scaling.min}..{scaling.max}): "
                    "apply its spec with another range, or with a fixed count to stop "
                    "autoscaling"
                )
            data = state.spec.model_dump(mode="json", exclude_unset=True) | {"replicas": replicas}
            spec = validate_spec(data)
            previous = state.desired.revision
            if spec.desired_replicas == state.desired.replicas and spec == state.spec:
                return ApplyResult("unchanged", name, previous, previous)
            self.store.update_service(
                name, spec_json=spec.to_json(), desired_replicas=spec.desired_replicas
            )
            self.journal.record(name, "service_updated", "scaled: replicas", previous)
            await self.reconciler.submit(state, [_configure(spec)], spec=spec)
            return ApplyResult("scaled", name, previous, previous, None, ("replicas",))

    # -- rollout control -----------------------------------------------------------------------

    def _active(self, state: ServiceState, *allowed: RolloutStatus) -> Rollout:
        rollout = state.observed.rollout
        if rollout is None or not rollout.active:
            raise Conflict(f"service {state.name!r} has no rollout in progress")
        if rollout.status not in allowed:
            raise Conflict(f"rollout {rollout.id} is {rollout.status.value}")
        return rollout

    def _now_active(self, state: ServiceState) -> Rollout:
        rollout = state.observed.rollout
        if rollout is None:
            raise Conflict(f"service {state.name!r} has no rollout in progress")
        return rollout

    async def pause(self, name: str) -> Rollout:
        async with self._lock(name):
            state = self.state(name)
            self._active(state, RolloutStatus.PROGRESSING)
            await self.reconciler.submit(state, [SetPaused(True)])
            return self._now_active(state)

    async def resume(self, name: str) -> Rollout:
        async with self._lock(name):
            state = self.state(name)
            self._active(state, RolloutStatus.PAUSED)
            await self.reconciler.submit(state, [SetPaused(False)])
            return self._now_active(state)

    async def promote(self, name: str) -> Rollout:
        """Skip the active rollout's remaining steps: a canary goes to 100 %, a blue/green
        switches, a rolling update starts every remaining replica at once."""
        async with self._lock(name):
            state = self.state(name)
            self._active(state, RolloutStatus.PROGRESSING, RolloutStatus.PAUSED)
            await self.reconciler.submit(state, [AskPromote()])
            return self._now_active(state)

    async def abort(self, name: str) -> Rollout:
        """Stop the rollout and return to the revision it started from."""
        async with self._lock(name):
            state = self.state(name)
            rollout = self._active(state, RolloutStatus.PROGRESSING, RolloutStatus.PAUSED)
            back_to = rollout.from_revision
            if back_to is None:
                raise Conflict(f"rollout {rollout.id} has no previous revision to return to")
            await self.reconciler.submit(state, [Retarget(back_to, "abort")])
            return self._now_active(state)

    async def undo(self, name: str, revision: int | None = None) -> Rollout:
        """Roll back to the previous revision (or ``revision``) as a new rollout."""
        async with self._lock(name):
            state = self.state(name)
            current = state.desired.revision
            if revision is None:
                rollout = state.observed.rollout
                if rollout is not None and rollout.active and rollout.from_revision is not None:
                    revision = rollout.from_revision
                else:
                    earlier = [n for n in state.revisions if n < current]
                    if not earlier:
                        raise Conflict(f"service {name!r} has no revision before {current}")
                    revision = max(earlier)
            if revision not in state.revisions:
                raise NotFound(f"service {name!r} has no revision {revision}", service=name)
            if revision == current:
                raise Conflict(f"service {name!r} already targets revision {revision}")
            await self.reconciler.submit(state, [Retarget(revision, "undo")])
            return self._now_active(state)

    async def delete(self, name: str) -> None:
        """Drain and stop every replica, then forget the service."""
        async with self._lock(name):
            state = self.state(name)
            await self.reconciler.submit(state, [Delete()])

    # -- maintenance ---------------------------------------------------------------------------

    def drain_upstream(self, name: str, upstream_id: str) -> None:
        state = self.state(name)
        if self.pool.upstream(name, upstream_id) is None:
            raise NotFound(f"no upstream {upstream_id!r} in {name!r}", service=name)
        timeout = state.spec.rollout.drain_timeout
        self.pool.drain(name, upstream_id, timeout)
        self.journal.record(name, "upstream_drained", f"upstream {upstream_id} drained by request")

    def undrain_upstream(self, name: str, upstream_id: str) -> None:
        self.state(name)
        if self.pool.upstream(name, upstream_id) is None:
            raise NotFound(f"no upstream {upstream_id!r} in {name!r}", service=name)
        self.pool.undrain(name, upstream_id)
        self.journal.record(name, "upstream_undrained", f"upstream {upstream_id} undrained")

    # -- bearer tokens -------------------------------------------------------------------------

    def _auth(self, name: str) -> ServiceState:
        state = self.state(name)
        if state.spec.auth is None:
            reason = "the service has no auth: apply a spec with auth: {type: bearer} first"
            raise Conflict(f"auth: {reason}", errors=[{"field": "auth", "reason": reason}])
        return state

    def tokens(self, name: str) -> list[TokenInfo]:
        """The service's tokens by id (never a token, nor its digest)."""
        auth = self.state(name).spec.auth
        configured = bearer.configured(auth) if auth is not None else {}
        stored = [(r.id, r.label, r.created_at) for r in self.store.tokens(name)]
        return bearer.infos(configured.values(), stored)

    def add_token(self, name: str, token: str | None, label: str) -> tuple[TokenInfo, str]:
        """Keep a token for the service (a new one if ``token`` is None) and apply it at
        once, here and in every worker; the token is returned to be shown once."""
        state = self._auth(name)
        token = token if token is not None else bearer.new_token()
        row = self.store.add_token(name, bearer.new_id(), bearer.digest(token), label)
        self.executor.set_routing(state.spec)
        self.journal.record(name, "service_updated", f"token {row.id} added")
        return TokenInfo(row.id, "api", row.label, row.created_at), token

    def revoke_token(self, name: str, token_id: str) -> None:
        """Forget a token added through the API; it is refused from now on."""
        state = self.state(name)
        if token_id.startswith(("file:", "env:")):
            reason = f"{token_id} comes from the spec's auth.tokens_{token_id.split(':')[0]}"
            raise Conflict(f"token: {reason}: remove it there", service=name)
        self.store.revoke_token(name, token_id)
        self.executor.set_routing(state.spec)
        self.journal.record(name, "service_updated", f"token {token_id} revoked")

    # -- start-up ------------------------------------------------------------------------------

    def restore(self) -> None:
        """Bring back every stored service on its revisions, adopting running replicas."""
        now, wall = self.clock(), self.wall_clock()
        for row in self.store.services():
            try:
                self._restore_one(row.name, now, wall)
            except Exception:
                log.exception("service %s could not be restored", row.name)

    def _restore_one(self, name: str, now: float, wall: float) -> None:
        row = self.store.service(name)
        assert row is not None
        spec = ServiceSpec.model_validate_json(row.spec_json)
        revisions = {
            r.number: ServiceSpec.model_validate_json(r.spec_json)
            for r in self.store.revisions(name)
        }
        if not revisions:
            return
        active = self.store.active_rollout(name)
        target = (
            active.to_revision
            if active is not None
            else row.target_revision or row.serving_revision or max(revisions)
        )
        # Routing and strategy are the latest spec's; the template is the revision's.
        if spec.template_key() == revisions[target].template_key():
            revisions[target] = spec
        self.executor.set_routing(spec)
        rollout = None
        if active is not None:
            rollout = Rollout(
                active.id,
                active.from_revision,
                active.to_revision,
                active.kind,
                RolloutStatus(active.status),
                now - max(0.0, wall - active.started_at),
                active.retries_used,
                active.reason,
            )
        adopted: list[tuple[Replica, Running]] = []
        for stored in self.store.replicas(name):
            spec_of = revisions.get(stored.revision)
            backend = self.backends.get(stored.backend)
            handle = json.loads(stored.handle_json)
            running = None
            if spec_of is not None and backend is not None:
                launch = Launch(name, stored.revision, stored.replica_id, spec_of.replica)
                running = backend.adopt(launch, handle)
            if running is None or spec_of is None:
                self.store.remove_replica(name, stored.replica_id)
                continue
            replica = Replica(
                stored.replica_id, stored.revision, ReplicaState.STARTING, created=now, since=now
            )
            address = self.executor.upstream_of(name, spec_of, replica, running).address
            adopted.append((replica.replace(address=address), running))
        paused = rollout is not None and rollout.status is RolloutStatus.PAUSED
        autoscaling = spec.autoscaling
        state = ServiceState(
            name=name,
            spec=spec,
            revisions=revisions,
            desired=Desired(
                target,
                autoscaling.clamp(row.desired_replicas) if autoscaling else row.desired_replicas,
                spec.rollout,
                paused=paused,
                static=_static(revisions[target]),
                scaling=autoscaling,
            ),
            observed=Observed(
                replicas=tuple(replica for replica, _ in adopted),
                serving_revision=row.serving_revision,
                rollout=rollout,
                target=target,
            ),
        )
        for replica, running in adopted:
            self.executor.adopt(state, replica, running)
        serving = "nothing" if row.serving_revision is None else row.serving_revision
        self.journal.record(
            name,
            "service_restored",
            f"restored at revision {target} (serving {serving}), "
            f"{len(adopted)} running replicas adopted",
            target,
        )
        self.reconciler.add(state)

    # -- views ---------------------------------------------------------------------------------

    def service_names(self) -> list[str]:
        return sorted(n for n, s in self.reconciler.services.items() if not s.forgotten)

    async def close(self, stop_replicas: bool = False) -> None:
        """Stop the loops first (so no exit is taken for a crash and replaced), finish the
        starts and stops in progress, then stop the replicas if asked, then the backends."""
        await self.reconciler.close()
        if stop_replicas:
            await self.executor.stop_all(self.reconciler.services)
        for backend in self.backends.values():
            await backend.close()

    def __repr__(self) -> str:
        return f"<Controller services={len(self.reconciler.services)}>"


def _static(spec: ServiceSpec) -> bool:
    return spec.backend == "static"


def _count(spec: ServiceSpec, state: ServiceState) -> int:
    """The count an apply of ``spec`` leaves ``state`` at: the spec's, or for an autoscaled
    one the count it has, within the range (``transitions.intend``, ``Configure``)."""
    scaling = spec.autoscaling
    return spec.desired_replicas if scaling is None else scaling.clamp(state.desired.replicas)


def _configure(spec: ServiceSpec) -> Configure:
    return Configure(spec.desired_replicas, spec.rollout, _static(spec), spec.autoscaling)
