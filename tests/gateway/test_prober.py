"""The prober against real aiohttp servers on loopback, with short intervals.

Tests wait for what they expect by awaiting pool events or probe results (``Timeline``),
never by sleeping and looking.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from gateway.config import (
    OutlierConfig,
    ProbeConfig,
    RouteConfig,
    ServiceRouting,
    parse_settings,
)
from gateway.health.prober import Prober, Schedule
from gateway.pool.events import PoolEvent, ProbeResult
from gateway.pool.pool import Pool
from gateway.pool.upstream import Health, Upstream
from tests.support.raw_servers import RawServers, cleanup_runner

FAST = {"interval": 0.05, "timeout": 1.0, "jitter": 0.2}


def http_probe(**changes: object) -> ProbeConfig:
    return parse_settings(ProbeConfig, {"type": "http", "path": "/health", **FAST, **changes})


def tcp_probe(**changes: object) -> ProbeConfig:
    return parse_settings(ProbeConfig, {"type": "tcp", **FAST, **changes})


def routing(*probes: ProbeConfig, name: str = "svc", **changes: object) -> ServiceRouting:
    return parse_settings(
        ServiceRouting,
        {"name": name, "route": RouteConfig(path_prefix="/"), "probes": probes, **changes},
    )


# -- helpers -------------------------------------------------------------------------------


@dataclass
class Entry:
    """One thing that happened: a pool event or a probe result, with the pool state then."""

    event: PoolEvent | None = None
    result: ProbeResult | None = None
    routable: bool = False


class Timeline:
    """Pool subscriber and probe observer in one: records everything, in order, and lets a
    test await the next entry matching a predicate."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.entries: list[Entry] = []
        self._waiters: list[tuple[Callable[[Entry], bool], asyncio.Future[Entry]]] = []
        pool.subscribe(self)

    def _add(self, entry: Entry) -> None:
        self.entries.append(entry)
        for match, waiter in list(self._waiters):
            if not waiter.done() and match(entry):
                waiter.set_result(entry)

    def on_pool_event(self, event: PoolEvent) -> None:
        routable = event.upstream is not None and event.upstream.routable
        self._add(Entry(event=event, routable=routable))

    def on_probe(self, result: ProbeResult) -> None:
        upstream = self.pool.upstream(result.service, result.upstream_id)
        self._add(Entry(result=result, routable=upstream is not None and upstream.routable))

    def mark(self) -> int:
        return len(self.entries)

    async def wait(
        self, match: Callable[[Entry], bool], after: int | None = None, timeout: float = 5.0
    ) -> Entry:
        """The first entry since ``after`` (default: now) that matches, awaited if need be."""
        start = self.mark() if after is None else after
        for entry in self.entries[start:]:
            if match(entry):
                return entry
        waiter: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        item = (match, waiter)
        self._waiters.append(item)
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        finally:
            self._waiters.remove(item)

    async def health(self, uid: str, health: Health, **kw: object) -> PoolEvent:
        def match(e: Entry) -> bool:
            return (
                e.event is not None
                and e.event.kind == "changed"
                and e.event.upstream is not None
                and e.event.upstream.id == uid
                and e.event.upstream.health is health
                and (e.event.previous is None or e.event.previous.health is not health)
            )

        entry = await self.wait(match, **kw)  # type: ignore[arg-type]
        assert entry.event is not None
        return entry.event

    async def result(self, uid: str, outcome: str | None = None, **kw: object) -> ProbeResult:
        def match(e: Entry) -> bool:
            return (
                e.result is not None
                and e.result.upstream_id == uid
                and (outcome is None or e.result.outcome == outcome)
            )

        entry = await self.wait(match, **kw)  # type: ignore[arg-type]
        assert entry.result is not None
        return entry.result

    def results(self, uid: str, start: int = 0, end: int | None = None) -> list[ProbeResult]:
        return [
            e.result
            for e in self.entries[start:end]
            if e.result is not None and e.result.upstream_id == uid
        ]

    def index(self, event: PoolEvent) -> int:
        return next(i for i, e in enumerate(self.entries) if e.event is event)


