"""Prometheus metrics of the control plane: services, their replicas and their rollouts.

``ControllerMetrics`` is a custom collector (prometheus_client's): at every scrape it reads the
reconciler's services as they are, so a deleted service's series are gone by construction.
Rollout ends (``Executor.rollout_listeners``) are counted in plain dicts, emitted the same way
and forgotten with their service.

    gateway_service_replicas{service,revision,state}   replicas not yet stopped or failed
    gateway_service_desired_replicas{service}
    gateway_service_degraded{service}                  1 while the service reports degraded
    gateway_rollout_in_progress{service}               1 while a rollout is progressing or paused
    gateway_rollouts_total{service,outcome}            complete, failed, aborted, rolled_back
    gateway_rollout_duration_seconds{service}          histogram, from start to end
    gateway_replica_exits_total{service,revision,reason}  replicas' processes that ended
    gateway_service_held_requests{service}             requests held for a routable replica
    gateway_service_cold_starts_total{service}         scales from zero that reached a replica
    gateway_service_cold_start_duration_seconds{service}  histogram, decision to replica ready
    gateway_docker_host_up{host}                       1 while the host's engine answers, else 0
    gateway_acme_orders_total{outcome}                 ACME orders ended: issued, renewed, failed
    gateway_acme_certificate_failures{name}            orders failed in a row for the host
    gateway_acme_certificate_next_order_timestamp_seconds{name}  when its renewal or retry is due

Replica exits are counted from the journal (``Journal.listen``): an entry that a replica
stopped or failed, once the controller took the exit in, with the exit status it saw. A
crash thus stays visible after the replica's upstream and its ``gateway_upstream_up`` series
left the pool (at once: a series at 0 would need the data plane to keep it).

A Docker host that goes unreachable or comes back is also a journal entry (``host_unreachable``,
``host_reachable``), under the service name ``docker:<host>``: no service has that name, and
a watcher of all events sees it among the replicas it concerns.
"""

from __future__ import annotations

import bisect
import signal
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from .acme import AcmeManager
from .acme.manager import ORDER_OUTCOMES
from .journal import Entry, Journal
from .operations import Controller
from .planning.model import LEAVING, LIVE, EventKind, ReplicaState

if TYPE_CHECKING:  # imported by main only when a Docker backend is configured
    from .backends.docker import DockerBackend, HostState
from .reconciler import Reconciler

REPLICA_STATES: tuple[ReplicaState, ...] = tuple(s for s in ReplicaState if s in LIVE | LEAVING)
"""The states ``gateway_service_replicas`` reports (each as 0 when no replica is in it).

Stopped and failed replicas are left out: the controller keeps only the latest few of them,
so a count would say nothing."""

OUTCOMES = ("complete", "failed", "aborted", "rolled_back")
ExitReason = Literal["stopped", "stop_timeout", "exited_zero", "exited_nonzero", "signaled"]
EXIT_REASONS: tuple[ExitReason, ...] = (
    "stopped",
    "stop_timeout",
    "exited_zero",
    "exited_nonzero",
    "signaled",
)
"""Why a replica's process ended: asked to stop, within its grace or killed after it; or
on its own, with status 0, another status, or by a signal (a crash, the OOM killer)."""


def exit_reason(kind: str, code: int | None) -> ExitReason | None:
    """The reason a ``replica_stopped`` or ``replica_failed`` entry's replica, which ended
    with ``code`` (``-N``: signal N), ended; None when the entry is no exit (a start that
    failed, or an exit whose status is unknown)."""
    if kind == "replica_stopped":
        return "stop_timeout" if code == -signal.SIGKILL else "stopped"
    if kind != "replica_failed" or code is None:
        return None
    if code < 0:
        return "signaled"
    return "exited_zero" if code == 0 else "exited_nonzero"


