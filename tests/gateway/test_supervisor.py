"""Worker processes: real ``gateway.worker`` processes serving one port from this pool.

Each test starts a ``Supervisor`` with two workers (real subprocesses, SO_REUSEPORT) in front
of real aiohttp upstreams in this process, and drives the pool as the controller would.
Reports come every 50 ms; a test waits for what a report brings with ``eventually``, woken
by ``Supervisor.changed``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.config import ProxyConfig
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.scrape import MetricsCollector
from gateway.pool.inference import ReplicaLoad
from gateway.pool.pool import Pool
from gateway.pool.upstream import AdminState
from gateway.workers import supervisor as supervisor_module
from gateway.workers.metrics import WorkersCollector
from gateway.workers.supervisor import Supervisor, WorkerSettings, migrate_req_off
from tests.support.eventually import eventually

from .conftest import routing


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def workers(pool: Pool) -> AsyncIterator[Callable[..., Awaitable[Supervisor]]]:
    started: list[Supervisor] = []

    async def start(count: int = 2, hang_after: float = 10.0, **proxy: Any) -> Supervisor:
        config = ProxyConfig(listen="127.0.0.1:0", shutdown_timeout=2, **proxy)
        metrics = GatewayMetrics()
        metrics.attach(pool)
        supervisor = Supervisor(
            pool,
            config,
            WorkerSettings(count, report_interval=0.05, hang_after=hang_after, log_level="warning"),
            metrics=metrics,
        )
        await supervisor.start()
        started.append(supervisor)
        return supervisor

    yield start
    for supervisor in started:
        pids = [w.pid for w in supervisor.workers.values()]
        await supervisor.stop()
        assert not [pid for pid in pids if alive(pid)], "a worker outlived the supervisor"


def scraped(
    supervisor: Supervisor, name: str, labels: dict[str, str] | None = None
) -> float | None:
    """A sample of ``supervisor``'s series, as ``/metrics`` would show it now (the collectors
    read the counts at scrape time)."""
    assert supervisor.metrics is not None
    registry = CollectorRegistry()
    registry.register(MetricsCollector(supervisor.metrics))
    registry.register(WorkersCollector(supervisor))
    return registry.get_sample_value(name, labels)


async def get(port: int, path: str = "/") -> tuple[int, str]:
    """One request on a connection of its own (so SO_REUSEPORT spreads them)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, await response.text()


async def test_workers_serve_from_the_pool_and_report_to_its_metrics(pool, upstream, workers):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "a")
    supervisor = await workers()
    assert len({w.pid for w in supervisor.workers.values()}) == 2
    results = await asyncio.gather(*(get(supervisor.port) for _ in range(40)))
    assert {status for status, _ in results} == {200}
    await eventually(
        lambda: sum(w.served for w in supervisor.workers.values()) == 40,
        changed=supervisor.changed,
        what="reports",
    )
    assert all(w.served for w in supervisor.workers.values()), "one worker served everything"
    labels = {"service": "web", "revision": "0", "code": "2xx"}
    assert scraped(supervisor, "gateway_requests_total", labels) == 40
    assert scraped(supervisor, "gateway_workers") == 2


async def answers(port: int, status: int, tries: int = 100) -> None:
    """Requests until one is answered ``status`` (a change reaches the workers in a moment)."""
    seen = []
    for _ in range(tries):
        seen.append((await get(port))[0])
        if seen[-1] == status:
            return
    raise AssertionError(f"never answered {status}: {seen[-5:]}")


async def test_a_pool_change_reaches_the_workers(pool, upstream, workers):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "a")
    supervisor = await workers()
    assert (await get(supervisor.port))[0] == 200
    pool.remove_service("web")
    await answers(supervisor.port, 404)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "b")
    await answers(supervisor.port, 200)
    results = await asyncio.gather(*(get(supervisor.port) for _ in range(10)))
    assert all('"upstream": "b"' in text for _, text in results)


async def held_request(
    pool: Pool, upstream: Any, workers: Any, release: asyncio.Event
) -> tuple[Supervisor, asyncio.Task[tuple[int, str]]]:
    """Workers in front of one upstream, "a", and a request that it holds until ``release``."""
    entered = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.Response(text="late but whole")

    app = web.Application()
    app.router.add_get("/", slow)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "a", app=app)
    supervisor = await workers()
    request = asyncio.create_task(get(supervisor.port))
    await asyncio.wait_for(entered.wait(), 10)
    await eventually(
        lambda: pool.service("web").inflight_all() == {"a": 1},
        changed=supervisor.changed,
        what="a report",
    )
    return supervisor, request


async def test_a_drain_waits_for_a_request_in_flight_in_a_worker(pool, upstream, workers):
    release = asyncio.Event()
    supervisor, request = await held_request(pool, upstream, workers, release)
    done = pool.drain("web", "a", timeout=30)
    assert pool.upstream("web", "a").admin is AdminState.DRAINING  # type: ignore[union-attr]
    assert pool.service("web").inflight == {}  # nothing here: the lease is in a worker
    seen = {w.pid: w.reports for w in supervisor.workers.values()}
    await eventually(
        lambda: all(w.reports >= seen[w.pid] + 2 for w in supervisor.workers.values()),
        changed=supervisor.changed,
        what="two more reports from each worker (both have the draining snapshot by then)",
    )
    assert not done.done()
    release.set()
    assert await request == (200, "late but whole")
    assert await asyncio.wait_for(done, 10) is True


