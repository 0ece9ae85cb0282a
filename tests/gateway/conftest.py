"""Fixtures for the data-plane tests: a pool, a running gateway, real upstreams on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.config import (
    ListenerLimits,
    ProxyConfig,
    ServiceRouting,
    TlsConfig,
    parse_settings,
)
from gateway.pool.events import RequestRecord, Tokens
from gateway.pool.pool import Pool
from gateway.pool.upstream import Health, Upstream
from gateway.proxy.handler import Proxy
from gateway.server import TrafficServer
from gateway.tls import Termination
from tests.support.raw_servers import RawServers

from .fakeloop import FakeLoop, running


class Recorder:
    """A RequestObserver that keeps the records and lets a test await the next one."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.tokens: list[Tokens] = []
        """Of the requests on a model path, in order."""
        self.timeouts: list[tuple[str, str]] = []
        """Clients given up on for slowness: (protocol, timeout), in order."""
        self._waiters: list[asyncio.Future[RequestRecord]] = []

    def on_model_request(self, record: RequestRecord, tokens: Tokens) -> None:
        self.tokens.append(tokens)
        self.on_request(record)

    def on_client_timeout(self, protocol: str, timeout: str) -> None:
        self.timeouts.append((protocol, timeout))

    def on_request(self, record: RequestRecord) -> None:
        self.records.append(record)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(record)
        self._waiters.clear()

    def next(self) -> asyncio.Future[RequestRecord]:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    async def wait(self, count: int = 1, within: float = 5.0) -> list[RequestRecord]:
        """The records, once there are ``count`` or more: the ones still to come awaited
        (``within`` seconds at most, a bound on a hang, not a pace)."""
        async with asyncio.timeout(within):
            while len(self.records) < count:
                await self.next()
        return self.records


def routing(
    name: str, *, hosts=(), prefix=None, strip=False, route_extra=None, **settings: Any
) -> ServiceRouting:
    route = {"hosts": tuple(hosts), "path_prefix": prefix, "strip_prefix": strip}
    return parse_settings(
        ServiceRouting, {"name": name, "route": route | (route_extra or {}), **settings}
    )


def add(pool: Pool, service: str, upstream_id: str, port: int, health=Health.HEALTHY) -> None:
    pool.add_upstream(Upstream(id=upstream_id, service=service, host="127.0.0.1", port=port))
    if health is not Health.UNKNOWN:
        pool.set_health(service, upstream_id, health)


def echo_app(name: str) -> web.Application:
    """An upstream that answers with what it received, as JSON."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "upstream": name,
                "method": request.method,
                "path": request.raw_path,
                "headers": list(request.headers.items()),
                "body": len(body),
            }
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


@pytest.fixture
def pool() -> Pool:
    return Pool()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def upstream(aiohttp_server, pool) -> Callable[..., Awaitable[Any]]:
    """``await upstream(service, id, app=None, health=HEALTHY)``: a real server in the pool."""

    async def start(service: str, upstream_id: str, app=None, health=Health.HEALTHY):
        server = await aiohttp_server(app or echo_app(upstream_id), shutdown_timeout=2)
        add(pool, service, upstream_id, server.port, health)
        return server

    return start


@pytest.fixture
async def raw_upstream() -> AsyncIterator[Callable[..., Awaitable[int]]]:
    """``await raw_upstream(callback)``: an asyncio TCP server on loopback; returns its port.
    Its connections are closed at teardown, their handlers cancelled (``RawServers``)."""
    servers = RawServers()

    async def start(callback) -> int:
        server = await servers.start(callback)
        port: int = server.sockets[0].getsockname()[1]
        return port

    yield start
    await servers.close()


@pytest.fixture
async def gateway(pool, recorder) -> AsyncIterator[Callable[..., Awaitable[TrafficServer]]]:
    """``await gateway(**ProxyConfig fields)``: a started TrafficServer on a free port."""
    started: list[TrafficServer] = []

    async def start(limits: ListenerLimits | None = None, **config: Any) -> TrafficServer:
        settings = parse_settings(
            ProxyConfig, {"limits": limits or ListenerLimits(), **config, "listen": "127.0.0.1:0"}
        )
        server = TrafficServer(Proxy(pool, settings, [recorder]), settings)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


@pytest.fixture
async def tls_gateway(
    pool: Pool, recorder: Recorder
) -> AsyncIterator[Callable[..., Awaitable[TrafficServer]]]:
    """``await tls_gateway(TlsConfig(...), **ProxyConfig fields)``: plain and TLS listeners."""
    started: list[TrafficServer] = []

    async def start(tls: TlsConfig, **config: Any) -> TrafficServer:
        settings = ProxyConfig(listen="127.0.0.1:0", listen_tls=("127.0.0.1:0",), tls=tls, **config)
        server = TrafficServer(
            Proxy(pool, settings, [recorder]), settings, tls=Termination(settings.tls)
        )
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def url(server: TrafficServer, path: str = "/") -> str:
    return f"http://127.0.0.1:{server.port}{path}"


async def raw_request(port: int, data: bytes) -> bytes:
    """Send ``data`` (a raw request) on a fresh connection and read until the gateway closes
    it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()


@pytest.fixture
def loop() -> Iterator[FakeLoop]:
    """A fake loop (``fakeloop.FakeLoop``) as the running loop: the deadline tests move its
    clock."""
    fake = FakeLoop()
    with running(fake):
        yield fake
