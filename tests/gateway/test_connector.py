"""The upstream connection pool: reuse after a clean answer, its cap, connect failures;
an answer's body, read only once the proxy takes it, and spliced from reused buffers."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import random

import pytest

from gateway.config import ListenerLimits
from gateway.errors import UpstreamConnectError
from gateway.pool.upstream import Upstream
from gateway.proxy.connector import Connector, UpstreamConnection
from gateway.proxy.http1_downstream import ClientConnection, ConnectionGate
from gateway.proxy.streams import ResponseStream

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
GET = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"


class _Client:
    """The transport a ClientConnection writes to."""

    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes | memoryview) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return 0  # all sent at once

    def is_closing(self) -> bool:
        return False


def now() -> float:
    """The loop's time, from which a request's read timeout runs (``send``'s ``now``)."""
    return asyncio.get_running_loop().time()


def stream(transport: object) -> ResponseStream:
    """A ResponseStream to a ClientConnection writing to ``transport`` (a real connection:
    compiled with mypyc, ``ResponseStream`` checks that it is given one)."""

    async def handler(request: object) -> None:
        raise AssertionError("no request comes on this connection")

    client = ClientConnection(handler, ListenerLimits(), ConnectionGate(1), set())
    client.transport = transport  # type: ignore[assignment]
    return ResponseStream(client, chunked=False)


async def run(conn: UpstreamConnection) -> bytes:
    """One GET on ``conn``; the answer as the client would get it (after a head of b"")."""
    head = await conn.send(
        GET, body=False, chunked=False, head_only=False, read_timeout=5, now=now()
    )
    assert head.status == 200
    client = _Client()
    sink = stream(client)
    done = conn.stream_to(sink)
    if done is not None:
        await done
    sink.conn.flush()  # what the batch writes at the end of the loop's turn
    return client.written


@pytest.fixture
async def counting_upstream(raw_upstream):
    """An upstream answering OK to every request; ``connections`` counts its connections."""

    class Upstream:
        connections = 0
        port = 0

    async def serve(reader, writer):
        Upstream.connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    Upstream.port = await raw_upstream(serve)
    return Upstream


async def test_a_connection_is_reused_after_a_clean_answer(counting_upstream):
    connector = Connector()
    for _ in range(3):
        conn = await connector.acquire("127.0.0.1", counting_upstream.port, 1.0)
        assert await run(conn) == b"ok"
        connector.release(conn)
    assert counting_upstream.connections == 1
    assert connector.idle_count() == 1
    connector.close()


def test_an_upstream_has_its_address_made_once_and_across_copies() -> None:
    v4, v6 = Upstream("a", "web", "127.0.0.1", 9000), Upstream("b", "web", "::1", 9000)
    assert (v4.address, v6.address) == ("127.0.0.1:9000", "[::1]:9000")
    assert v4.replace(port=9001).address == "127.0.0.1:9001"
    copy = pickle.loads(pickle.dumps(v6))  # as a snapshot crosses to a worker
    assert copy == v6
    assert copy.address == "[::1]:9000"


async def test_a_kept_connection_is_found_by_its_upstream_address(counting_upstream):
    connector = Connector()
    conn = await connector.acquire("127.0.0.1", counting_upstream.port, 1.0)
    assert await run(conn) == b"ok"
    connector.release(conn)
    upstream = Upstream("u", "web", "127.0.0.1", counting_upstream.port)
    assert connector.idle(f"127.0.0.1:{counting_upstream.port + 1}") is None
    assert connector.idle(upstream.address) is conn
    assert connector.idle(upstream.address) is None  # taken: in use until released
    assert await run(conn) == b"ok"
    connector.release(conn)
    assert counting_upstream.connections == 1
    connector.close()


async def test_idle_connections_beyond_max_idle_are_closed(counting_upstream):
    connector = Connector(max_idle=1)
    first = await connector.acquire("127.0.0.1", counting_upstream.port, 1.0)
    second = await connector.acquire("127.0.0.1", counting_upstream.port, 1.0)
    assert await asyncio.gather(run(first), run(second)) == [b"ok", b"ok"]
    connector.release(first)
    connector.release(second)
    assert counting_upstream.connections == 2
    assert connector.idle_count() == 1
    connector.close()


async def test_a_connection_whose_request_failed_is_not_reused(counting_upstream):
    connector = Connector()
    conn = await connector.acquire("127.0.0.1", counting_upstream.port, 1.0)
    future = conn.send(GET, body=False, chunked=False, head_only=False, read_timeout=5, now=now())
    connector.release(conn)  # before its answer: the request is not over
    assert connector.idle_count() == 0
    with pytest.raises(UpstreamConnectError):
        await future
    connector.close()


async def test_a_refused_connection_is_a_connect_failure(unused_tcp_port):
    connector = Connector()
    with pytest.raises(UpstreamConnectError) as refused:
        await connector.acquire("127.0.0.1", unused_tcp_port, 1.0)
    assert refused.value.kind == "connect"


async def test_a_body_is_not_read_before_the_proxy_takes_it(raw_upstream):
    """uvloop reads up to 32 times a wakeup: the body would pile up in memory meanwhile."""
    body = b"x" * (4 * 1024 * 1024)

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    port = await raw_upstream(serve)
    connector = Connector()
    conn = await connector.acquire("127.0.0.1", port, 1.0)
    await conn.send(GET, body=False, chunked=False, head_only=False, read_timeout=5, now=now())
    assert conn.transport is not None
    assert not conn.transport.is_reading()
    client = _Client()
    done = conn.stream_to(stream(client))
    assert conn.transport.is_reading()
    assert done is not None
    await done
    assert client.written == body
    connector.close()


class _HoldingClient:
    """A client's transport that keeps the two newest writes unsent, without copying them, as
    uvloop does with the part of a memoryview it cannot send at once."""

    def __init__(self) -> None:
        self.held: list[bytes | memoryview] = []
        self.sent = bytearray()
        self.buffers: set[int] = set()

    def write(self, data: bytes | memoryview) -> None:
        if isinstance(data, memoryview):
            self.buffers.add(id(data.obj))
        self.held.append(data)
        while len(self.held) > 2:
            self.sent += self.held.pop(0)

    def get_write_buffer_size(self) -> int:
        return sum(len(data) for data in self.held)

    def is_closing(self) -> bool:
        return False

    def flush(self) -> bytes:
        for data in self.held:
            self.sent += data
        self.held.clear()
        return bytes(self.sent)


async def test_a_large_body_is_not_overwritten_while_the_client_holds_it(raw_upstream):
    body = random.Random(8).randbytes(3 * 1024 * 1024 + 1)

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        for at in range(0, len(body), 100_000):
            writer.write(body[at : at + 100_000])
            await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
        writer.close()

    port = await raw_upstream(serve)
    connector = Connector()
    conn = await connector.acquire("127.0.0.1", port, 1.0)
    head = await conn.send(
        GET, body=False, chunked=False, head_only=False, read_timeout=5, now=now()
    )
    assert head.content_length == len(body)
    client = _HoldingClient()
    done = conn.stream_to(stream(client))
    assert done is not None
    await done
    assert client.flush() == body
    # Read into again once sent: two held, one being read into.
    assert len(client.buffers) <= 3
    connector.release(conn)
    connector.close()
