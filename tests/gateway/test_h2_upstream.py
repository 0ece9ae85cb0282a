"""``proxy.h2_upstream`` on uvloop (as the gateway runs) against an HTTP/2 server on ``h2``:
streams multiplexed on a connection up to the smaller of the server's
SETTINGS_MAX_CONCURRENT_STREAMS and the gateway's cap, a new connection when it is full, an
answer's body and trailers; and through the proxy, to an HTTP/1.1 client, and the attempts
retried as over HTTP/1.1 (``retry``), a stream the replica refused whatever the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import uvloop
from aiohttp.test_utils import unused_port

from gateway.config import RetriesConfig, ServiceRouting
from gateway.proxy.h2_upstream import H2Connector
from gateway.proxy.streams import ResponseStream
from tests.support.eventually import eventually
from tests.support.h2_client import H2Client
from tests.support.raw_servers import RawServers

from .conftest import add, routing, url

FIELDS = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"t"), (b":path", b"/")]


class Client:
    """The client side an answer's ``ResponseStream`` writes to (and its transport): what
    it is written, kept. The head goes as the stream's own HEADERS: none pending here (an
    HTTP/2 client's codec)."""

    writing_paused = False

    def __init__(self) -> None:
        self.body = bytearray()
        self.transport = self

    def write(self, data: bytes) -> None:
        self.body += data

    def flush(self) -> None:
        pass

    def socket_fd(self) -> int:
        return -1

    def is_closing(self) -> bool:
        return False


def sink() -> tuple[ResponseStream, Client]:
    client = Client()
    return ResponseStream(client, False), client  # type: ignore[arg-type]


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
                answer, client = sink()
                stream.attach(answer)
                assert await stream.done == [(b"grpc-status", b"0")]
                assert (head.status, bytes(client.body)) == (200, b"ok")
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
                stream.attach(sink()[0])
                await stream.done
            assert len(peers) == 1  # the waiting requests shared the one connect
        finally:
            connector.close()
            server.close()
            await eventually(lambda: not connector.connections, what="connections closed")
            await server.wait_closed()

    uvloop.run(main())


# -- through the proxy -------------------------------------------------------------------


class Replica:
    """An HTTP/2 replica on ``h2`` that answers each request, once its body is whole, as
    ``mode`` says: ``ok`` (200, its name and the body's length), ``503``, ``refuse``
    (RST_STREAM REFUSED_STREAM as the head arrives), ``goaway`` (GOAWAY with the last stream
    below the request's, then the close)."""

    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode
        self.heads = 0
        """Request heads that arrived."""
        self.fields: list[tuple[bytes, bytes]] = []
        """The last request's fields, as the replica's ``h2`` (validating them) read them."""
        self.indexed = 0
        """The most entries the gateway's header blocks put in the decoder's dynamic table."""
        self.trailers: list[dict[bytes, bytes]] = []
        """The requests' trailers, as they arrived."""

    async def start(self, servers: RawServers) -> int:
        """Serve on loopback among ``servers`` (which close its connections); the port."""
        server = await servers.start(self._serve)
        port: int = server.sockets[0].getsockname()[1]
        return port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        bodies: dict[int, bytearray] = {}
        gone = False
        while not gone and (data := await reader.read(65536)):
            for event in conn.receive_data(data):
                stream_id = getattr(event, "stream_id", None) or 0
                if isinstance(event, h2.events.RequestReceived):
                    self.heads += 1
                    self.fields = list(event.headers or [])
                    entries = len(conn.decoder.header_table.dynamic_entries)
                    self.indexed = max(self.indexed, entries)
                    if self.mode == "refuse":
                        conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                    elif self.mode == "goaway":
                        conn.close_connection(last_stream_id=stream_id - 2 if stream_id > 2 else 0)
                        gone = True
                    else:
                        bodies[stream_id] = bytearray()
                elif isinstance(event, h2.events.TrailersReceived):
                    self.trailers.append(dict(event.headers or []))
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length or 0, stream_id)
                    if stream_id in bodies:
                        bodies[stream_id] += event.data or b""
                if isinstance(event, h2.events.StreamEnded) and stream_id in bodies:
                    body = bodies.pop(stream_id)
                    status = b"503" if self.mode == "503" else b"200"
                    text = b"%s:%d" % (self.name.encode(), len(body))
                    conn.send_headers(stream_id, [(b":status", status)])
                    conn.send_data(stream_id, text, end_stream=True)
            writer.write(conn.data_to_send())
        writer.close()


@pytest.fixture
async def replicas(pool) -> AsyncIterator[Callable[[str, str], Awaitable[Replica]]]:
    """``await replicas(name, mode)``: a ``Replica`` of service ``web`` in the pool."""
    servers = RawServers()

    async def start(name: str, mode: str) -> Replica:
        replica = Replica(name, mode)
        add(pool, "web", name, await replica.start(servers))
        return replica

    yield start
    await servers.close()


def h2_service(**settings: Any) -> ServiceRouting:
    return routing(
        "web", prefix="/", upstream_protocol="http2", load_balancing="round_robin", **settings
    )


async def test_an_http1_client_gets_the_whole_answer_of_an_http2_replica(
    pool, replicas, gateway, client
) -> None:
    """Its head too: an HTTP/1.1 client's codec leaves it pending in the answer's stream."""
    pool.set_service(h2_service())
    await replicas("ok", "ok")
    gw = await gateway()

    async with client.post(url(gw), data=b"payload") as resp:
        assert (resp.status, resp.headers["Transfer-Encoding"]) == (200, "chunked")
        assert await resp.text() == "ok:7"