ROLLOUT_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class _Durations:
    """One service's rollout durations, as a histogram's cumulative counts are built from."""

    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * len(ROLLOUT_BUCKETS)  # not cumulative; +Inf is ``count``
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(ROLLOUT_BUCKETS, seconds)
        if i < len(self.buckets):
            self.buckets[i] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip(ROLLOUT_BUCKETS, self.buckets, strict=True):
            total += n
            out.append((_le(bound), total))
        out.append(("+Inf", self.count))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class ControllerMetrics(Collector):
    """The service and rollout metrics of ``reconciler``'s services, read at scrape time."""

    def __init__(self, reconciler: Reconciler) -> None:
        self._reconciler = reconciler
        self._rollouts: dict[tuple[str, str], int] = {}
        self._durations: dict[str, _Durations] = {}
        self._exits: dict[tuple[str, int, ExitReason], int] = {}

    def on_entry(self, entry: Entry) -> None:
        """A journal listener: count a replica's exit by its reason."""
        if entry.kind not in ("replica_stopped", "replica_failed") or entry.replica is None:
            return
        state = self._reconciler.services.get(entry.service)
        replica = None if state is None else state.replica(entry.replica)
        if replica is None or not replica.terminal:  # failed, but still draining: no exit yet
            return
        reason = exit_reason(entry.kind, replica.exit_code)
        if reason is not None:
            key = (entry.service, replica.revision, reason)
            self._exits[key] = self._exits.get(key, 0) + 1

    def on_rollout(self, service: str, outcome: str, duration: float) -> None:
        """A ``RolloutListener``: a rollout of ``service`` ended with ``outcome``."""
        key = (service, outcome)
        self._rollouts[key] = self._rollouts.get(key, 0) + 1
        durations = self._durations.get(service)
        if durations is None:
            durations = self._durations[service] = _Durations()
        durations.observe(max(0.0, duration))

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        replicas, desired, degraded, in_progress, rollouts, durations, exits = self._families()
        services = {
            name: state
            for name, state in list(self._reconciler.services.items())
            if not state.forgotten
        }
        for name, state in services.items():
            counts: dict[tuple[int, str], int] = {}
            revisions = {state.desired.revision}
            for replica in state.observed.replicas:
                if replica.state in REPLICA_STATES:
                    revisions.add(replica.revision)
                    key = (replica.revision, replica.state.value)
                    counts[key] = counts.get(key, 0) + 1
            for revision in sorted(revisions):
                for s in REPLICA_STATES:
                    replicas.add_metric(
                        (name, str(revision), s.value), counts.get((revision, s.value), 0)
                    )
            desired.add_metric((name,), state.desired.replicas)
            degraded.add_metric((name,), 1 if state.observed.degraded else 0)
            rollout = state.observed.rollout
            in_progress.add_metric((name,), 1 if rollout is not None and rollout.active else 0)
            for outcome in OUTCOMES:
                rollouts.add_metric((name, outcome), self._rollouts.get((name, outcome), 0))
            d = self._durations.get(name) or _Durations()
            durations.add_metric((name,), d.cumulative(), d.sum)
            # Every reason of the target revision from 0, so increase() sees the first exit.
            exited = {(r, why): n for (svc, r, why), n in self._exits.items() if svc == name}
            exited_revisions = {r for r, _ in exited} | {state.desired.revision}
            for revision in sorted(exited_revisions):
                for why in EXIT_REASONS:
                    exits.add_metric((name, str(revision), why), exited.get((revision, why), 0))
        # Forget the rollouts of services that are gone (their series went with them).
        for ended in [k for k in self._rollouts if k[0] not in services]:
            del self._rollouts[ended]
        for gone in [s for s in self._durations if s not in services]:
            del self._durations[gone]
        for stale in [k for k in self._exits if k[0] not in services]:
            del self._exits[stale]
        yield from (replicas, desired, degraded, in_progress, rollouts)
        yield durations
        yield exits

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        CounterMetricFamily,
        HistogramMetricFamily,
        CounterMetricFamily,
    ]:
        return (
            GaugeMetricFamily(
                "gateway_service_replicas",
                "Replicas of the service by revision and state (stopped and failed left out).",
                labels=("service", "revision", "state"),
            ),
            GaugeMetricFamily(
                "gateway_service_desired_replicas",
                "The replica count the service's spec asks for.",
                labels=("service",),
            ),
            GaugeMetricFamily(
                "gateway_service_degraded",
                "1 while the service is degraded (fewer ready replicas than desired), else 0.",
                labels=("service",),
            ),
            GaugeMetricFamily(
                "gateway_rollout_in_progress",
                "1 while a rollout of the service is progressing or paused, else 0.",
                labels=("service",),
            ),
            CounterMetricFamily(
                "gateway_rollouts",
                "Rollouts ended, by outcome (complete, failed, aborted, rolled_back).",
                labels=("service", "outcome"),
            ),
            HistogramMetricFamily(
                "gateway_rollout_duration_seconds",
                "Time from a rollout's start to its end, whatever the outcome.",
                labels=("service",),
            ),
            CounterMetricFamily(
                "gateway_replica_exits",
                "Replica processes that ended, by reason (stopped, stop_timeout, exited_zero, "
                "exited_nonzero, signaled).",
                labels=("service", "revision", "reason"),
            ),
        )