@dataclass
class Server:
    """A real aiohttp upstream: ``status`` is what /health answers; it can stop and restart
    on the same port."""

    host: str = "127.0.0.1"
    status: int = 200
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hanging: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    runner: web.AppRunner | None = None

    async def _health(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        return web.Response(status=self.status, text="health")

    async def _redirect(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        raise web.HTTPFound("/health")

    async def _hang(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        self.hanging.set()
        await self.release.wait()
        return web.Response(text="late")

    async def start(self) -> Server:
        app = web.Application()
        app.router.add_route("*", "/health", self._health)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/hang", self._hang)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await cleanup_runner(self.runner)
            self.runner = None

    def upstream(self, uid: str = "u1", **changes: object) -> Upstream:
        return Upstream(uid, "svc", self.host, self.port).replace(**changes)


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    started: list[Server] = []

    async def make(**kw: object) -> Server:
        server = await Server(**kw).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


@dataclass
class Rig:
    pool: Pool
    timeline: Timeline
    prober: Prober


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    pool = Pool(rng=random.Random(1))
    timeline = Timeline(pool)
    prober = Prober(pool, [timeline], rng=random.Random(2))
    await prober.start()
    yield Rig(pool, timeline, prober)
    await prober.stop()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


# -- admission and health transitions ------------------------------------------------------


async def test_unknown_and_unroutable_until_healthy_threshold_passes(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(healthy_threshold=3)))
    start = rig.timeline.mark()
    added = rig.pool.add_upstream(server.upstream())
    assert added.health is Health.UNKNOWN
    assert rig.pool.service("svc").pick() is None

    event = await rig.timeline.health("u1", Health.HEALTHY, after=start)

    before = rig.timeline.results("u1", start, rig.timeline.index(event))
    assert [r.outcome for r in before] == ["success", "success"]
    assert not any(e.routable for e in rig.timeline.entries[start : rig.timeline.index(event)])
    assert event.previous is not None
    assert event.previous.health is Health.UNKNOWN
    assert rig.pool.service("svc").pick() == event.upstream
    assert rig.prober.state("svc", "u1").health is Health.HEALTHY


async def test_unhealthy_after_threshold_of_500s_and_back_after_threshold_of_passes(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(healthy_threshold=2, unhealthy_threshold=3)))
    rig.pool.add_upstream(server.upstream())
    await rig.timeline.health("u1", Health.HEALTHY, after=0)

    mark = rig.timeline.mark()
    server.status = 500
    down = await rig.timeline.health("u1", Health.UNHEALTHY, after=mark)
    failed = [r for r in rig.timeline.results("u1", mark, rig.timeline.index(down))]
    # The probe in flight when the status changed may still have passed.
    assert [r.outcome for r in failed if r.outcome != "success"] == ["failure", "failure"]
    assert "status 500" in down.reason
    assert rig.pool.service("svc").pick() is None

    mark = rig.timeline.mark()
    server.status = 200
    up = await rig.timeline.health("u1", Health.HEALTHY, after=mark)
    passed = rig.timeline.results("u1", mark, rig.timeline.index(up))
    assert [r.outcome for r in passed if r.outcome == "success"] == ["success"]
    assert rig.pool.service("svc").pick() is not None


async def test_stopped_server_turns_unhealthy_and_restarted_one_comes_back(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(healthy_threshold=1, unhealthy_threshold=2)))
    rig.pool.add_upstream(server.upstream())
    await rig.timeline.health("u1", Health.HEALTHY, after=0)

    mark = rig.timeline.mark()
    await server.stop()
    down = await rig.timeline.health("u1", Health.UNHEALTHY, after=mark)
    assert "Connect" in down.reason or "connect" in down.reason

    mark = rig.timeline.mark()
    await server.start()
    await rig.timeline.health("u1", Health.HEALTHY, after=mark)


async def test_never_passing_upstream_goes_from_unknown_to_unhealthy(rig):
    rig.pool.set_service(routing(tcp_probe(unhealthy_threshold=2)))
    rig.pool.add_upstream(Upstream("u1", "svc", "127.0.0.1", closed_port()))
    event = await rig.timeline.health("u1", Health.UNHEALTHY, after=0)
    assert event.previous is not None
    assert event.previous.health is Health.UNKNOWN


# -- HTTP probe details --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected", "outcome"),
    [
        (200, (), "success"),
        (204, (), "success"),
        (299, (), "success"),
        (204, (200,), "failure"),
        (418, (418,), "success"),
        (503, (), "failure"),
        (503, (200, 503), "success"),
    ],
)
async def test_expected_statuses(rig, servers, status, expected, outcome):
    server = await servers(status=status)
    rig.pool.set_service(routing(http_probe(expected_statuses=expected)))
    rig.pool.add_upstream(server.upstream())
    result = await rig.timeline.result("u1", after=0)
    assert result.outcome == outcome
    assert (result.reason == "") == (outcome == "success")


async def test_redirect_fails_by_default_and_is_not_followed(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(path="/redirect")))
    rig.pool.add_upstream(server.upstream())
    result = await rig.timeline.result("u1", after=0)
    assert result.outcome == "failure"
    assert "302" in result.reason
    assert server.hits["/redirect"] >= 1
    assert server.hits["/health"] == 0


