"""What the admin API shows of the controller: ServiceState and store rows as response models.

Read-only: nothing here changes a service. Monotonic times of the observed state are turned
into wall-clock seconds with the controller's two clocks, read once per view.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from math import ceil
from typing import Any

from aiohttp import web

from gateway import Upstream

from ..acme import AcmeManager
from ..acme.manager import CertificateStatus
from ..backends import Backend
from ..operations import Controller
from ..planning import autoscaler, planner, steps
from ..planning.model import LIVE, Replica, ReplicaState, Rollout, RolloutStatus
from ..rollout_traces import trace_id
from ..spec import ServiceSpec
from ..state import ServiceState
from ..store import RevisionRow, RolloutRow
from .bodies import (
    AuthView,
    AutoscalingView,
    BackoffView,
    CertificateList,
    CertificateView,
    Conditions,
    GuardsView,
    HostView,
    RateLimitView,
    ReplicaView,
    RevisionProgress,
    RevisionView,
    RolloutRecord,
    RolloutView,
    ServiceStatus,
    ServiceView,
    UpstreamView,
)
from .openapi import Operation

Wall = Callable[[float], float]


def _to_wall(controller: Controller) -> Wall:
    offset = controller.wall_clock() - controller.clock()
    return lambda monotonic: round(monotonic + offset, 3)


def _inflight(controller: Controller, service: str) -> dict[str, int]:
    try:
        return controller.pool.service(service).inflight_all()
    except KeyError:  # the pool forgot the service (deleted) before the controller did
        return {}


def replica_view(
    controller: Controller,
    state: ServiceState,
    replica: Replica,
    inflight: dict[str, int],
    wall: Wall,
) -> ReplicaView:
    upstream = controller.pool.upstream(state.name, replica.id)
    return ReplicaView(
        id=replica.id,
        revision=replica.revision,
        address=replica.address,
        state=replica.state.value,
        health=None if upstream is None else upstream.state,
        inflight=inflight.get(replica.id, 0),
        since=wall(replica.since),
        failure=replica.failure or None,
        exit_code=replica.exit_code,
        probe_failure=None if replica.healthy else replica.probe_failure or None,
    )


def progress(state: ServiceState, rollout: Rollout) -> list[RevisionProgress]:
    """Ready and live replicas of the target revision (first) and of every other one."""
    revisions = {rollout.to_revision} | {
        r.revision for r in state.observed.replicas if not r.terminal
    }
    ordered = [rollout.to_revision, *sorted(revisions - {rollout.to_revision}, reverse=True)]
    out = []
    for revision in ordered:
        of = [r for r in state.observed.replicas if r.revision == revision]
        out.append(
            RevisionProgress(
                revision=revision,
                ready=sum(1 for r in of if r.state is ReplicaState.READY),
                live=sum(1 for r in of if r.state in LIVE),
                desired=state.desired.replicas if revision == rollout.to_revision else 0,
            )
        )
    return out


def rollout_view(
    controller: Controller, state: ServiceState, rollout: Rollout, wall: Wall | None = None
) -> RolloutView:
    wall = wall or _to_wall(controller)
    return RolloutView(
        id=rollout.id,
        kind=rollout.kind,
        status=rollout.status.value,
        from_revision=rollout.from_revision,
        to_revision=rollout.to_revision,
        started=wall(rollout.started),
        failures=rollout.failures,
        retries=state.desired.strategy.retries,
        reason=rollout.reason,
        progress=progress(state, rollout),
        **_staged(state, rollout),
    )


def _staged(state: ServiceState, rollout: Rollout) -> dict[str, Any]:
    """A canary's or blue/green's step, weights and last analysis."""
    if not rollout.staged:
        return {"strategy": rollout.strategy, "promoted": rollout.promoted}
    weights = steps.step_weights(rollout, state.desired.strategy)
    return {
        "strategy": rollout.strategy,
        "step": min(rollout.step, len(weights) - 1) + 1,
        "steps": len(weights),
        "weight": rollout.weight,
        "weights": list(weights),
        "promoted": rollout.promoted,
        "analysis": rollout.analysis or None,
        "verdict": rollout.verdict,
    }


def service_status(state: ServiceState) -> ServiceStatus:
    rollout = state.observed.rollout
    if state.desired.deleting:
        return "deleting"
    if rollout is not None and rollout.active:
        return "paused" if rollout.status is RolloutStatus.PAUSED else "progressing"
    if state.observed.degraded:
        return "degraded"
    return "ready"


def service_view(controller: Controller, state: ServiceState) -> ServiceView:
    inflight = _inflight(controller, state.name)
    wall = _to_wall(controller)
    rollout = state.observed.rollout
    replicas = sorted(state.observed.replicas, key=lambda r: (r.terminal, r.created, r.id))
    return ServiceView(
        name=state.name,
        status=service_status(state),
        spec=state.spec.model_dump(mode="json", exclude_unset=True),
        serving_revision=state.observed.serving_revision,
        target_revision=state.desired.revision,
        desired=state.desired.replicas,
        ready=sum(1 for r in state.observed.replicas if r.state is ReplicaState.READY),
        replicas=[replica_view(controller, state, r, inflight, wall) for r in replicas],
        conditions=Conditions(
            degraded=state.observed.degraded is not None, reason=state.observed.degraded
        ),
        rollout=None
        if rollout is None or not rollout.active
        else rollout_view(controller, state, rollout, wall),
        backoff=backoff_view(state, wall),
        autoscaling=autoscaling_view(state, wall),
        guards=guards_view(controller, state.name),
        warnings=spec_warnings(state.spec),
    )


def spec_warnings(spec: ServiceSpec) -> list[str]:
    """What ``spec`` allows that weakens the service, in words for its view."""
    tls = spec.upstream_tls
    if tls is not None and not tls.verify:
        return [
            "upstream_tls.verify is false: the replicas' certificates are not checked, so "
            "anyone on the path to them can pose as a replica"
        ]
    return []


def backoff_view(state: ServiceState, wall: Wall) -> BackoffView | None:
    """The backoff while the service wants starts of its target (as the planner applies it):
    not after a scale down to what it has, though the failures count until one is ready."""
    backoff = state.observed.backoff
    retry = planner.retry_at(backoff, state.desired.strategy)
    target = state.desired.revision
    live = sum(1 for r in state.observed.replicas if r.revision == target and r.state in LIVE)
    if retry is None or live >= state.desired.replicas:
        return None
    return BackoffView(
        failures=backoff.failures,
        reason=backoff.reason or None,
        last_failure_at=wall(backoff.last_failure_at),
        retry_at=wall(retry),
    )


def guards_view(controller: Controller, name: str) -> GuardsView | None:
    """Auth, rate limits, affinity and the in-flight cap of the service, with their counts
    (here and in the workers); None when it has none of them."""
    sp = controller.pool.services.get(name)
    if sp is None:
        return None
    routing = sp.routing
    cap = routing.limits.max_in_flight_per_replica
    if routing.auth is None and not routing.rate_limits and routing.affinity is None and not cap:
        return None
    counts = sp.counted_all()
    auth = routing.auth
    return GuardsView(
        auth=None
        if auth is None
        else AuthView(
            header=auth.header,
            pass_token=auth.pass_token,
            tokens=len(auth.tokens),
            ok=int(counts.get("auth_ok", 0)),
            missing=int(counts.get("auth_missing", 0)),
            wrong=int(counts.get("auth_wrong", 0)),
        ),
        rate_limits=[
            RateLimitView(
                path_prefix=r.path_prefix, key=r.key, rps=r.rps, burst=r.burst or ceil(r.rps)
            )
            for r in routing.rate_limits
        ],
        rate_limited=int(counts.get("rate_limited", 0)),
        affinity=routing.affinity,
        max_in_flight_per_replica=cap,
        queued=sp.queued_all(),
        queue_rejected=int(counts.get("queue_timeout", 0) + counts.get("queue_full", 0)),
    )


def autoscaling_view(state: ServiceState, wall: Wall) -> AutoscalingView | None:
    scaling = state.desired.scaling
    if scaling is None:
        return None
    memory = state.observed.scaler
    samples = state.observed.samples
    holding = None
    if samples:  # as of the latest sample
        count = state.desired.replicas
        now = samples[-1].at
        decision = autoscaler.desired(now, samples, count, scaling, memory)
        if decision.count == count and decision.reason:
            holding = decision.reason
    return AutoscalingView(
        min=scaling.min,
        max=scaling.max,
        metric=scaling.metric,
        target=scaling.target,
        held=samples[-1].held if samples else 0,
        decision=memory.decision or None,
        decided_at=None if memory.decided_at is None else wall(memory.decided_at),
        holding=holding,
    )


def upstream_view(controller: Controller, upstream: Upstream) -> UpstreamView:
    return UpstreamView(
        service=upstream.service,
        id=upstream.id,
        address=upstream.address,
        revision=upstream.revision,
        state=upstream.state,
        health=upstream.health.value,
        admin=upstream.admin.value,
        ejected=upstream.ejected,
        inflight=_inflight(controller, upstream.service).get(upstream.id, 0),
    )


def revision_view(state: ServiceState, row: RevisionRow) -> RevisionView:
    spec: Any = json.loads(row.spec_json)
    return RevisionView(
        number=row.number,
        template_key=row.template_key,
        created_at=row.created_at,
        spec=spec,
        serving=row.number == state.observed.serving_revision,
        target=row.number == state.desired.revision,
    )


def rollout_record(row: RolloutRow) -> RolloutRecord:
    return RolloutRecord(
        id=row.id,
        kind=row.kind,
        status=row.status,
        from_revision=row.from_revision,
        to_revision=row.to_revision,
        reason=row.reason,
        retries_used=row.retries_used,
        started_at=row.started_at,
        finished_at=row.finished_at,
        trace_id=trace_id(row.service, row.id),
    )


def host_views(backends: Mapping[str, Backend]) -> list[HostView]:
    """Each backend's hosts: a Docker Engine each (``hosts()``), the local machine for the
    process backend; the static backend runs nothing."""
    views = []
    for name, backend in backends.items():
        hosts = getattr(backend, "hosts", None)
        if callable(hosts):
            views += [
                HostView(
                    backend=name,
                    name=h.name,
                    engine=h.engine,
                    reachable=h.reachable,
                    error=h.error,
                    replicas=h.replicas,
                    capacity=h.capacity,
                )
                for h in hosts()
            ]
        elif name == "process":
            views.append(
                HostView(
                    backend=name,
                    name="local",
                    engine="local",
                    reachable=True,
                    error="",
                    replicas=backend.in_use,
                    capacity=backend.capacity,
                )
            )
    return views


# -- certificates (ACME) ----------------------------------------------------------------------


def certificate_view(status: CertificateStatus) -> CertificateView:
    return CertificateView(
        name=status.name,
        services=list(status.services),
        state=status.state,
        names=list(status.names),
        issuer=status.issuer,
        not_before=status.not_before,
        not_after=status.not_after,
        next_order=status.next_order,
        ordering=status.ordering,
        failures=status.failures,
        last_error=status.last_error,
    )


def certificate_list(manager: AcmeManager | None) -> CertificateList:
    if manager is None:
        return CertificateList(enabled=False, directory=None, certificates=[])
    return CertificateList(
        enabled=True,
        directory=manager.config.directory,
        certificates=[certificate_view(s) for s in manager.status()],
    )


def certificates_operation(manager: AcmeManager | None) -> Operation:
    """``GET /api/certificates`` (mounted by ``build_admin_app``'s ``extra_routes``)."""

    async def list_certificates(request: web.Request) -> web.Response:
        body = certificate_list(manager).model_dump_json()
        return web.json_response(text=body)

    return Operation(
        "GET",
        "/api/certificates",
        list_certificates,
        "Certificates obtained by ACME: names, expiry, next renewal, last error",
        {200: CertificateList},
    )