COLD_START_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class AutoscalerMetrics(Collector):
    """Held requests (the pool's, every process's) and cold starts of autoscaled services."""

    def __init__(self, reconciler: Reconciler) -> None:
        self._reconciler = reconciler
        self._durations: dict[str, list[float]] = {}
        """Per service: counts per bucket of COLD_START_BUCKETS, then +Inf, then the sum."""

    def on_entry(self, entry: Entry) -> None:
        """A journal listener: a cold start ended; its duration is in the service's memory."""
        if entry.kind != "cold_start":
            return
        state = self._reconciler.services.get(entry.service)
        took = None if state is None else state.observed.scaler.last_cold_start
        if took is None:
            return
        counts = self._durations.setdefault(entry.service, [0.0] * (len(COLD_START_BUCKETS) + 2))
        counts[bisect.bisect_left(COLD_START_BUCKETS, took)] += 1
        counts[-1] += took

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        held, starts, durations = self._families()
        pools = self._reconciler.pool.services
        names = set()
        for name, state in list(self._reconciler.services.items()):
            if state.forgotten or state.desired.scaling is None:
                continue
            names.add(name)
            sp = pools.get(name)
            held.add_metric((name,), sp.held_all() if sp is not None else 0)
            starts.add_metric((name,), state.observed.scaler.cold_starts)
            counts = self._durations.get(name) or [0.0] * (len(COLD_START_BUCKETS) + 2)
            cumulative, total = [], 0.0
            for bound, n in zip((*COLD_START_BUCKETS, float("inf")), counts, strict=False):
                total += n
                cumulative.append(("+Inf" if bound == float("inf") else _le(bound), total))
            durations.add_metric((name,), cumulative, counts[-1])
        for gone in [s for s in self._durations if s not in names]:
            del self._durations[gone]
        yield from (held, starts, durations)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily]:
        return (
            GaugeMetricFamily(
                "gateway_service_held_requests",
                "Requests held now, waiting for a routable replica of the service.",
                labels=("service",),
            ),
            CounterMetricFamily(
                "gateway_service_cold_starts",
                "Scales of the service up from zero replicas that reached a ready replica.",
                labels=("service",),
            ),
            HistogramMetricFamily(
                "gateway_service_cold_start_duration_seconds",
                "Time from the autoscaler's scale up from zero to the first replica ready.",
                labels=("service",),
            ),
        )


class RolloutMetrics(Collector):
    """Canary and blue/green rollouts: the weight of each split, each analysis result."""

    def __init__(self, reconciler: Reconciler) -> None:
        self._reconciler = reconciler
        self._results: dict[tuple[str, str], int] = {}

    def on_entry(self, entry: Entry) -> None:
        """A journal listener: an analysis judged (its outcome is the rollout's verdict)."""
        if entry.kind != "rollout_analysis":
            return
        state = self._reconciler.services.get(entry.service)
        rollout = None if state is None else state.observed.rollout
        if rollout is None or rollout.verdict is None:
            return
        key = (entry.service, rollout.verdict)
        self._results[key] = self._results.get(key, 0) + 1

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        weight, results = self._families()
        names = set()
        for name, state in list(self._reconciler.services.items()):
            if state.forgotten:
                continue
            names.add(name)
            split = state.observed.split
            if split is not None:
                weight.add_metric((name, str(split[0])), split[1])
        for (name, outcome), count in list(self._results.items()):
            if name in names:
                results.add_metric((name, outcome), count)
            else:
                del self._results[(name, outcome)]
        yield from (weight, results)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily(
                "gateway_rollout_weight",
                "Percent of a service's requests its traffic split sends to the revision "
                "(canary, blue/green); absent without a split.",
                labels=("service", "revision"),
            ),
            CounterMetricFamily(
                "gateway_rollout_analysis",
                "Analyses of canary and blue/green steps by result (pass, fail, wait).",
                labels=("service", "result"),
            ),
        )


