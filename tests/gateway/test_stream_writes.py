"""Relayed chunks written to the client's socket itself (``ResponseStream.relay``): in order
whatever the socket takes at once, back to the socket once the transport holds nothing, never
once the transport is closing, never over TLS. On real sockets, with uvloop and with
asyncio's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from gateway.config import ListenerLimits
from gateway.proxy.http1_downstream import ClientConnection, ConnectionGate
from gateway.proxy.streams import ResponseStream
from tests.support.eventually import eventually

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

LOOPS = pytest.mark.parametrize(
    "new_loop", [uvloop.new_event_loop, asyncio.new_event_loop], ids=["uvloop", "asyncio"]
)


def chunk(n: int, size: int = 1000) -> bytes:
    return b"%x\r\n%b\r\n" % (size, bytes([65 + n % 26]) * size)


@contextlib.asynccontextmanager
async def accepted(
    small_buffers: bool = False,
) -> AsyncIterator[tuple[ClientConnection, socket.socket]]:
    """A ClientConnection on an accepted loopback socket, and the client's end of it
    (``small_buffers``: a few KiB each way, so that the socket fills); both closed after."""

    async def handler(request: object) -> None:
        raise AssertionError("no request comes on this connection")

    with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket() as peer:
        if small_buffers:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        peer.connect(listener.getsockname())
        sock, _ = listener.accept()
        if small_buffers:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        peer.setblocking(False)
        conn = ClientConnection(handler, ListenerLimits(), ConnectionGate(8), set())
        await asyncio.get_running_loop().connect_accepted_socket(lambda: conn, sock)
        try:
            yield conn, peer
        finally:
            if conn.transport is not None:
                conn.transport.abort()
            await asyncio.sleep(0)  # its connection_lost


async def receive(peer: socket.socket, size: int) -> bytes:
    """``size`` bytes from the client's end, or what came before it was closed."""
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        more = await asyncio.wait_for(loop.sock_recv(peer, 65536), 5)
        if not more:
            break
        data += more
    return data


def differ_at(a: bytes, b: bytes) -> int | None:
    """Where ``a`` and ``b`` first differ (None: equal); cheap where pytest's diff of two
    large bytes objects is not."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def run(new_loop: Callable[[], asyncio.AbstractEventLoop], main: Awaitable[None]) -> None:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main)  # type: ignore[arg-type]


@LOOPS
def test_relayed_chunks_reach_the_client_in_order_through_a_full_socket(new_loop):
    async def main() -> None:
        async with accepted(small_buffers=True) as (conn, peer):
            transport = conn.transport
            assert transport is not None
            stream = ResponseStream(conn, chunked=True)
            stream.write_head(HEAD)
            chunks = [chunk(n) for n in range(300)]
            for data in chunks:
                stream.relay(data, 1000)
            # The socket took part of them at once; the transport holds the rest, and
            # whatever came after the first it could not take.
            assert stream.direct is None
            assert transport.get_write_buffer_size() > 0
            assert stream.fd == transport.get_extra_info("socket").fileno()

            # The client reads all the socket sent, and the socket is empty again while the
            # transport (the loop has not run since) still holds the rest: a relay now goes
            # after the rest all the same.
            got = b""
            while select.select([peer], [], [], 0.1)[0]:  # blocking: the loop must not run
                data = peer.recv(65536)
                assert data, "the gateway closed the connection"
                got += data
            assert got
            assert transport.get_write_buffer_size() > 0
            chunks.append(chunk(300))
            stream.relay(chunks[-1], 1000)

            sent = HEAD + b"".join(chunks)
            received = got + await receive(peer, len(sent) - len(got))
            assert differ_at(received, sent) is None
            await eventually(
                lambda: not transport.get_write_buffer_size(),
                timeout=1,
                every=0.01,
                what="the transport's last write done (it holds nothing)",
            )

            stream.relay(chunks[1], 1000)  # the transport holds nothing: to the socket again
            assert stream.direct is transport
            assert await receive(peer, 1006) == chunks[1]
            assert stream.bytes_out == 302 * 1000

    run(new_loop, main())


@LOOPS
def test_nothing_is_relayed_to_the_socket_once_its_transport_is_closing(new_loop):
    async def main() -> None:
        async with accepted() as (conn, peer):
            stream = ResponseStream(conn, chunked=True)
            stream.write_head(HEAD)
            stream.relay(chunk(0), 1000)
            assert stream.direct is conn.transport  # written to the socket itself
            assert await receive(peer, len(HEAD) + 1006) == HEAD + chunk(0)

            conn.close_transport()  # the connection is lost later in the loop's turn
            stream.relay(chunk(1), 1000)  # to the closing transport, which drops it
            assert await receive(peer, 1006) == b""  # the connection's end, and nothing else
            assert conn.transport is None

    run(new_loop, main())


@LOOPS
def test_over_tls_relayed_chunks_go_through_the_transport(new_loop):
    async def main() -> None:
        async with accepted() as (conn, peer):
            conn.secure = True  # its bytes are a TLS transport's to write
            stream = ResponseStream(conn, chunked=True)
            stream.write_head(HEAD)
            stream.relay(chunk(0), 1000)
            assert stream.fd == -1
            assert await receive(peer, len(HEAD) + 1006) == HEAD + chunk(0)

    run(new_loop, main())
