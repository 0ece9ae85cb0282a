"""Parked connections (``proxy.parking``), on real sockets over loopback: an idle keep-alive
connection leaves the loop after ``park_after`` and comes back with its client's next
request; closed by its client, at its keep-alive deadline, or at shutdown while parked."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ListenerLimits
from gateway.observability.scrape import ConnectionsCollector
from gateway.server import TrafficServer
from tests.support.eventually import eventually

from .conftest import routing
from .test_server import read_response

GET = b"GET /again HTTP/1.1\r\nHost: h\r\n\r\n"


def parked(gw: TrafficServer) -> int:
    gate = gw._gate
    assert gate is not None
    return gate.parked


def in_loop(gw: TrafficServer) -> int:
    return len(gw._connections)


async def served(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(GET)
    async with asyncio.timeout(5):
        head, body = await read_response(reader)
    assert head.startswith(b"HTTP/1.1 200"), head
    return body


def ends_of(client: tuple[str, int]) -> list[int]:
    """This process's descriptors of sockets connected to ``client`` (the gateway's ends)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket, or gone meanwhile
        try:
            if sock.getpeername() == client:
                found.append(fd)
        except OSError:
            pass
        finally:
            sock.close()
    return found


@pytest.fixture
async def web(pool, upstream):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")


LIMITS = ListenerLimits(park_after=0.1, keepalive_timeout=30)


async def test_an_idle_connection_is_parked_and_serves_its_next_requests(web, gateway):
    gw = await gateway(limits=LIMITS)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    client = writer.get_extra_info("sockname")
    try:
        await served(reader, writer)
        assert (in_loop(gw), parked(gw)) == (1, 0)

        await eventually(lambda: parked(gw) == 1, what="the connection parked")
        assert in_loop(gw) == 0
        assert gw.connections == 1  # still open, and counted
        # The parked descriptor only: the transport's own closes on the loop's next turn
        # (asyncio's abort calls connection_lost soon, not at once).
        await eventually(
            lambda: len(ends_of(client)) == 1,
            what="one descriptor of the connection in the gateway",
        )

        for wait in (0.2, 0.4):  # resumed, then parked again after each answer
            body = await served(reader, writer)
            assert b'"path": "/again"' in body
            [conn] = gw._connections
            assert conn.park_after == wait  # back soon: it waits twice as long next time
            await eventually(lambda: parked(gw) == 1, what="the connection parked")
        assert in_loop(gw) == 0
    finally:
        writer.close()
    await eventually(lambda: gw.connections == 0, what="no connection left")
    await eventually(lambda: not ends_of(client), what="no descriptor of it left in the gateway")


async def test_pipelined_requests_to_a_parked_connection_are_answered_in_order(web, gateway):
    gw = await gateway(limits=LIMITS)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        await served(reader, writer)
        await eventually(lambda: parked(gw) == 1, what="the connection parked")
        writer.write(b"".join(b"GET /%d HTTP/1.1\r\nHost: h\r\n\r\n" % i for i in range(3)))
        async with asyncio.timeout(5):
            paths = [(await read_response(reader))[1].split(b'"path": "')[1][:2] for _ in range(3)]
        assert paths == [b"/0", b"/1", b"/2"]
    finally:
        writer.close()


async def test_a_parked_connection_its_client_closed_is_closed_without_a_transport(web, gateway):
    gw = await gateway(limits=LIMITS)
    made = []
    gate = gw._gate
    assert gate is not None
    assert gate.parking is not None
    factory = gate.parking._factory
    gate.parking._factory = lambda park_after: made.append(1) or factory(park_after)  # type: ignore[assignment]
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    await served(reader, writer)
    await eventually(lambda: parked(gw) == 1, what="the connection parked")

    writer.close()

    await eventually(lambda: gw.connections == 0, what="no connection left")
    assert made == []


async def test_a_parked_connection_is_closed_at_its_keepalive_deadline(web, gateway):
    gw = await gateway(limits=ListenerLimits(park_after=0.1, keepalive_timeout=0.6))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        await served(reader, writer)
        idle_from = asyncio.get_running_loop().time()
        await eventually(lambda: parked(gw) == 1, what="the connection parked")
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the gateway, cleanly
        waited = asyncio.get_running_loop().time() - idle_from
        assert 0.6 <= waited < 0.6 + 0.25 + 0.5
    finally:
        writer.close()
    assert gw.connections == 0


async def test_parked_connections_count_against_max_connections(web, gateway):
    gw = await gateway(limits=ListenerLimits(park_after=0.1, max_connections=1))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        await served(reader, writer)
        await eventually(lambda: parked(gw) == 1, what="the connection parked")

        other_reader, other_writer = await asyncio.open_connection("127.0.0.1", gw.port)
        async with asyncio.timeout(5):
            refused = await other_reader.read()
        other_writer.close()
        assert refused.startswith(b"HTTP/1.1 503")

        await served(reader, writer)  # the parked one comes back: within the limit
    finally:
        writer.close()


async def test_shutdown_closes_parked_connections(web, gateway):
    gw = await gateway(limits=LIMITS)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        await served(reader, writer)
        await eventually(lambda: parked(gw) == 1, what="the connection parked")

        await gw.stop()

        async with asyncio.timeout(5):
            assert await reader.read() == b""
        assert gw.connections == 0
    finally:
        writer.close()


async def test_zero_never_parks(web, gateway):
    gw = await gateway(limits=ListenerLimits(park_after=0))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        await served(reader, writer)
        await asyncio.sleep(0.5)  # idle long enough to be parked, were park_after not 0
        assert (in_loop(gw), parked(gw)) == (1, 0)
        assert gw._gate is not None
        assert gw._gate.parking is None
    finally:
        writer.close()


async def test_the_connections_gauge_counts_parked_and_in_loop_connections(web, gateway):
    gw = await gateway(limits=LIMITS)
    registry = CollectorRegistry()
    registry.register(ConnectionsCollector(lambda: (gw.connections, gw.parked)))

    def gauge(state: str) -> float | None:
        return registry.get_sample_value("gateway_client_connections", {"state": state})

    assert (gauge("in_loop"), gauge("parked")) == (0, 0)
    idle = await asyncio.open_connection("127.0.0.1", gw.port)
    busy = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        await served(*idle)
        await eventually(lambda: gw.parked == 1, what="the connection parked")
        busy[1].write(b"GET / HT")  # a head begun: in the loop
        await asyncio.sleep(0.3)  # idle three times park_after: it stays in the loop
        assert (gauge("in_loop"), gauge("parked")) == (1, 1)
    finally:
        idle[1].close()
        busy[1].close()
    await eventually(lambda: gw.connections == 0, what="no connection left")
    assert (gauge("in_loop"), gauge("parked")) == (0, 0)


def test_the_connections_gauge_has_no_sample_before_the_listener_starts():
    registry = CollectorRegistry()
    registry.register(ConnectionsCollector(lambda: None))
    assert registry.get_sample_value("gateway_client_connections", {"state": "parked"}) is None