async def test_redirect_passes_when_expected(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(path="/redirect", expected_statuses=(302,))))
    rig.pool.add_upstream(server.upstream())
    assert (await rig.timeline.result("u1", after=0)).outcome == "success"
    assert server.hits["/health"] == 0


async def test_method_and_headers_are_sent(rig):
    seen: list[tuple[str, str | None]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.headers.get("X-Probe")))
        return web.Response()

    app = web.Application()
    app.router.add_route("*", "/p", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        port = runner.addresses[0][1]
        probe = http_probe(path="/p", method="HEAD", headers={"X-Probe": "yes"})
        rig.pool.set_service(routing(probe))
        rig.pool.add_upstream(Upstream("u1", "svc", "127.0.0.1", port))
        assert (await rig.timeline.result("u1", after=0)).outcome == "success"
        assert seen[0] == ("HEAD", "yes")
    finally:
        await cleanup_runner(runner)


async def test_timeout_when_the_server_hangs(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(path="/hang", timeout=0.1)))
    rig.pool.add_upstream(server.upstream())
    result = await rig.timeline.result("u1", after=0)
    assert result.outcome == "timeout"
    assert 0.1 <= result.duration < 1.0
    assert "timed out" in result.reason


async def test_an_upstream_that_closes_before_answering_fails_with_a_clear_reason(
    rig, raw_upstream
):
    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    rig.pool.set_service(routing(http_probe()))
    rig.pool.add_upstream(Upstream("u1", "svc", "127.0.0.1", await raw_upstream(close)))
    result = await rig.timeline.result("u1", after=0)
    assert result.outcome == "failure"
    assert result.reason == (
        "http probe: ProbeConnectionClosed: connection closed before any response"
    )


async def test_an_upstream_that_does_not_speak_http_fails_naming_the_parser_error(
    rig, raw_upstream
):
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()
        await reader.read()  # until the prober closes
        writer.close()

    rig.pool.set_service(routing(http_probe()))
    rig.pool.add_upstream(Upstream("u1", "svc", "127.0.0.1", await raw_upstream(garbage)))
    result = await rig.timeline.result("u1", after=0)
    assert result.outcome == "failure"
    assert result.reason.startswith("http probe: ProbeInvalidResponse: invalid HTTP response: ")
    assert "HttpParser" in result.reason


async def test_a_header_with_a_line_break_is_a_failed_probe_and_never_sent(rig, servers):
    server = await servers()
    # Built directly, a ProbeConfig is not validated: the client refuses it itself.
    probe = ProbeConfig(type="http", path="/health", headers={"X-A": "1\r\nX-B: 2"}, **FAST)
    rig.pool.set_service(routing(probe))
    rig.pool.add_upstream(server.upstream())
    result = await rig.timeline.result("u1", after=0)
    assert result.outcome == "failure"
    assert "ProbeRequestInvalid" in result.reason
    assert "X-A" in result.reason
    assert rig.prober.errors == 0
    assert sum(server.hits.values()) == 0


# -- TCP probe -----------------------------------------------------------------------------


async def test_tcp_probe_against_listening_socket_and_closed_port(rig):
    accepted = 0

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.close()

    servers = RawServers()  # the prober may be connecting as the listener closes
    listener = await servers.start(on_connect)
    try:
        port = listener.sockets[0].getsockname()[1]
        rig.pool.set_service(routing(tcp_probe()))
        rig.pool.add_upstream(Upstream("open", "svc", "127.0.0.1", port))
        rig.pool.add_upstream(Upstream("closed", "svc", "127.0.0.1", closed_port()))
        assert (await rig.timeline.result("open", after=0)).outcome == "success"
        closed = await rig.timeline.result("closed", after=0)
        assert closed.outcome == "failure"
        assert "ConnectionRefused" in closed.reason
    finally:
        await servers.close()


async def test_no_probes_anywhere_means_a_default_tcp_probe(rig, servers):
    server = await servers()
    rig.pool.set_service(routing())
    rig.pool.add_upstream(server.upstream())
    assert (await rig.timeline.result("u1", after=0)).outcome == "success"
    assert sum(server.hits.values()) == 0  # TCP: connected, no HTTP request made


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_ipv6_upstreams(rig, servers):
    server = await servers(host="::1")
    rig.pool.set_service(routing(http_probe()))
    rig.pool.add_upstream(server.upstream("http"))
    rig.pool.add_upstream(server.upstream("tcp", probes=(tcp_probe(),)))
    assert (await rig.timeline.result("http", after=0)).outcome == "success"
    assert (await rig.timeline.result("tcp", after=0)).outcome == "success"
    assert server.hits["/health"] >= 1


