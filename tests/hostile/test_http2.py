"""Hostile HTTP/2 clients (h2c by prior knowledge): floods that cost the gateway work or
memory for nothing, each ended with GOAWAY while a well-behaved client is served alongside
(``alongside``), and the next client served.

Rapid reset (CVE-2023-44487) and zero-window stalls go through ``H2Client``; the others are
raw frames (hyperframe, and HPACK written by hand), which no well-behaved client would send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from hpack.hpack import encode_integer
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from prometheus_client import CollectorRegistry

from gateway.config import ListenerLimits
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.scrape import MetricsCollector
from gateway.pool.pool import Pool
from gateway.proxy.h2_downstream import (
    EMPTY_FLOOD,
    HELD_HIGH_WATER,
    PRIORITY_FLOOD,
    WINDOW_UPDATE_FLOOD,
    H2Connection,
)
from gateway.server import TrafficServer
from gateway.wire.http2 import PREFACE
from gateway.wire.splice import SPLICE_SIZE
from tests.gateway.conftest import Recorder, routing
from tests.hostile.conftest import MiB, rss
from tests.support.eventually import eventually
from tests.support.h2_client import H2Client

Start = Callable[..., Awaitable[Any]]

ENHANCE_YOUR_CALM = 0xB
PROTOCOL_ERROR = 0x1
COMPRESSION_ERROR = 0x9
FRAME_SIZE_ERROR = 0x6
BIG = 1024 * 1024
"""The length of ``/big``'s answer."""


