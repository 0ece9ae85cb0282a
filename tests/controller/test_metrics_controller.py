"""The controller's metrics follow its services and count how their rollouts end."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from controller.backends.docker import DockerBackend, DockerHost
from controller.metrics import (
    EXIT_REASONS,
    OUTCOMES,
    REPLICA_STATES,
    ControllerMetrics,
    DockerHostMetrics,
    HostJournal,
    exit_reason,
    register,
)
from controller.planning.model import ReplicaState
from tests.needs import missing

from .conftest import Harness, spec


@pytest.fixture
def registry(h: Harness) -> CollectorRegistry:
    registry = CollectorRegistry()
    register(registry, h.controller)
    return registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def replicas(registry: CollectorRegistry, revision: str, service: str = "web") -> dict:
    counts = {
        s.value: value(
            registry, "gateway_service_replicas", service=service, revision=revision, state=s
        )
        for s in REPLICA_STATES
    }
    return {s: n for s, n in counts.items() if n}


def rollouts(registry: CollectorRegistry, service: str = "web") -> dict:
    return {
        o: value(registry, "gateway_rollouts_total", service=service, outcome=o) for o in OUTCOMES
    }


async def test_replica_gauges_follow_the_service(h: Harness, registry) -> None:
    await h.controller.apply(spec("web", 2))
    await h.settle()
    assert replicas(registry, "1") == {"starting": 2}
    assert value(registry, "gateway_service_desired_replicas", service="web") == 2
    assert value(registry, "gateway_service_degraded", service="web") == 1
    assert value(registry, "gateway_rollout_in_progress", service="web") == 1
    # Every state is there, at 0 when empty, so sums and graphs have no gaps.
    ready = value(registry, "gateway_service_replicas", service="web", revision="1", state="ready")
    assert ready == 0

    await h.pass_probes("web")
    assert replicas(registry, "1") == {"ready": 2}
    assert value(registry, "gateway_service_degraded", service="web") == 0
    assert value(registry, "gateway_rollout_in_progress", service="web") == 0
    assert rollouts(registry) == {"complete": 1, "failed": 0, "aborted": 0, "rolled_back": 0}
    assert value(registry, "gateway_rollout_duration_seconds_count", service="web") == 1

    await h.controller.scale("web", 3)
    await h.settle()
    assert value(registry, "gateway_service_desired_replicas", service="web") == 3
    assert replicas(registry, "1") == {"ready": 2, "starting": 1}


async def test_a_failed_rollout_is_counted_and_its_rollback_too(h: Harness, registry) -> None:
    await h.controller.apply(spec("web", 2))
    await h.settle()
    await h.pass_probes("web")
    for _ in range(3):
        h.backend.exit_on_start(3)
    await h.controller.apply(spec("web", 2, version="bad"))
    await h.settle()
    assert value(registry, "gateway_rollout_in_progress", service="web") == 1
    for _ in range(10):
        await h.advance(10)
    assert rollouts(registry) == {"complete": 1, "failed": 1, "aborted": 0, "rolled_back": 1}
    assert value(registry, "gateway_rollout_in_progress", service="web") == 0
    assert replicas(registry, "1") == {"ready": 2}
    assert replicas(registry, "2") == {}  # its replicas failed: not counted
    count = value(registry, "gateway_rollout_duration_seconds_count", service="web")
    assert count == 3
    # The failed rollout took at least the backoff of its three failed starts.
    within_5s = value(registry, "gateway_rollout_duration_seconds_bucket", service="web", le="5.0")
    assert within_5s is not None
    assert within_5s < count


async def test_an_aborted_rollout_is_counted(h: Harness, registry) -> None:
    await h.controller.apply(spec("web", 1))
    await h.settle()
    await h.pass_probes("web")
    await h.controller.apply(spec("web", 1, version="v2"))
    await h.settle()
    assert replicas(registry, "2") == {"starting": 1}
    await h.controller.abort("web")
    await h.settle()
    assert rollouts(registry)["aborted"] == 1


async def test_a_deleted_service_leaves_no_series(h: Harness, registry) -> None:
    await h.controller.apply(spec("web", 2))
    await h.controller.apply(spec("api", 1))
    await h.settle()
    await h.pass_probes("web")
    assert 'service="web"' in generate_latest(registry).decode()

    await h.controller.delete("web")
    await h.settle()
    text = generate_latest(registry).decode()
    assert 'service="web"' not in text
    assert 'service="api"' in text


def exits(registry: CollectorRegistry, revision: str = "1", service: str = "web") -> dict:
    return {
        r: value(
            registry,
            "gateway_replica_exits_total",
            service=service,
            revision=revision,
            reason=r,
        )
        for r in EXIT_REASONS
    }


async def test_replica_exits_are_counted_by_reason(h: Harness, registry) -> None:
    await h.controller.apply(spec("web", 3))
    await h.settle()
    await h.pass_probes("web")
    # From 0, so that increase() sees the first one.
    assert exits(registry) == dict.fromkeys(EXIT_REASONS, 0)
    first, second, _ = (r.id for r in h.replicas("web", ReplicaState.READY))
    h.backend.kill(first, -9)  # SIGKILL: the OOM killer, or kill -9
    h.backend.kill(second, 3)
    await h.settle()
    # The crashed replicas' upstreams left the pool at once; the count stays.
    assert h.pool.upstream("web", first) is None
    assert exits(registry) == {**dict.fromkeys(EXIT_REASONS, 0), "signaled": 1, "exited_nonzero": 1}
    await h.pass_probes("web")
    await h.controller.scale("web", 2)
    for _ in range(5):
        await h.advance(31)
    counted = exits(registry)
    stops = sum(1 for e in h.store.events("web") if e.kind == "replica_stopped")
    assert stops >= 1
    assert (counted["signaled"], counted["exited_nonzero"], counted["stopped"]) == (1, 1, stops)


@pytest.mark.parametrize(
    ("kind", "code", "reason"),
    [
        ("replica_stopped", 0, "stopped"),
        ("replica_stopped", -15, "stopped"),
        ("replica_stopped", None, "stopped"),  # a static replica released
        ("replica_stopped", -9, "stop_timeout"),
        ("replica_failed", 0, "exited_zero"),
        ("replica_failed", 1, "exited_nonzero"),
        ("replica_failed", -11, "signaled"),
        ("replica_failed", None, None),  # a start that failed: no process ended
        ("replica_ready", None, None),
    ],
)
def test_exit_reasons(kind: str, code: int | None, reason: str | None) -> None:
    assert exit_reason(kind, code) == reason


def test_describe_names_every_family(h: Harness) -> None:
    names = {m.name for m in ControllerMetrics(h.controller.reconciler).describe()}
    assert names == {
        "gateway_service_replicas",
        "gateway_service_desired_replicas",
        "gateway_service_degraded",
        "gateway_rollout_in_progress",
        "gateway_rollouts",
        "gateway_rollout_duration_seconds",
        "gateway_replica_exits",
    }
    assert ReplicaState.STOPPED not in REPLICA_STATES


async def test_promtool_accepts_the_exposition(h: Harness, registry) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool is not installed (Debian package 'prometheus')")
    await h.controller.apply(spec("web", 2))
    await h.settle()
    await h.pass_probes("web")
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


async def test_a_docker_host_that_does_not_answer_is_down_and_journalled(
    h: Harness, tmp_path
) -> None:
    # No engine listens on this socket: the first attempt fails (a change, from unknown).
    down = DockerHost("down", f"unix://{tmp_path}/none.sock", port_range=(23990, 23999))
    backend = DockerBackend([down], "test-instance")
    backend.host_listeners.append(HostJournal(h.controller.journal))
    registry = CollectorRegistry()
    registry.register(DockerHostMetrics([backend]))
    try:
        await backend.connect()
        assert value(registry, "gateway_docker_host_up", host="down") == 0
        [entry] = [e for e in h.controller.journal.since(0) if e.service == "docker:down"]
        assert entry.kind == "host_unreachable"
        assert entry.message.startswith(f"docker host down unreachable: engine unix://{tmp_path}")
    finally:
        await backend.close()
