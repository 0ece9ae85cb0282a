"""Hostile HTTP/2 clients (h2c by prior knowledge): floods that cost the gateway work or
memory for nothing, each ended with GOAWAY, the next client served.

Rapid reset (CVE-2023-44487) goes through ``H2Client``; the CONTINUATION and PING floods are
raw frames (hyperframe), which no well-behaved client would send.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from hyperframe.frame import ContinuationFrame, GoAwayFrame, HeadersFrame, PingFrame, SettingsFrame

from gateway.pool.pool import Pool
from gateway.server import TrafficServer
from gateway.wire.http2 import PREFACE
from tests.gateway.conftest import routing
from tests.support.eventually import eventually
from tests.support.h2_client import H2Client

Start = Callable[..., Awaitable[Any]]

ENHANCE_YOUR_CALM = 0xB
PROTOCOL_ERROR = 0x1


@pytest.fixture
async def hanging(upstream: Start, pool: Pool) -> asyncio.Event:
    """A service whose upstream answers ``/hang`` only once the event is set, and ``/`` at
    once."""
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/hang", hang)
    app.router.add_get("/", ok)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", app)
    yield release
    release.set()


async def served(server: TrafficServer) -> None:
    """Another client is served as if nothing had happened."""
    client = await H2Client.connect(server.port)
    try:
        (answer,) = await client.get(client.request("/"))
    finally:
        await client.close()
    assert (answer.status, bytes(answer.body)) == (200, b"ok")


async def goaway(reader: asyncio.StreamReader) -> int:
    """The error code of the GOAWAY the gateway sends before it closes (raw frames)."""
    data = b""
    async with asyncio.timeout(5):
        while chunk := await reader.read(65536):
            data += chunk
    while len(data) >= 9:
        frame, length = GoAwayFrame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        data = data[9 + length :]
        if isinstance(frame, GoAwayFrame):
            return int(frame.error_code)
    raise AssertionError("closed without GOAWAY")


async def test_rapid_reset_ends_the_connection_with_enhance_your_calm(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """CVE-2023-44487: streams opened and reset at once, each a request begun upstream."""
    server = await gateway(http2={"max_concurrent_streams": 50})
    client = await H2Client.connect(server.port)
    try:
        for _ in range(4):  # 200 resets, in batches under the stream limit
            for _ in range(50):
                stream = client.request("/hang")
                client.conn.reset_stream(stream)
            client.flush()
        await client.read(lambda: client.terminated is not None)
    finally:
        await client.close()
    assert client.terminated is not None
    assert client.terminated.error_code == ENHANCE_YOUR_CALM
    await eventually(lambda: not server._h2_connections, what="the connection closed")
    await served(server)


async def test_streams_cancelled_now_and_then_are_no_flood(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """A client that cancels a stream for every one it lets be answered stays served."""
    server = await gateway(http2={"max_concurrent_streams": 5})
    client = await H2Client.connect(server.port)
    try:
        for _ in range(20):
            client.conn.reset_stream(client.request("/hang"))
            (answer,) = await client.get(client.request("/"))
            assert answer.status == 200
    finally:
        await client.close()
    assert client.terminated is None


async def test_a_continuation_flood_is_refused_before_its_end(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """CVE-2024-27316's shape: a header block that never ends, in CONTINUATION frames."""
    server = await gateway()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(PREFACE + SettingsFrame(0).serialize())
        headers = HeadersFrame(1)
        headers.data = b"\x82"  # :method GET, and no END_HEADERS
        writer.write(headers.serialize())
        for _ in range(200):
            continuation = ContinuationFrame(1)
            continuation.data = b"\x00" * 16_000
            writer.write(continuation.serialize())
        try:
            await writer.drain()
        except ConnectionError:
            pass  # refused before the last of it
        assert await goaway(reader) == PROTOCOL_ERROR
    finally:
        writer.close()
    await served(server)


async def test_a_ping_flood_from_a_client_that_reads_nothing_is_ended(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """PINGs whose acknowledgements pile up in the gateway while the client reads none."""
    server = await gateway()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its window stays small
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    _, writer = await asyncio.open_connection(sock=sock)
    pings = PingFrame(0)
    pings.opaque_data = b"12345678"
    batch = pings.serialize() * 1000
    sent = 0
    try:
        writer.write(PREFACE + SettingsFrame(0).serialize())
        while sent < 2000:  # at most 2 million PINGs (34 MB): a bound on a hang
            writer.write(batch)
            try:
                await writer.drain()
            except ConnectionError:
                break  # the gateway dropped it
            sent += 1
    finally:
        writer.close()
    assert sent < 2000
    await eventually(lambda: not server._h2_connections, what="the connection closed")
    await served(server)
