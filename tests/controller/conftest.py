"""Shared fixtures for controller tests: a controller on the fake backend and a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from controller.backends import FakeBackend
from controller.journal import Journal
from controller.operations import Controller
from controller.planning.model import ReplicaState
from controller.store import Store
from gateway import Health, Pool
from tests.support.admin_client import admin_client  # noqa: F401 - a fixture of the admin API tests
from tests.support.clock import FakeClock
from tests.support.etcd_cluster import EtcdCluster


@dataclass
class Harness:
    controller: Controller
    backend: FakeBackend
    pool: Pool
    store: Store
    clock: FakeClock

    async def settle(self, rounds: int = 30) -> None:
        """Let every loop and task run until nothing is left to do (no time passes)."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for name in list(self.controller.reconciler.services):
            self.controller.reconciler.wake(name)
        await self.settle()

    def replicas(self, name: str, *states: ReplicaState, revision: int | None = None) -> list[Any]:
        state = self.controller.reconciler.services[name]
        return [
            r
            for r in state.observed.replicas
            if (not states or r.state in states) and (revision is None or r.revision == revision)
        ]

    def ready(self, name: str, revision: int | None = None) -> int:
        return len(self.replicas(name, ReplicaState.READY, revision=revision))

    async def pass_probes(self, name: str, revision: int | None = None) -> None:
        """Every starting replica (of ``revision``) passes its probes."""
        for r in self.replicas(name, ReplicaState.STARTING, revision=revision):
            self.pool.set_health(name, r.id, Health.HEALTHY, "probe passed")
        await self.settle()

    def state(self, name: str) -> Any:
        return self.controller.reconciler.services[name]


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    clock = FakeClock()
    pool = Pool(clock=clock)
    store = Store(tmp_path / "state.db", clock=lambda: clock.now + 1_700_000_000)
    backend = FakeBackend()
    journal = Journal(store, lambda: clock.now)
    controller = Controller(pool, {"process": backend}, store, journal, clock, clock)
    h = Harness(controller, backend, pool, store, clock)
    yield h
    await controller.close()
    store.close()


def spec(name: str = "web", replicas: int = 2, version: str = "v1", **extra: Any) -> dict[str, Any]:
    rollout = {"retry_backoff": 1, "max_retry_backoff": 8, "start_timeout": 60}
    rollout.update(extra.pop("rollout", {}))
    return {
        "name": name,
        "route": {"path_prefix": f"/{name}"},
        "replicas": replicas,
        "replica": {"commands": ["serve"], "env": {"VERSION": version}},
        "rollout": rollout,
        **extra,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Three real etcd members on loopback, one cluster per test module (each test its own
    key prefix). A module may define its own ``cluster`` instead."""
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), 3) as c:
        yield c