class DockerHostMetrics(Collector):
    """``gateway_docker_host_up{host}`` of the Docker backends' hosts, read at scrape time."""

    def __init__(self, backends: Sequence[DockerBackend]) -> None:
        self._backends = backends

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        up = self._family()
        for backend in self._backends:
            for host in backend.hosts():
                up.add_metric((host.name,), 1 if host.reachable else 0)
        yield up

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "gateway_docker_host_up",
            "1 while the Docker host's engine answers, else 0 (its replicas are left as they are).",
            labels=("host",),
        )


class HostJournal:
    """A Docker backend's ``HostListener``: each change of a host's reachability, journalled."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    def __call__(self, host: HostState) -> None:
        if host.reachable:
            kind: EventKind = "host_reachable"
            message = f"docker host {host.name} reachable again ({host.engine})"
        else:
            kind = "host_unreachable"
            message = (
                f"docker host {host.name} unreachable: {host.error}; "
                f"its {host.replicas} replicas are left as they are"
            )
        self._journal.record(f"docker:{host.name}", kind, message)


def register(registry: CollectorRegistry, controller: Controller) -> ControllerMetrics:
    """Register the controller's metrics on ``registry``; hear its rollouts end, its replicas
    exit and its Docker hosts come and go (journalled as they do)."""
    metrics = ControllerMetrics(controller.reconciler)
    registry.register(metrics)
    controller.executor.rollout_listeners.append(metrics.on_rollout)
    controller.journal.listen(metrics.on_entry)
    autoscaler = AutoscalerMetrics(controller.reconciler)
    registry.register(autoscaler)
    controller.journal.listen(autoscaler.on_entry)
    rollouts = RolloutMetrics(controller.reconciler)
    registry.register(rollouts)
    controller.journal.listen(rollouts.on_entry)
    return metrics


def register_docker(
    registry: CollectorRegistry, controller: Controller, docker: DockerBackend
) -> None:
    """The Docker hosts' metrics and events, for a gateway with a Docker backend (main
    imports that backend only then)."""
    registry.register(DockerHostMetrics([docker]))
    docker.host_listeners.append(HostJournal(controller.journal))


class AcmeMetrics(Collector):
    """The ACME manager's orders and certificates, read at scrape time (a host no route names
    any more is gone with its series). Expiry is the data plane's
    ``gateway_tls_certificate_expiry_timestamp_seconds``, of every certificate it serves."""

    def __init__(self, manager: AcmeManager) -> None:
        self._manager = manager

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        orders, failures, next_order = self._families()
        for outcome in ORDER_OUTCOMES:
            orders.add_metric((outcome,), self._manager.orders[outcome])
        for status in self._manager.status():
            if status.state == "skipped":
                continue
            failures.add_metric((status.name,), status.failures)
            if status.next_order is not None:
                next_order.add_metric((status.name,), status.next_order)
        yield from (orders, failures, next_order)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "gateway_acme_orders",
                "ACME orders ended, by outcome (issued, renewed, failed).",
                labels=("outcome",),
            ),
            GaugeMetricFamily(
                "gateway_acme_certificate_failures",
                "Orders for the host's certificate that failed in a row (0 after a success).",
                labels=("name",),
            ),
            GaugeMetricFamily(
                "gateway_acme_certificate_next_order_timestamp_seconds",
                "When the host's next order (its renewal, or the retry of a failure) is due.",
                labels=("name",),
            ),
        )


def register_acme(registry: CollectorRegistry, manager: AcmeManager) -> AcmeMetrics:
    """Register the ACME manager's metrics on ``registry``."""
    metrics = AcmeMetrics(manager)
    registry.register(metrics)
    return metrics