async def test_the_gateways_header_blocks_to_a_replica_index_nothing(
    pool, replicas, gateway, client
) -> None:
    """``wire.hpack_encoder``: fields sent again are sent whole, the replica's table stays
    empty (``hpack.Encoder`` would have indexed the custom field after the first request)."""
    pool.set_service(h2_service())
    replica = await replicas("ok", "ok")
    gw = await gateway()
    for _ in range(3):
        async with client.get(url(gw), headers={"x-custom": "the same value"}) as resp:
            assert resp.status == 200
    assert (replica.heads, replica.indexed) == (3, 0)


async def test_an_http1_requests_fields_reach_the_replica_as_http2_has_them(
    pool, replicas, gateway, client
) -> None:
    """Lower-cased, pseudo-fields first, no connection-specific ones: ``request_fields``
    makes them so, h2 does not rework or check them again."""
    pool.set_service(h2_service())
    replica = await replicas("ok", "ok")
    gw = await gateway()
    sent = {"X-Mixed-Case": "Value", "Cookie": "a=1; b=2", "Authorization": "Bearer t"}
    async with client.get(url(gw) + "p?q=1", headers={**sent, "Connection": "keep-alive"}) as resp:
        assert resp.status == 200
    names = [name for name, _ in replica.fields]
    assert names[:4] == [b":method", b":scheme", b":authority", b":path"]
    fields = dict(replica.fields)
    assert fields[b":path"] == b"/p?q=1"
    assert (fields[b"x-mixed-case"], fields[b"cookie"]) == (b"Value", b"a=1; b=2")
    assert fields[b"authorization"] == b"Bearer t"
    assert fields[b"te"] == b"trailers"
    assert all(name == name.lower() for name in names)
    assert b"connection" not in fields
    assert b"host" not in fields


@pytest.mark.parametrize("mode", ["refuse", "goaway"])
async def test_a_refused_stream_is_retried_whatever_the_request(
    pool, replicas, gateway, client, recorder, mode
) -> None:
    """No replica processed it (RFC 9113 8.7): a POST with its body goes to the other."""
    pool.set_service(h2_service())
    refusing = await replicas("refusing", mode)
    await replicas("ok", "ok")
    gw = await gateway()

    for _ in range(4):
        async with client.post(url(gw), data=b"payload") as resp:
            assert (resp.status, await resp.text()) == (200, "ok:7"), await resp.text()
    assert refusing.heads >= 1
    retried = [r for r in recorder.records if r.retries]
    assert retried
    assert all(r.retry_reasons == ("refused",) and r.upstream_id == "ok" for r in retried)


async def test_a_connect_failure_is_retried_over_http2(
    pool, replicas, gateway, client, recorder
) -> None:
    pool.set_service(h2_service())
    add(pool, "web", "dead", unused_port())
    await replicas("ok", "ok")
    gw = await gateway()

    for _ in range(4):
        async with client.post(url(gw), data=b"payload") as resp:
            assert (resp.status, await resp.text()) == (200, "ok:7")
    retried = [r for r in recorder.records if r.retries]
    assert retried
    assert all(r.retry_reasons == ("connect",) for r in retried)


@pytest.mark.parametrize("on_status", [True, False])
async def test_a_503_is_retried_for_idempotent_requests_with_on_status(
    pool, replicas, gateway, client, on_status
) -> None:
    pool.set_service(h2_service(retries=RetriesConfig(on_status=on_status)))
    await replicas("busy", "503")
    await replicas("ok", "ok")
    gw = await gateway()

    gets = set()
    for _ in range(4):
        async with client.get(url(gw)) as resp:
            gets.add((resp.status, await resp.text()))
    assert gets == ({(200, "ok:0")} if on_status else {(200, "ok:0"), (503, "busy:0")})
    # A POST with a body is not replayed: the replica's own 503 comes through.
    posts = set()
    for _ in range(4):
        async with client.post(url(gw), data=b"x") as resp:
            posts.add(resp.status)
    assert posts == {200, 503}


async def test_an_http2_clients_trailers_are_relayed_to_an_http2_replica(
    pool, replicas, gateway
) -> None:
    """Request trailers (HEADERS with END_STREAM after the body) go on after the body,
    whether they come once the attempt is under way or with the whole request."""
    pool.set_service(h2_service())
    replica = await replicas("ok", "ok")
    gw = await gateway()
    client = await H2Client.connect(gw.port)
    try:
        late = client.request("/", method="POST", body=b"payload", end=False)
        await eventually(lambda: replica.heads == 1, what="the attempt under way")
        client.conn.send_headers(late, [("x-checksum", "abc"), ("x-n", "1")], end_stream=True)
        client.flush()
        (first,) = await client.get(late)
        whole = client.request("/", method="POST", body=b"payload!", end=False)
        client.conn.send_headers(whole, [("x-checksum", "def")], end_stream=True)
        client.flush()
        (second,) = await client.get(whole)
    finally:
        await client.close()
    assert (first.status, bytes(first.body)) == (200, b"ok:7")
    assert (second.status, bytes(second.body)) == (200, b"ok:8")
    assert replica.trailers == [{b"x-checksum": b"abc", b"x-n": b"1"}, {b"x-checksum": b"def"}]