async def test_a_drain_timeout_cuts_off_what_workers_hold(pool, upstream, workers):
    release = asyncio.Event()  # never set: the upstream would hold the request for good
    supervisor, request = await held_request(pool, upstream, workers, release)
    assert await pool.drain("web", "a", timeout=0.2) is False
    try:
        status, _ = await asyncio.wait_for(request, 10)
    except aiohttp.ClientError:
        status = 0  # cut off
    assert status != 200
    await eventually(
        lambda: not pool.service("web").inflight_all().get("a"),
        changed=supervisor.changed,
        what="the abort",
    )


async def test_a_worker_proposes_an_ejection_and_the_pool_takes_it(pool, upstream, workers):
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500)

    app = web.Application()
    app.router.add_get("/", broken)
    pool.set_service(routing("web", prefix="/", outlier={"consecutive_5xx": 2}))
    await upstream("web", "a", app=app)
    await upstream("web", "b")
    supervisor = await workers(1)
    for _ in range(8):
        await get(supervisor.port)
    await eventually(
        lambda: pool.upstream("web", "a").ejected, changed=supervisor.changed, what="the ejection"
    )  # type: ignore[union-attr]
    assert not pool.upstream("web", "b").ejected  # type: ignore[union-attr]


async def test_a_worker_that_dies_is_started_again_and_the_other_serves_on(pool, upstream, workers):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "a")
    supervisor = await workers()
    victim = supervisor.workers[0].pid
    os.kill(victim, signal.SIGKILL)  # a worker this test's supervisor started
    await eventually(
        lambda: victim not in {w.pid for w in supervisor.workers.values()},
        changed=supervisor.changed,
        what="exit",
    )
    results = await asyncio.gather(*(get(supervisor.port) for _ in range(20)))
    assert {status for status, _ in results} == {200}
    await eventually(
        lambda: (
            len(supervisor.workers) == 2
            and all(w.ready.done() for w in supervisor.workers.values())
        ),
        changed=supervisor.changed,
        what="the restart",
    )
    assert victim not in {w.pid for w in supervisor.workers.values()}
    assert scraped(supervisor, "gateway_worker_restarts_total") == 1


async def test_a_hung_worker_is_killed_and_started_again(pool, upstream, workers):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "a")
    supervisor = await workers(hang_after=0.5)
    victim = supervisor.workers[1].pid
    os.kill(victim, signal.SIGSTOP)  # hung: alive, holding its listener, answering nothing
    try:
        await eventually(
            lambda: victim not in {w.pid for w in supervisor.workers.values()},
            changed=supervisor.changed,
            what="the hung worker to be killed",
        )
    finally:
        if alive(victim):
            os.kill(victim, signal.SIGKILL)
    await eventually(
        lambda: (
            len(supervisor.workers) == 2
            and all(w.ready.done() for w in supervisor.workers.values())
        ),
        changed=supervisor.changed,
        what="the restart",
    )
    results = await asyncio.gather(*(get(supervisor.port) for _ in range(20)))
    assert {status for status, _ in results} == {200}


async def test_the_port_is_taken_before_any_worker_and_freed_after(pool, workers):
    supervisor = await workers(1)
    port = supervisor.port
    assert port > 0
    assert (await get(port))[0] == 404  # no service: routed nowhere, answered by a worker
    await supervisor.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        await get(port)


def test_the_kernel_setting_that_keeps_a_dead_workers_queue_is_read(tmp_path):
    setting = tmp_path / "tcp_migrate_req"
    setting.write_text("0\n")
    assert migrate_req_off(str(setting))
    setting.write_text("1\n")
    assert not migrate_req_off(str(setting))
    assert not migrate_req_off(str(tmp_path / "absent"))  # a kernel before 5.14


async def test_the_supervisor_says_once_when_a_dead_workers_queue_would_be_lost(
    pool, workers, caplog, monkeypatch
):
    monkeypatch.setattr(supervisor_module, "migrate_req_off", lambda: True)
    caplog.set_level("INFO", logger=supervisor_module.__name__)
    await workers(2)
    said = [r.message for r in caplog.records if "tcp_migrate_req" in r.message]
    assert said == [
        "net.ipv4.tcp_migrate_req is 0: connections queued on a worker that dies are lost"
        " with it; 1 moves them to the other workers (docs/workers.md)"
    ]


async def test_the_replicas_load_figures_reach_the_workers_picks(pool, upstream, workers):
    pool.set_service(routing("llm", prefix="/", load_balancing="inference"))
    await upstream("llm", "busy")
    await upstream("llm", "idle")
    supervisor = await workers()
    seen = {(await get(supervisor.port))[1] for _ in range(20)}
    assert {json.loads(body)["upstream"] for body in seen} == {"busy", "idle"}
    now = asyncio.get_running_loop().time()  # the workers' clock too: monotonic
    queue = ReplicaLoad(waiting=30, running=8, kv_cache=1.0, at=now, expires=now + 600)
    supervisor.send_loads("llm", {"busy": queue})

    async def only_idle() -> bool:
        answers = [(await get(supervisor.port))[1] for _ in range(10)]
        return {json.loads(body)["upstream"] for body in answers} == {"idle"}

    for _ in range(50):  # the message reaches both workers in a moment
        if await only_idle():
            break
    else:
        raise AssertionError("the workers still send requests to the busy replica")
    assert await only_idle()