@pytest.fixture
async def hanging(upstream: Start, pool: Pool) -> asyncio.Event:
    """A service whose upstream answers ``/hang`` only once the event is set, and ``/`` at
    once; ``/big``: 1 KiB of a 1 MiB answer, then the rest once the event is set; ``/empty``:
    an empty answer with a 4,000-byte field (over HPACK's table: sent whole each time)."""
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def empty(request: web.Request) -> web.Response:
        return web.Response(body=b"", headers={"x-fat": "f" * 4000})

    async def upload(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = BIG
        await response.prepare(request)
        await response.write(b"z" * 1024)
        await release.wait()
        await response.write(b"z" * (65536 - 1024))
        for _ in range(BIG // 65536 - 1):
            await response.write(b"z" * 65536)
        return response

    app = web.Application()
    app.router.add_get("/hang", hang)
    app.router.add_get("/", ok)
    app.router.add_get("/empty", empty)
    app.router.add_post("/upload", upload)
    app.router.add_get("/big", big)
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


@contextlib.asynccontextmanager
async def alongside(server: TrafficServer) -> AsyncIterator[None]:
    """A well-behaved client on a connection of its own, asking for ``/`` again and again
    while the attack runs: every answer it gets is 200 "ok", and it gets at least one."""
    client = await H2Client.connect(server.port)
    answers: list[tuple[int, bytes]] = []
    stop = asyncio.Event()

    async def ask() -> None:
        while not stop.is_set() or not answers:
            (answer,) = await client.get(client.request("/"))
            answers.append((answer.status, bytes(answer.body)))

    asking = asyncio.create_task(ask())
    try:
        yield
    finally:
        stop.set()
        try:
            await asking
        finally:
            await client.close()
    assert client.terminated is None
    assert set(answers) == {(200, b"ok")}, answers


async def attack(server: TrafficServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that sent the preface and empty SETTINGS."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(PREFACE + SettingsFrame(0).serialize())
    return reader, writer


async def unread(server: TrafficServer) -> tuple[asyncio.StreamWriter, H2Connection]:
    """A raw connection that sent the preface and empty SETTINGS and reads nothing (its
    receive buffer 4 KiB: its window stays small), and its connection in the gateway."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(PREFACE + SettingsFrame(0).serialize())
    port = sock.getsockname()[1]

    def taken() -> H2Connection | None:
        for conn in server._h2_connections:
            transport = conn.transport
            if transport is not None and transport.get_extra_info("peername")[1] == port:
                return conn
        return None

    conn: H2Connection = await eventually(taken, what="the connection taken")
    return writer, conn


async def sent(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    try:
        await writer.drain()
    except ConnectionError:
        pass  # refused before the last of it


def hpack_string(value: bytes) -> bytes:
    """An HPACK string literal, without Huffman coding (RFC 7541 5.2)."""
    return bytes(encode_integer(len(value), 7)) + value


def request_head(*fields: bytes) -> bytes:
    """A header block: GET http://example.test/ (static-table pseudo-fields and a literal
    :authority), then ``fields`` as they are."""
    authority = b"\x01" + hpack_string(b"example.test")  # literal, not indexed
    return b"\x82\x86\x84" + authority + b"".join(fields)


def header_block(stream_id: int, block: bytes, size: int = 16_384) -> bytes:
    """``block`` in a HEADERS frame and as many CONTINUATION frames as it takes."""
    pieces = [block[at : at + size] for at in range(0, len(block), size)]
    frames = []
    for index, piece in enumerate(pieces):
        frame = HeadersFrame(stream_id) if index == 0 else ContinuationFrame(stream_id)
        frame.data = piece
        if index == 0:
            frame.flags.add("END_STREAM")
        if index == len(pieces) - 1:
            frame.flags.add("END_HEADERS")
        frames.append(frame.serialize())
    return b"".join(frames)


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
        async with alongside(server):
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


AUTHORITY = b"\x01" + hpack_string(b"example.test")
"""``:authority: example.test``, a literal not indexed."""


@pytest.mark.parametrize(
    "block",
    [
        b"\x82\x86" + AUTHORITY + b"\x04" + hpack_string(b"/ HTTP/1.1\r\nx-s: 1\r\n\r\nGET /"),
        b"\x82\x86" + AUTHORITY + b"\x04" + hpack_string(b"/ HTTP/1.1 x"),
        b"\x02" + hpack_string(b"GET / HTTP/1.1\r\n") + b"\x86\x84" + AUTHORITY,
        b"\x82\x86\x84\x01" + hpack_string(b"example.test\r\nx-smuggled: 1"),
        request_head(b"\x00" + hpack_string(b"X-Upper") + hpack_string(b"1")),
        request_head(b"\x00" + hpack_string(b"transfer-encoding") + hpack_string(b"chunked")),
    ],
    ids=["crlf-in-path", "space-in-path", "crlf-in-method", "crlf-in-authority", "upper-case",
         "transfer-encoding"],
)  # fmt: skip
async def test_a_head_that_would_split_or_bend_the_http1_request_is_refused_on_its_stream(
    gateway: Start, hanging: asyncio.Event, recorder: Recorder, block: bytes
) -> None:
    """A head whose fields would make a different HTTP/1.1 request upstream (a CR or LF, or
    a space, in what becomes the request line or Host; a field HTTP/2 forbids) is reset
    with PROTOCOL_ERROR on its stream alone (RFC 9113 8.1.1): no request begins, and the
    next stream on the same connection is served."""
    server = await gateway()
    reader, writer = await attack(server)
    try:
        await sent(writer, header_block(1, block) + header_block(3, request_head()))
        resets: dict[int, int] = {}
        answer = b""
        data = b""
        async with asyncio.timeout(5):
            while True:
                chunk = await reader.read(65536)
                assert chunk, "closed before stream 3's answer"
                data += chunk
                while len(data) >= 9:
                    frame, length = RstStreamFrame.parse_frame_header(memoryview(data[:9]))
                    if len(data) < 9 + length:
                        break
                    frame.parse_body(memoryview(data[9 : 9 + length]))
                    data = data[9 + length :]
                    if isinstance(frame, RstStreamFrame):
                        resets[frame.stream_id] = int(frame.error_code)
                    elif isinstance(frame, DataFrame) and frame.stream_id == 3:
                        answer += frame.data
                    elif isinstance(frame, GoAwayFrame):
                        raise AssertionError(f"GOAWAY {frame.error_code}")
                if answer == b"ok":
                    break
    finally:
        writer.close()
    assert resets == {1: PROTOCOL_ERROR}
    await eventually(lambda: len(recorder.records) == 1, what="stream 3's request recorded")
    assert recorder.records[0].path == "/"


async def test_a_continuation_flood_is_refused_before_its_end(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """CVE-2024-27316's shape: a header block that never ends, in CONTINUATION frames."""
    server = await gateway()
    async with alongside(server):
        reader, writer = await attack(server)
        try:
            headers = HeadersFrame(1)
            headers.data = b"\x82"  # :method GET, and no END_HEADERS
            writer.write(headers.serialize())
            continuation = ContinuationFrame(1)
            continuation.data = b"\x00" * 16_000
            await sent(writer, continuation.serialize() * 200)
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
    batches = 0
    try:
        async with alongside(server):
            writer.write(PREFACE + SettingsFrame(0).serialize())
            while batches < 2000:  # at most 2 million PINGs (34 MB): a bound on a hang
                writer.write(batch)
                try:
                    await writer.drain()
                except ConnectionError:
                    break  # the gateway dropped it
                batches += 1
    finally:
        writer.close()
    assert batches < 2000
    await eventually(lambda: not server._h2_connections, what="the connection closed")
    await served(server)


async def test_an_hpack_bomb_is_refused_while_it_is_decoded(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """A 4,000-byte field put in the dynamic table, then referenced a million times (a byte
    each) in one header block of 1 MB: 4 GB decoded. Refused once the list decoded so far
    passes ``max_header_list_size``, with GOAWAY ENHANCE_YOUR_CALM; memory stays bounded."""
    server = await gateway()
    insert = b"\x40" + hpack_string(b"x-bomb") + hpack_string(b"a" * 4000)  # indexed: 62
    block = request_head(insert) + b"\xbe" * (60 * 16_384)
    frames = header_block(1, block)
    before = rss()
    started = time.perf_counter()
    async with alongside(server):
        for _ in range(5):
            reader, writer = await attack(server)
            try:
                await sent(writer, frames)
                assert await goaway(reader) == ENHANCE_YOUR_CALM
            finally:
                writer.close()
    grown = rss() - before
    print(
        f"\nHPACK bomb: 5 x {len(frames) / MiB:.1f} MiB blocks ({len(block) - 4000} references)"
        f" refused in {time.perf_counter() - started:.2f} s; RSS grew {grown / MiB:.1f} MiB"
    )
    assert grown < 16 * MiB
    await served(server)


async def test_a_table_size_update_beyond_the_advertised_one_is_refused(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """A dynamic table size update to 1 GiB, where SETTINGS_HEADER_TABLE_SIZE is 4,096
    (RFC 7541 4.2): a decoding error, GOAWAY COMPRESSION_ERROR (RFC 9113 4.3; ``h2`` says
    PROTOCOL_ERROR), before any field is put in such a table."""
    server = await gateway()
    update = bytes([0x20 | encode_integer(1 << 30, 5)[0]]) + bytes(encode_integer(1 << 30, 5)[1:])
    async with alongside(server):
        reader, writer = await attack(server)
        try:
            await sent(writer, header_block(1, update + request_head()))
            assert await goaway(reader) == COMPRESSION_ERROR
        finally:
            writer.close()
    await served(server)


async def test_a_zero_window_stall_holds_bounded_answers_and_is_reset_after_send_timeout(
    gateway: Start, hanging: asyncio.Event, pool: Pool
) -> None:
    """A client that sets SETTINGS_INITIAL_WINDOW_SIZE 0 and opens 100 streams whose answers
    are 1 MiB each (their heads first, then the rest at once): the gateway holds at most
    ``HELD_HIGH_WATER`` and one read across them (not 64 KiB and a read for each), resets
    them after ``send_timeout``, and releases their upstream connections."""
    server = await gateway(ListenerLimits(send_timeout=1.0))
    client = await H2Client.connect(server.port, window=0, acknowledge=False)
    try:
        async with alongside(server):
            streams = [client.request("/big") for _ in range(100)]
            conn: H2Connection = await eventually(
                lambda: next((c for c in server._h2_connections if len(c.streams) == 100), None),
                what="the 100 streams open",
            )
            await eventually(
                lambda: all(s.answered for s in conn.streams.values()),
                what="every answer's head sent",
            )
            hanging.set()
            await eventually(
                lambda: all(s.writing_paused for s in conn.streams.values()),
                what="every stream's upstream paused",
            )
            held = conn.held
            started = time.perf_counter()
            answers = await client.get(*streams, within=10)
            took = time.perf_counter() - started
    finally:
        await client.close()
    print(
        f"\nzero-window stall: 100 streams held {held / MiB:.2f} MiB between them;"
        f" reset {took:.2f} s later"
    )
    assert held <= HELD_HIGH_WATER + SPLICE_SIZE
    assert took < 3.0  # one send_timeout, not one for each stream reset before another
    assert all(answer.reset is not None and not answer.body for answer in answers)
    await eventually(
        lambda: pool.service("web").inflight.get("u1", 0) == 0,
        what="the upstream leases released",
    )
    await served(server)


@pytest.mark.parametrize(
    ("length", "body"),
    [(16_385, 16_385), (2**24 - 1, 1024 * 1024)],
    ids=["one_byte_over", "16_MiB_announced"],
)
async def test_a_frame_over_the_size_limit_is_refused_at_its_header(
    gateway: Start, hanging: asyncio.Event, length: int, body: int
) -> None:
    """A frame longer than SETTINGS_MAX_FRAME_SIZE (16,384): GOAWAY FRAME_SIZE_ERROR at
    its header, without waiting for (and buffering) the 16 MiB it announces."""
    server = await gateway()
    async with alongside(server):
        reader, writer = await attack(server)
        try:
            header = length.to_bytes(3, "big") + b"\x00\x00" + (1).to_bytes(4, "big")  # DATA
            writer.write(header)
            await sent(writer, b"\x00" * body)
            assert await goaway(reader) == FRAME_SIZE_ERROR
        finally:
            writer.close()
    await served(server)


@pytest.mark.parametrize("padded", [False, True], ids=["empty", "padding_only"])
async def test_an_empty_data_flood_is_ended(
    gateway: Start, hanging: asyncio.Event, padded: bool
) -> None:
    """DATA frames with nothing in them and no END_STREAM, on a request body under way:
    each costs the gateway a frame's work for nothing (Envoy's
    ``max_consecutive_inbound_frames_with_empty_payload``)."""
    server = await gateway()
    client = await H2Client.connect(server.port)
    try:
        async with alongside(server):
            stream = client.request("/upload", method="POST", end=False)
            client.send_body(stream, b"x" * 100, end=False)  # a body that is not empty
            empty = DataFrame(stream)
            if padded:
                empty.flags.add("PADDED")
                empty.pad_length = 10
            client.writer.write(empty.serialize() * (EMPTY_FLOOD + 1))
            await client.read(lambda: client.terminated is not None)
    finally:
        await client.close()
    assert client.terminated is not None
    assert client.terminated.error_code == ENHANCE_YOUR_CALM


async def test_a_few_empty_data_frames_are_no_flood(gateway: Start, hanging: asyncio.Event) -> None:
    """Empty DATA frames between pieces of a body, never ``EMPTY_FLOOD`` in a row."""
    server = await gateway()
    client = await H2Client.connect(server.port)
    try:
        stream = client.request("/upload", method="POST", end=False)
        for _ in range(5):
            client.writer.write(DataFrame(stream).serialize() * EMPTY_FLOOD)
            client.send_body(stream, b"x" * 100, end=False)
        client.send_body(stream, b"", end=True)
        (answer,) = await client.get(stream)
    finally:
        await client.close()
    assert client.terminated is None
    assert (answer.status, bytes(answer.body)) == (200, b"x" * 500)


async def test_a_read_of_many_frames_is_taken_over_turns_in_order(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """A body in 5,000 DATA frames of one byte, written at once: the gateway feeds such a
    read to ``h2`` over several turns of its loop (``TURN_EVENTS``), and the body arrives
    whole and in order."""
    server = await gateway()
    client = await H2Client.connect(server.port)
    body = bytes(65 + index % 26 for index in range(5000))
    try:
        stream = client.request("/upload", method="POST", end=False)
        frames = []
        for byte in body:
            frame = DataFrame(stream)
            frame.data = bytes([byte])
            frames.append(frame.serialize())
        last = DataFrame(stream)
        last.flags.add("END_STREAM")
        client.writer.write(b"".join(frames) + last.serialize())
        (answer,) = await client.get(stream)
    finally:
        await client.close()
    assert client.terminated is None
    assert (answer.status, bytes(answer.body)) == (200, body)


async def test_a_priority_flood_is_ended(gateway: Start, hanging: asyncio.Event) -> None:
    """PRIORITY frames, beyond ``PRIORITY_FLOOD`` for each stream opened (Envoy's
    ``max_inbound_priority_frames_per_stream``): each costs a frame's work for nothing."""
    server = await gateway()
    frames = b""
    for index in range(PRIORITY_FLOOD + 1):
        frame = PriorityFrame(2 * index + 1)
        frame.depends_on = 0
        frame.stream_weight = 15
        frames += frame.serialize()
    async with alongside(server):
        reader, writer = await attack(server)
        try:
            await sent(writer, frames)
            assert await goaway(reader) == ENHANCE_YOUR_CALM
        finally:
            writer.close()
    await served(server)


async def test_a_window_update_flood_is_ended(gateway: Start, hanging: asyncio.Event) -> None:
    """WINDOW_UPDATE frames beyond ``WINDOW_UPDATE_FLOOD`` for each DATA frame sent (and
    stream opened; Envoy's ``max_inbound_window_update_frames_per_data_frame_sent``): each
    has the gateway look at every stream's queue."""
    server = await gateway()
    update = WindowUpdateFrame(0)
    update.window_increment = 1
    async with alongside(server):
        reader, writer = await attack(server)
        try:
            await sent(writer, update.serialize() * (WINDOW_UPDATE_FLOOD + 1))
            assert await goaway(reader) == ENHANCE_YOUR_CALM
        finally:
            writer.close()
    await served(server)


async def test_window_updates_for_what_was_sent_are_no_flood(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """A client that opens its windows frame by frame while it reads 1 MiB answers."""
    server = await gateway()
    hanging.set()
    client = await H2Client.connect(server.port)
    try:
        for _ in range(3):
            (answer,) = await client.get(client.request("/big"))
            assert len(answer.body) == BIG
    finally:
        await client.close()
    assert client.terminated is None


async def test_a_connection_without_a_request_within_the_header_timeout_is_closed(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """Slowloris over HTTP/2: the preface, then PINGs and no request. As HTTP/1.1's head,
    the first request is due within ``header_timeout``, PINGs or not (not
    ``keepalive_timeout``, which would hold it a minute)."""
    server = await gateway(limits=ListenerLimits(header_timeout=0.5, keepalive_timeout=60))
    async with alongside(server):
        reader, writer = await attack(server)

        async def ping() -> None:
            with contextlib.suppress(ConnectionError):
                while not writer.is_closing():
                    await sent(writer, PingFrame(0).serialize())
                    await asyncio.sleep(0.1)

        pinging = asyncio.create_task(ping())
        started = time.monotonic()
        try:
            assert await goaway(reader) == 0  # NO_ERROR, then closed
            assert time.monotonic() - started < 2.0
        finally:
            pinging.cancel()
            writer.close()
    await eventually(lambda: not server._h2_connections, what="the connection closed")
    await served(server)


async def test_a_header_block_trickled_in_continuation_frames_is_ended(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """A request served, then a HEADERS frame without END_HEADERS and a byte of
    CONTINUATION every 0.1 s (under ``h2``'s 64 frames for 6 s): GOAWAY once the block is
    ``header_timeout`` old; nothing else could come on the connection meanwhile."""
    server = await gateway(limits=ListenerLimits(header_timeout=0.5, keepalive_timeout=60))
    async with alongside(server):
        reader, writer = await attack(server)
        await sent(writer, header_block(1, request_head()))  # a whole request first
        headers = HeadersFrame(3)
        headers.data = b"\x82"  # :method GET, and no END_HEADERS
        headers.flags.add("END_STREAM")
        await sent(writer, headers.serialize())

        async def trickle() -> None:
            continuation = ContinuationFrame(3)
            continuation.data = b"\x84"
            with contextlib.suppress(ConnectionError):
                for _ in range(60):
                    await asyncio.sleep(0.1)
                    if writer.is_closing():
                        return
                    await sent(writer, continuation.serialize())

        trickling = asyncio.create_task(trickle())
        started = time.monotonic()
        try:
            assert await goaway(reader) == ENHANCE_YOUR_CALM
            assert time.monotonic() - started < 2.0
        finally:
            trickling.cancel()
            writer.close()
    await eventually(lambda: not server._h2_connections, what="the connection closed")
    await served(server)


async def test_a_body_trickled_under_the_minimum_rate_is_408_on_its_stream_alone(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """A byte every 0.1 s (never idle for ``body_timeout``), ``body_min_rate: 100``: 408 on
    that stream once ``body_timeout`` has passed and its average is under the rate; another
    stream of the connection, waiting on its answer meanwhile, is answered after it."""
    server = await gateway(limits=ListenerLimits(body_timeout=0.5, body_min_rate=100))
    async with alongside(server):
        client = await H2Client.connect(server.port)
        try:
            waiting = client.request("/hang")
            slow = client.request(
                "/upload", method="POST", body=b"x", headers=[("content-length", "1000")], end=False
            )

            async def trickle() -> None:
                with contextlib.suppress(Exception):  # (until its stream is reset)
                    for _ in range(100):
                        await asyncio.sleep(0.1)
                        client.send_body(slow, b"x", end=False)

            trickling = asyncio.create_task(trickle())
            started = time.monotonic()
            try:
                (answer,) = await client.get(slow)
                took = time.monotonic() - started
            finally:
                trickling.cancel()
            assert answer.status == 408
            assert 0.5 <= took < 2.0, took
            hanging.set()
            (other,) = await client.get(waiting)
            assert (other.status, bytes(other.body)) == (200, b"late")
        finally:
            await client.close()
        assert client.terminated is None
    await served(server)


async def ask(writer: asyncio.StreamWriter, conn: H2Connection, path: bytes, n: int) -> None:
    """``n`` GET requests for ``path`` on new streams, at once; returns once the gateway took
    them and answered them, or holds every open stream's answer (its socket full)."""
    first = 2 * conn.opened + 1
    head = b"\x82\x86\x04" + hpack_string(path) + b"\x01" + hpack_string(b"example.test")
    await sent(writer, b"".join(header_block(i, head) for i in range(first, first + 2 * n, 2)))
    asked = conn.opened + n
    await eventually(
        lambda: (
            conn.ended or (conn.opened == asked and all(s.answered for s in conn.streams.values()))
        ),
        what=f"the {n} answered",
    )


async def test_answers_to_a_client_that_reads_none_of_them_wait_in_their_streams(
    gateway: Start, hanging: asyncio.Event
) -> None:
    """Small answers on many streams to a client that reads none of them: once its socket
    buffer is full, their DATA and their ends wait in the streams (at most
    ``max_concurrent_streams`` of them, each bounded) and the transport holds no more;
    reset after ``send_timeout``."""
    server = await gateway(ListenerLimits(send_timeout=1.0))
    asked = 0
    async with alongside(server):
        writer, conn = await unread(server)
        try:
            while not conn.socket_full and asked < 10_000:  # 20 MB of answers: a bound
                await ask(writer, conn, b"/empty", 50)  # 4 KB each: to fill the socket
                asked += 50
            assert conn.socket_full
            data_sent = conn.data_sent
            await ask(writer, conn, b"/", 50)
            waiting = list(conn.streams.values())
            held, data_sent = conn.held, conn.data_sent - data_sent
            await eventually(lambda: not conn.streams, what="the streams reset")
        finally:
            writer.close()
    print(f"\nsocket full after {asked} answers; 50 more held in their streams")
    assert len(waiting) == 50
    assert all(s.ending and not s.ended for s in waiting)
    assert (held, data_sent) == (50 * 2, 0)  # their heads alone went, their DATA waits
    assert all(s.closed for s in waiting)
    await served(server)


async def test_answers_to_a_client_that_reads_none_of_them_are_bounded(
    gateway: Start, hanging: asyncio.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """Answers that are a HEADERS frame alone (4 KB, the end of the stream with it), on many
    streams, to a client that reads none of them: once its socket buffer is full, the
    transport takes ``OUTBOUND_FLOOD`` bytes more, then the connection is dropped (Envoy's
    ``max_outbound_frames``)."""
    caplog.set_level(logging.INFO, "gateway.proxy.h2_downstream")
    server = await gateway()
    asked = 0
    async with alongside(server):
        writer, conn = await unread(server)
        try:
            while asked < 10_000 and not conn.ended:  # 40 MB of answers: a bound on a hang
                try:
                    await ask(writer, conn, b"/empty", 50)
                except ConnectionError:
                    break
                asked += 50
        finally:
            writer.close()
    print(f"\nanswers to a client that reads nothing: dropped after {asked}")
    assert asked < 10_000
    assert "outbound frame flood" in caplog.text
    await eventually(lambda: conn not in server._h2_connections, what="the connection closed")
    await served(server)


async def test_resets_of_frames_on_a_closed_stream_to_a_client_that_reads_nothing_are_bounded(
    gateway: Start, hanging: asyncio.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """DATA frames on a stream already closed, each answered with RST_STREAM STREAM_CLOSED
    (by ``h2``, without an event), from a client that reads nothing: once its socket buffer is
    full, ``CONTROL_FLOOD`` resets more and the connection is dropped (Envoy's
    ``max_outbound_control_frames``)."""
    caplog.set_level(logging.INFO, "gateway.proxy.h2_downstream")
    server = await gateway()
    batch = DataFrame(1).serialize() * 1000
    batches = 0
    async with alongside(server):
        writer, conn = await unread(server)
        try:
            await sent(writer, header_block(1, request_head()))
            await eventually(lambda: conn.opened and not conn.streams, what="stream 1 answered")
            while batches < 2000:  # 2 million resets (26 MB): a bound on a hang
                try:
                    await sent(writer, batch)
                except ConnectionError:
                    break
                batches += 1
                if conn.ended:
                    break
        finally:
            writer.close()
    assert batches < 2000
    assert "outbound control frame flood" in caplog.text
    await served(server)


async def test_slow_clients_given_up_on_are_counted_in_the_metrics(
    gateway: Start, hanging: asyncio.Event, pool: Pool
) -> None:
    """Each slow-client defence of HTTP/2 counts in ``gateway_client_timeouts_total``, as
    HTTP/1.1's do: no request within ``header_timeout`` and a header block left open
    (``header``), a body that stops (``body``), an answer left unread (``send``)."""
    registry = CollectorRegistry()
    metrics = GatewayMetrics()
    registry.register(MetricsCollector(metrics))
    metrics.attach(pool)
    limits = ListenerLimits(header_timeout=0.3, body_timeout=0.3, send_timeout=0.3)
    server = await gateway(limits)
    server.proxy.forwarding.observers += (metrics,)

    def counted(timeout: str, protocol: str = "h2") -> float | None:
        labels = {"protocol": protocol, "timeout": timeout}
        return registry.get_sample_value("gateway_client_timeouts_total", labels)

    assert counted("header") == 0  # every series from the start
    reader, writer = await attack(server)  # no request
    try:
        assert await goaway(reader) == 0
    finally:
        writer.close()
    reader, writer = await attack(server)
    try:
        await sent(writer, header_block(1, request_head()))  # a request, answered
        await sent(writer, HeadersFrame(3).serialize())  # then a header block never ended
        assert await goaway(reader) == ENHANCE_YOUR_CALM
    finally:
        writer.close()
    client = await H2Client.connect(server.port)
    try:
        stops = client.request(
            "/upload", method="POST", body=b"x", headers=[("content-length", "10")], end=False
        )
        (stopped,) = await client.get(stops)
    finally:
        await client.close()
    client = await H2Client.connect(server.port, window=0, acknowledge=False)
    try:
        hanging.set()
        (left,) = await client.get(client.request("/big"))
    finally:
        await client.close()
    assert stopped.status == 408
    assert left.reset is not None
    assert (counted("header"), counted("body"), counted("send")) == (2, 1, 1)
    assert [counted(t, "http/1.1") for t in ("header", "body", "send")] == [0, 0, 0]
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        await sent(writer, b"GET / HTTP/1.1\r\nHost: a")  # an HTTP/1.1 head that stops
        async with asyncio.timeout(5):
            assert not await reader.read()  # closed
    except ConnectionResetError:
        pass  # (aborted)
    finally:
        writer.close()
    assert (counted("header", "http/1.1"), counted("header")) == (1, 2)
