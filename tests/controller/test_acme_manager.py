"""controller/acme/manager.py: the loop, driven by a fake wall clock and an orderer that signs
with a test CA (the real ACME client against real pebble is tests/e2e/test_acme.py).

Time only moves when a test advances the clock and wakes the manager; each test awaits the
journal entries the manager records."""

from __future__ import annotations

import asyncio
import io
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from controller.acme import AcmeManager, OrderFailed
from controller.acme.client import Issued
from controller.acme.manager import CertificateStatus
from controller.admin.views import certificate_list
from controller.cli.render import certificate_table
from controller.config import AcmeConfig
from controller.journal import Entry, Journal
from controller.metrics import register_acme
from controller.store import Store
from gateway import RouteConfig
from tests.support.clock import FakeClock
from tests.support.eventually import eventually

from .test_acme_ca import TestCA

HOST = "app.example.com"
START = 1_800_000_000.0
LIFETIME = 90 * 86_400.0
CONFIG = AcmeConfig(directory="https://ca.invalid/dir", retry_min=60, retry_max=600)


class Orderer:
    """Issues a certificate valid from the clock's now for LIFETIME, or fails as told."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.ca = TestCA("Fake ACME CA")
        self.hosts: list[str] = []
        self.failures: list[str] = []
        """Reasons of the next orders to fail, in order."""

    async def __call__(self, host: str) -> Issued:
        self.hosts.append(host)
        if self.failures:
            raise OrderFailed(self.failures.pop(0))
        now = self.clock()
        return self.ca.issue([host], now, now + LIFETIME)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.state_dir = tmp_path / "state"
        self.state_dir.mkdir(exist_ok=True)
        self.store = Store(self.state_dir / "gateway.db")
        self.clock = FakeClock(START)
        self.journal = Journal(self.store, self.clock)
        self.entries = self.journal.watch()
        self.orderer = Orderer(self.clock)
        self.routes: list[tuple[str, RouteConfig]] = [
            ("web", RouteConfig(hosts=(HOST, "*.example.com"), tls="acme"))
        ]
        self.reloads = 0
        self.managers: list[AcmeManager] = []

    async def reload(self) -> None:
        self.reloads += 1

    async def manager(self, config: AcmeConfig = CONFIG) -> AcmeManager:
        manager = AcmeManager(
            config,
            self.state_dir,
            lambda: self.routes,
            self.journal,
            self.reload,
            obtain=self.orderer,
            clock=self.clock,
            rng=random.Random(7),
        )
        await manager.start()
        self.managers.append(manager)
        return manager

    async def entry(self, timeout: float = 5.0) -> Entry:
        return await asyncio.wait_for(self.entries.get(), timeout)

    async def advance(self, manager: AcmeManager, seconds: float) -> None:
        self.clock.advance(seconds)
        manager.wake()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(tmp_path)
    yield r
    for manager in r.managers:
        await manager.stop()
    r.store.close()


def of(manager: AcmeManager, host: str = HOST) -> CertificateStatus:
    return next(s for s in manager.status() if s.name == host)


def scrape(manager: AcmeManager) -> str:
    registry = CollectorRegistry()
    register_acme(registry, manager)
    return generate_latest(registry).decode()


async def test_a_missing_certificate_is_obtained_stored_and_the_data_plane_told(rig: Rig) -> None:
    manager = await rig.manager()
    entry = await rig.entry()
    assert (entry.service, entry.kind) == ("web", "certificate_issued")
    assert entry.message.startswith(f"certificate for {HOST} issued by Fake ACME CA, valid until")
    assert rig.orderer.hosts == [HOST]  # the wildcard is not ordered
    assert (rig.state_dir / "acme/certificates" / HOST / "fullchain.pem").exists()
    await eventually(lambda: rig.reloads == 1, what="the reload")
    [skipped, valid] = manager.status()
    assert (valid.name, valid.state, valid.names, valid.failures) == (HOST, "valid", (HOST,), 0)
    assert valid.not_after == START + LIFETIME
    assert START + 0.6 * LIFETIME < (valid.next_order or 0) <= START + 2 / 3 * LIFETIME
    assert (skipped.name, skipped.state) == ("*.example.com", "skipped")
    assert "HTTP-01" in (skipped.last_error or "")
    assert 'gateway_acme_orders_total{outcome="issued"} 1.0' in scrape(manager)
    view = certificate_list(manager)
    assert view.enabled
    assert [c.state for c in view.certificates] == ["skipped", "valid"]


async def test_a_restart_reuses_the_stored_certificate_without_an_order(rig: Rig) -> None:
    first = await rig.manager()
    assert (await rig.entry()).kind == "certificate_issued"
    await first.stop()
    rig.clock.advance(86_400)
    second = await rig.manager()
    await eventually(
        lambda: len(second.status()) == 2 and of(second).state == "valid", what="status"
    )
    # Its next step is the renewal, two months on; nothing was ordered.
    assert (of(second).next_order or 0) > rig.clock() + 50 * 86_400
    await asyncio.sleep(0.05)  # a window for an order it should not place
    assert rig.orderer.hosts == [HOST]
    assert second.orders == {"issued": 0, "renewed": 0, "failed": 0}
    assert rig.entries.empty()


async def test_a_due_certificate_is_renewed_and_the_old_one_serves_while_renewal_fails(
    rig: Rig,
) -> None:
    manager = await rig.manager()
    assert (await rig.entry()).kind == "certificate_issued"
    rig.orderer.failures = ["the CA is down"]
    await rig.advance(manager, 2 / 3 * LIFETIME)  # past the renewal time, jitter or not
    failed = await rig.entry()
    assert failed.kind == "certificate_failed"
    assert "the CA is down" in failed.message
    assert "the current one, valid until" in failed.message
    status = of(manager)
    assert (status.state, status.failures, status.not_after) == ("failing", 1, START + LIFETIME)
    await rig.advance(manager, 60)
    renewed = await rig.entry()
    assert renewed.kind == "certificate_renewed"
    status = of(manager)
    assert (status.state, status.failures, status.last_error) == ("valid", 0, None)
    assert status.not_after == pytest.approx(rig.clock() + LIFETIME)
    assert manager.orders == {"issued": 1, "renewed": 1, "failed": 1}


async def test_failures_are_retried_with_backoff_and_reported(rig: Rig) -> None:
    rig.orderer.failures = ["connection refused"] * 4
    manager = await rig.manager()
    delays = []
    for n in range(1, 5):
        entry = await rig.entry()
        assert entry.kind == "certificate_failed"
        assert f"(failure {n}): connection refused" in entry.message
        assert "served as before, over plain HTTP" in entry.message
        status = of(manager)
        assert (status.state, status.failures) == ("failing", n)
        assert status.last_error == "connection refused"
        delay = (status.next_order or 0) - rig.clock()
        delays.append(delay)
        # Not retried before its time: a wake just short of it orders nothing.
        await rig.advance(manager, delay - 1)
        await asyncio.sleep(0.05)  # a window for an early retry
        assert len(rig.orderer.hosts) == n
        await rig.advance(manager, 1)
    assert (await rig.entry()).kind == "certificate_issued"
    # 60 doubling to the cap of 600, each shortened by at most a quarter.
    for delay, base in zip(delays, [60, 120, 240, 480], strict=True):
        assert 0.75 * base <= delay <= base
    metrics = scrape(manager)
    assert 'gateway_acme_orders_total{outcome="failed"} 4.0' in metrics
    assert f'gateway_acme_certificate_failures{{name="{HOST}"}} 0.0' in metrics


async def test_a_service_added_later_is_ordered_and_one_removed_is_forgotten(rig: Rig) -> None:
    rig.routes = []
    manager = await rig.manager()
    await asyncio.sleep(0.05)  # a window for a certificate it should not list
    assert manager.status() == []
    rig.routes = [("api", RouteConfig(hosts=("api.example.com",), tls="acme"))]
    rig.journal.record("api", "service_created", "created")
    assert (await rig.entry()).kind == "service_created"
    issued = await rig.entry()
    assert (issued.service, issued.kind) == ("api", "certificate_issued")
    rig.routes = []
    rig.journal.record("api", "service_deleted", "deleted")
    await eventually(lambda: manager.status() == [], what="the host forgotten")
    assert (rig.state_dir / "acme/certificates/api.example.com/privkey.pem").exists()


async def test_status_renders_as_a_table(rig: Rig) -> None:
    rig.orderer.failures = ["the CA refused: rate limited (rateLimited)"]
    manager = await rig.manager()
    assert (await rig.entry()).kind == "certificate_failed"
    out = io.StringIO()
    certificate_table([c.model_dump() for c in certificate_list(manager).certificates], out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == [
        "CERTIFICATE",
        "SERVICES",
        "STATE",
        "NOT",
        "AFTER",
        "NEXT",
        "ORDER",
        "LAST",
        "ERROR",
    ]
    assert lines[1].split()[:3] == ["*.example.com", "web", "skipped"]
    assert "HTTP-01 cannot prove it" in lines[1]
    assert lines[2].startswith(f"{HOST}")
    assert "failing (1 failed)" in lines[2]
    assert "the CA refused: rate limited (rateLimited)" in lines[2]


async def test_an_unexpected_error_in_an_order_is_a_failure_and_the_loop_goes_on(
    rig: Rig,
) -> None:
    calls = 0

    async def broken(host: str) -> Issued:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug")
        return await rig.orderer(host)

    manager = AcmeManager(
        CONFIG, rig.state_dir, lambda: rig.routes, rig.journal, obtain=broken, clock=rig.clock
    )
    rig.managers.append(manager)
    await manager.start()
    failed = await rig.entry()
    assert failed.kind == "certificate_failed"
    assert "unexpected error: KeyError: 'a bug'" in failed.message
    await rig.advance(manager, 60)
    assert (await rig.entry()).kind == "certificate_issued"