# -- which probes, and when ----------------------------------------------------------------


async def test_upstream_probes_override_the_services(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(path="/missing")))
    rig.pool.add_upstream(server.upstream("own", probes=(http_probe(),)))
    rig.pool.add_upstream(server.upstream("service"))
    assert (await rig.timeline.result("own", after=0)).outcome == "success"
    assert (await rig.timeline.result("service", after=0)).outcome == "failure"


async def test_all_probes_must_pass(rig, servers):
    server = await servers()
    both = (tcp_probe(), http_probe(path="/missing"))
    rig.pool.set_service(routing(*both))
    rig.pool.add_upstream(server.upstream())
    result = await rig.timeline.result("u1", after=0)
    assert result.outcome == "failure"
    assert "404" in result.reason


def test_schedule_merges_several_probes():
    probes = (
        ProbeConfig(interval=5, healthy_threshold=2, unhealthy_threshold=5, jitter=0.1),
        ProbeConfig(interval=1, healthy_threshold=4, unhealthy_threshold=1, jitter=0.3),
    )
    assert Schedule.of(probes) == Schedule(
        interval=1, jitter=0.3, healthy_threshold=4, unhealthy_threshold=5
    )


async def test_thresholds_are_the_max_over_an_upstreams_probes(rig, servers):
    server = await servers()
    probes = (http_probe(healthy_threshold=1), tcp_probe(healthy_threshold=3))
    rig.pool.set_service(routing(*probes))
    rig.pool.add_upstream(server.upstream())
    event = await rig.timeline.health("u1", Health.HEALTHY, after=0)
    assert len(rig.timeline.results("u1", 0, rig.timeline.index(event))) == 2


async def test_routing_change_takes_effect_at_once(rig, servers):
    server = await servers()
    slow = http_probe(healthy_threshold=1, unhealthy_threshold=1, interval=3600)
    rig.pool.set_service(routing(slow))
    rig.pool.add_upstream(server.upstream())
    await rig.timeline.health("u1", Health.HEALTHY, after=0)

    # A shorter interval re-times the pending hour-long wait; the new path is used.
    mark = rig.timeline.mark()
    rig.pool.set_service(routing(http_probe(path="/missing", unhealthy_threshold=1)))
    down = await rig.timeline.health("u1", Health.UNHEALTHY, after=mark)
    assert "404" in down.reason


async def test_successive_probes_are_an_interval_apart(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(interval=0.1, jitter=0.5)))
    rig.pool.add_upstream(server.upstream())
    loop = asyncio.get_running_loop()
    stamps = []
    for _ in range(4):
        await rig.timeline.result("u1")
        stamps.append(loop.time())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    # interval * (1 - jitter), less a little for the loop's clock resolution
    assert all(gap >= 0.05 - 0.01 for gap in gaps), gaps


# -- task life cycle -----------------------------------------------------------------------


def probe_tasks(uid: str) -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(f"probe svc/{uid} ")]


async def test_start_probes_upstreams_already_in_the_pool(servers):
    server = await servers()
    pool = Pool()
    pool.set_service(routing(http_probe(healthy_threshold=1)))
    pool.add_upstream(server.upstream())
    timeline = Timeline(pool)
    prober = Prober(pool)
    await prober.start()
    try:
        await timeline.health("u1", Health.HEALTHY, after=0)
        assert "tasks=1" in repr(prober)
    finally:
        await prober.stop()


async def test_removing_an_upstream_stops_its_probe_task(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe()))
    rig.pool.add_upstream(server.upstream())
    await rig.timeline.result("u1", after=0)
    [task] = probe_tasks("u1")

    rig.pool.remove_upstream("svc", "u1")
    await asyncio.wait([task], timeout=5)

    assert task.cancelled()
    assert rig.prober.state("svc", "u1") is None
    assert "tasks=0" in repr(rig.prober)


async def test_removing_a_service_stops_its_probe_tasks(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe()))
    rig.pool.add_upstream(server.upstream("a"))
    rig.pool.add_upstream(server.upstream("b"))
    await rig.timeline.result("a", after=0)
    await rig.timeline.result("b", after=0)
    tasks = probe_tasks("a") + probe_tasks("b")
    assert len(tasks) == 2

    rig.pool.remove_service("svc")
    await asyncio.wait(tasks, timeout=5)
    assert all(t.cancelled() for t in tasks)
    assert "tasks=0" in repr(rig.prober)


