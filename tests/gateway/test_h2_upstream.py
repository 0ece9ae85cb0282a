"""``proxy.h2_upstream`` on uvloop (as the gateway runs) against an HTTP/2 server on ``h2``:
streams multiplexed on a connection up to the smaller of the server's
SETTINGS_MAX_CONCURRENT_STREAMS and the gateway's cap, a new connection when it is full, an
answer's body and trailers."""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import uvloop

from gateway.proxy.h2_upstream import H2Connector
from tests.support.eventually import eventually

FIELDS = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"t"), (b":path", b"/")]


class Sink:
    def __init__(self) -> None:
        self.body = bytearray()

    def response_data(self, data: bytes) -> None:
        self.body += data


async def h2_server(cap: int, release: asyncio.Event) -> tuple[asyncio.Server, list[int]]:
    """A server that answers each stream ``ok`` with a trailer once ``release`` is set;
    the ports its connections came from, one per connection."""
    peers: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = h2.connection.H2Connection(config)
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: cap},
        )
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        pending: list[int] = []

        def answer() -> None:
            while pending and release.is_set():
                stream_id = pending.pop()
                conn.send_headers(stream_id, [(b":status", b"200")])
                conn.send_data(stream_id, b"ok")
                conn.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
            writer.write(conn.data_to_send())

        async def on_release() -> None:
            await release.wait()
            answer()

        answering = asyncio.ensure_future(on_release())
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    pending.append(event.stream_id or 0)
            answer()
        answering.cancel()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, peers


@pytest.mark.parametrize(("server_cap", "our_cap"), [(1, 100), (100, 1)])
def test_a_full_connection_opens_another(server_cap: int, our_cap: int) -> None:
    async def main() -> None:
        release = asyncio.Event()
        server, peers = await h2_server(server_cap, release)
        port = server.sockets[0].getsockname()[1]
        connector = H2Connector(our_cap)
        try:
            first = await connector.open("127.0.0.1", port, FIELDS, True, 2)
            second = await connector.open("127.0.0.1", port, FIELDS, True, 2)
            assert len(connector.connections[f"127.0.0.1:{port}"]) == 2
            release.set()
            for stream in (first, second):
                head = await stream.head
                sink = Sink()
                stream.attach(sink)  # type: ignore[arg-type]
                assert await stream.done == [(b"grpc-status", b"0")]
                assert (head.status, bytes(sink.body)) == (200, b"ok")
            assert len(peers) == 2
        finally:
            connector.close()
            server.close()
            await eventually(lambda: not connector.connections, what="connections closed")
            await server.wait_closed()

    uvloop.run(main())


def test_streams_share_a_connection_with_room() -> None:
    async def main() -> None:
        release = asyncio.Event()
        server, peers = await h2_server(100, release)
        port = server.sockets[0].getsockname()[1]
        connector = H2Connector(100)
        try:
            streams = await asyncio.gather(
                *(connector.open("127.0.0.1", port, FIELDS, True, 2) for _ in range(5))
            )
            release.set()
            for stream in streams:
                stream.attach(Sink())  # type: ignore[arg-type]
                await stream.done
            assert len(peers) == 1  # the waiting requests shared the one connect
        finally:
            connector.close()
            server.close()
            await eventually(lambda: not connector.connections, what="connections closed")
            await server.wait_closed()

    uvloop.run(main())