async def test_readded_upstream_starts_unknown_again(rig, servers):
    server = await servers()
    rig.pool.set_service(routing(http_probe(healthy_threshold=1)))
    rig.pool.add_upstream(server.upstream())
    await rig.timeline.health("u1", Health.HEALTHY, after=0)
    rig.pool.remove_upstream("svc", "u1")
    mark = rig.timeline.mark()
    rig.pool.add_upstream(server.upstream())
    assert rig.prober.state("svc", "u1").health is Health.UNKNOWN
    await rig.timeline.health("u1", Health.HEALTHY, after=mark)
    assert len(probe_tasks("u1")) == 1


async def test_stop_cancels_and_awaits_every_task(servers):
    server = await servers()
    pool = Pool()
    pool.set_service(routing(http_probe(path="/hang", timeout=30)))
    timeline = Timeline(pool)
    prober = Prober(pool, [timeline])
    await prober.start()
    pool.add_upstream(server.upstream())
    async with asyncio.timeout(5):
        await server.hanging.wait()
    tasks = probe_tasks("u1")
    assert tasks  # busy with a probe that hangs

    await prober.stop()
    assert all(t.done() for t in tasks)
    assert "tasks=0" in repr(prober)
    pool.add_upstream(server.upstream("late"))  # no longer subscribed: nothing starts
    assert probe_tasks("late") == []


# -- guards --------------------------------------------------------------------------------


async def test_an_error_in_the_prober_counts_as_a_failed_probe(rig, servers, monkeypatch):
    server = await servers()

    async def broken(upstream: Upstream, probe: ProbeConfig) -> tuple[str, str]:
        raise RuntimeError("bug")

    monkeypatch.setattr(rig.prober, "check", broken)
    rig.pool.set_service(routing(http_probe(unhealthy_threshold=2)))
    rig.pool.add_upstream(server.upstream())
    event = await rig.timeline.health("u1", Health.UNHEALTHY, after=0)
    assert event.reason == "prober error"
    assert rig.prober.errors >= 2
    assert probe_tasks("u1")


async def test_a_task_that_dies_is_restarted(rig, servers, monkeypatch):
    server = await servers()
    rig.pool.set_service(routing(http_probe()))
    original = rig.prober._pause
    calls = 0

    async def pause_once_broken(key: tuple[str, str], draw: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("bug outside a round")
        await original(key, draw)

    monkeypatch.setattr(rig.prober, "_pause", pause_once_broken)
    rig.pool.add_upstream(server.upstream())
    first = await rig.timeline.result("u1", after=0)
    mark = rig.timeline.mark()
    assert first.outcome == "success"
    assert (await rig.timeline.result("u1", after=mark)).outcome == "success"
    assert rig.prober.restarts == 1
    assert "restarts=1" in repr(rig.prober)


async def test_a_failing_observer_does_not_stop_probing(servers):
    server = await servers()

    class Broken:
        def on_probe(self, result: ProbeResult) -> None:
            raise RuntimeError("observer bug")

    pool = Pool()
    pool.set_service(routing(http_probe(healthy_threshold=2)))
    timeline = Timeline(pool)
    prober = Prober(pool, [Broken(), timeline])
    await prober.start()
    try:
        pool.add_upstream(server.upstream())
        await timeline.health("u1", Health.HEALTHY, after=0)
    finally:
        await prober.stop()


# -- passive ejection ----------------------------------------------------------------------


async def test_passive_ejection_is_lifted_by_a_probe_only_after_its_time(rig, servers):
    server = await servers()
    outlier = OutlierConfig(consecutive_connect_failures=2, base_ejection_time=0.3)
    rig.pool.set_service(routing(http_probe(healthy_threshold=1), outlier=outlier))
    rig.pool.add_upstream(server.upstream())
    await rig.timeline.health("u1", Health.HEALTHY, after=0)

    assert rig.pool.report("svc", "u1", "connect_failure") is None
    ejection = rig.pool.report("svc", "u1", "connect_failure")
    assert ejection is not None
    mark = rig.timeline.mark()
    assert rig.pool.service("svc").pick() is None

    def lifted(e: Entry) -> bool:
        return (
            e.event is not None
            and e.event.kind == "changed"
            and e.event.upstream is not None
            and not e.event.upstream.ejected
        )

    entry = await rig.timeline.wait(lifted, after=mark)
    assert entry.event is not None
    assert entry.event.at >= ejection.until
    assert entry.event.reason == "ejection lifted by a passing probe"
    # Probes passed while the ejection ran, and none of them lifted it early.
    early = rig.timeline.results("u1", mark, rig.timeline.index(entry.event))
    assert len([r for r in early if r.ok]) >= 2
    assert rig.pool.service("svc").pick() is not None
