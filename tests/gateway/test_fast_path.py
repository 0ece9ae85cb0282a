"""The task-free path (``Proxy.begin``): a request without a body or an upgrade, whose upstream
has an idle keep-alive connection, is sent from the client parser's callback and answered from
the upstream's, with no task. Every test makes a first request so that the upstream
connection is idle and kept alive, and checks that the request under test really reused it
without a task: by ``Proxy``'s counters (``ways``: the requests ``begin`` sent itself, and those
it handed to a task), and by the connection the upstream saw the request come on. Both are seen
from outside, so the tests hold for the compiled modules too (where a spy on a method sees
nothing: compiled code calls methods directly).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import socket
import struct
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from gateway.config import RetriesConfig, TimeoutsConfig
from gateway.pool.upstream import Health
from gateway.server import TrafficServer

from .conftest import add, echo_app, raw_request, routing, url

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def ways(gw: TrafficServer) -> tuple[int, int]:
    """Which way requests went since ``warm``: how many ``Proxy.begin`` sent upstream itself
    (task-free), and how many it handed to a task (no idle connection, or a failed attempt)."""
    return gw.proxy.task_free, gw.proxy.handed_on


def port_of(writer: asyncio.StreamWriter) -> int:
    """The gateway's port of a raw upstream's connection: which connection a request came on."""
    port: int = writer.get_extra_info("peername")[1]
    return port


def ported(app: web.Application) -> web.Application:
    """``app``, saying in an ``X-Peer-Port`` header which connection (the gateway's port) each
    request came on: the same port again is a reused keep-alive connection."""

    @web.middleware
    async def peer_port(request: web.Request, handler):
        response = await handler(request)
        assert request.transport is not None
        response.headers["X-Peer-Port"] = str(request.transport.get_extra_info("peername")[1])
        return response

    app.middlewares.append(peer_port)
    return app


async def warm(client, gw, recorder) -> str | None:
    """A first request, so that the upstream connection is idle and kept alive; its
    ``X-Peer-Port`` (``ported``), if any. ``ways`` counts from zero after it."""
    async with client.get(url(gw, "/warm")) as resp:
        assert resp.status == 200
        await resp.read()
        port = resp.headers.get("X-Peer-Port")
    await recorder.wait()  # made after its connection went back to the pool
    assert gw.proxy.connector.idle_count() == 1
    recorder.records.clear()
    # It had no idle connection: ``begin`` handed it to a task, which connected.
    assert ways(gw) == (0, 1)
    gw.proxy.task_free = gw.proxy.handed_on = 0
    return port


Answer = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


def keepalive(answer: Answer):
    """A raw upstream serving requests on one connection while ``answer`` returns True."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if not await answer(head.split(b" ", 2)[1].decode(), reader, writer):
                    return
        finally:
            writer.close()

    return serve


async def answer_ok(writer: asyncio.StreamWriter) -> bool:
    """Answer 200 and keep the connection (an ``Answer``'s True)."""
    writer.write(OK)
    await writer.drain()
    return True


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the gateway sent before it dropped the connection (a reset counts as a close)."""
    data = b""
    async with asyncio.timeout(1):
        try:
            while chunk := await reader.read(65536):
                data += chunk
        except ConnectionResetError:
            pass
    return data


# -- the common request ----------------------------------------------------------------------


async def test_plain_get_reuses_the_idle_connection_without_a_task(
    pool, upstream, gateway, client, recorder
):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", ported(echo_app("u1")))
    gw = await gateway()
    warm_port = await warm(client, gw, recorder)
    assert warm_port is not None

    async with client.get(url(gw, "/x?y=1"), headers={"X-Request-Id": "fast-1"}) as resp:
        raw = await resp.read()
        status, headers = resp.status, resp.headers
    body = await resp.json()

    assert (status, body["upstream"], body["path"], body["method"]) == (200, "u1", "/x?y=1", "GET")
    assert headers["X-Request-Id"] == "fast-1"
    assert int(headers["Content-Length"]) == len(raw)
    # Task-free, on the connection the first request left idle.
    assert ways(gw) == (1, 0)
    assert headers["X-Peer-Port"] == warm_port
    await recorder.wait()
    (record,) = recorder.records
    assert (record.request_id, record.service, record.upstream_id) == ("fast-1", "web", "u1")
    assert (record.method, record.path, record.status) == ("GET", "/x", 200)
    assert (record.bytes_in, record.bytes_out) == (0, len(raw))
    assert (record.error, record.retries, record.retry_reasons) == (None, 0, ())
    assert record.ttfb is not None
    assert 0 <= record.ttfb <= record.duration
    assert pool.service("web").inflight == {}
    assert pool.service("web").leases == {}
    # The connection is back in the idle pool, open, and serves the next request too.
    assert gw.proxy.connector.idle_count() == 1
    async with client.get(url(gw, "/again")) as resp:
        assert resp.status == 200
        await resp.read()
        assert resp.headers["X-Peer-Port"] == warm_port
    assert ways(gw) == (2, 0)


async def test_pipelined_requests_each_take_the_fast_path(pool, upstream, gateway, recorder):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", ported(echo_app("u1")))
    gw = await gateway()
    async with aiohttp.ClientSession() as session:
        warm_port = await warm(session, gw, recorder)

    # The second request waits in the pipeline; it starts (task-free) from the first one's
    # answer, on the connection that answer just freed.
    answer = await raw_request(
        gw.port,
        b"GET /one HTTP/1.1\r\nHost: h\r\n\r\n"
        b"GET /two HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    )

    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert answer.index(b'"path": "/one"') < answer.index(b'"path": "/two"')
    assert ways(gw) == (2, 0)  # both sent by ``begin``, neither handed to a task
    assert answer.count(b"X-Peer-Port: %s\r\n" % str(warm_port).encode()) == 2
    await recorder.wait(2)
    assert [(r.path, r.status, r.error) for r in recorder.records] == [
        ("/one", 200, None),
        ("/two", 200, None),
    ]
    assert pool.service("web").inflight == {}


# -- a stale keep-alive connection -----------------------------------------------------------


def stale_upstream(second: asyncio.Event, reset: bool = False):
    """Answers ``/warm`` with keep-alive, then closes (or resets) the connection on any other
    request without answering it, on a kept connection or a new one alike."""

    async def answer(path, reader, writer):
        if path != "/warm":
            second.set()
            if reset:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            return False  # close, unanswered
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
        await writer.drain()
        return True

    return keepalive(answer)


def closing_on_the_second_request(connections: list[int], reset: bool = False):
    """Answers the first request of each connection with keep-alive and closes (or resets)
    the connection on its second without answering: a keep-alive timeout that met a request
    on its way. ``connections`` gets the gateway's port of each connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(port_of(writer))
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(OK)
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            if reset:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return serve


async def on_one_upstream(pool, raw_upstream, gateway, serve) -> TrafficServer:
    """A gateway whose service ``web`` has one upstream, ``only``: a raw one, ``serve``."""
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "only", await raw_upstream(serve))
    gw: TrafficServer = await gateway()
    return gw


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_stale_connection_is_sent_again_on_a_new_one_to_the_same_upstream(
    pool, raw_upstream, gateway, client, recorder, reset
):
    connections: list[int] = []
    gw = await on_one_upstream(
        pool, raw_upstream, gateway, closing_on_the_second_request(connections, reset)
    )
    await warm(client, gw, recorder)

    async with client.get(url(gw, "/page")) as resp:
        status = resp.status
        await resp.read()

    assert status == 200  # nginx too (a cached connection's error is tried again); was 502
    assert len(set(connections)) == 2  # the kept connection, then a new one
    assert ways(gw) == (1, 1)  # sent by ``begin``; sent again by a task
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.upstream_id, record.error) == (200, "only", None)
    # Not a retry (``retries.attempts`` is untouched), but counted by its reason.
    assert (record.retries, record.retry_reasons) == (0, ("stale",))
    assert pool.service("web").inflight == {}


async def test_a_stale_connection_is_sent_again_once_only(pool, raw_upstream, gateway, client):
    """Every kept connection the gateway has is stale: the request is sent again on a new
    one, not on the next kept one, and only once."""
    connections: list[int] = []
    gw = await on_one_upstream(
        pool, raw_upstream, gateway, closing_on_the_second_request(connections)
    )

    # Two kept connections: two requests at once, each on its own.
    async def get(path: str) -> int:
        async with client.get(url(gw, path)) as resp:
            await resp.read()
            return resp.status

    assert await asyncio.gather(get("/a"), get("/b")) == [200, 200]
    assert gw.proxy.connector.idle_count() == 2
    assert [await get("/c"), await get("/d")] == [200, 200]
    assert len(set(connections)) == 4  # each stale one replaced by a new one


async def test_a_request_with_a_body_on_a_stale_connection_is_not_sent_again(
    pool, raw_upstream, gateway, client, recorder
):
    connections: list[int] = []
    gw = await on_one_upstream(
        pool, raw_upstream, gateway, closing_on_the_second_request(connections)
    )
    await warm(client, gw, recorder)

    async with client.post(url(gw, "/form"), data=b"x=1") as resp:
        status = resp.status
        body = await resp.json()

    assert (status, body["error"]) == (502, "upstream_connect_error")  # as nginx
    assert len(set(connections)) == 1
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.retries, record.retry_reasons) == (502, 0, ())


def upgrading_on_a_new_connection(connections: list[int]):
    """Answers a WebSocket upgrade that comes first on its connection (101, a text frame "hi",
    a close); a plain request with keep-alive, closing the connection unanswered on the next."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(port_of(writer))
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            key = re.search(rb"(?i)sec-websocket-key: *([^\r]+)", head)
            if key is None:
                writer.write(OK)
                await writer.drain()
                await reader.readuntil(b"\r\n\r\n")
                return  # the next request: closed unanswered
            digest = hashlib.sha1(key[1] + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n\x81\x02hi"
                b"\x88\x02\x03\xe8"  # then a close (1000): the client's own close waits not
                % base64.b64encode(digest)
            )
            await writer.drain()
            await reader.read()  # until the client's close
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return serve


async def test_a_websocket_upgrade_on_a_stale_connection_is_sent_again_on_a_new_one(
    pool, raw_upstream, gateway, client, recorder
):
    connections: list[int] = []
    gw = await on_one_upstream(
        pool, raw_upstream, gateway, upgrading_on_a_new_connection(connections)
    )
    await warm(client, gw, recorder)

    async with client.ws_connect(url(gw, "/socket")) as ws:
        message = await asyncio.wait_for(ws.receive(), 5)
    assert (message.type, message.data) == (aiohttp.WSMsgType.TEXT, "hi")  # was a 502
    assert len(set(connections)) == 2  # the kept connection, then a new one
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.upstream_id) == (101, "only")
    assert (record.retries, record.retry_reasons) == (0, ("stale",))


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_stale_connection_is_retried_on_another_upstream(
    pool, raw_upstream, upstream, gateway, client, recorder, reset
):
    second = asyncio.Event()
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin"))
    add(pool, "web", "stale", await raw_upstream(stale_upstream(second, reset)))
    gw = await gateway()
    await warm(client, gw, recorder)
    await upstream("web", "live")  # after the warm-up: only "stale" has an idle connection

    async with client.get(url(gw, "/page")) as resp:
        status = resp.status
        body = await resp.json()

    assert (status, body["upstream"]) == (200, "live")
    assert second.is_set()  # the stale connection did get the request
    # Sent by ``begin``; the failed attempt handed to a task (its reason is in the record).
    assert ways(gw) == (1, 1)
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.upstream_id, record.error) == (200, "live", None)
    # Sent again on a new connection to "stale", which closed that one too: then a retry.
    assert (record.retries, record.retry_reasons) == (1, ("stale", "disconnect"))
    assert pool.service("web").inflight == {}


async def test_an_upstream_that_closes_the_new_connection_too_is_502(
    pool, raw_upstream, gateway, client, recorder
):
    second = asyncio.Event()
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "stale", await raw_upstream(stale_upstream(second)))
    gw = await gateway()
    await warm(client, gw, recorder)

    async with client.get(url(gw, "/page")) as resp:
        status, headers = resp.status, resp.headers
        body = await resp.json()

    assert status == 502
    assert headers["Content-Type"].startswith("application/json")
    assert body["error"] == "upstream_connect_error"
    assert body["upstream"] == "stale"
    assert body["request_id"] == headers["X-Request-Id"]
    assert second.is_set()
    assert ways(gw) == (1, 1)  # sent by ``begin``; the failed attempt answered by a task
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.error, record.retries) == (502, "upstream_connect_error", 0)
    assert record.retry_reasons == ("stale",)
    assert record.request_id == headers["X-Request-Id"]
    assert pool.service("web").inflight == {}
    assert gw.proxy.connector.idle_count() == 0


# -- the client goes away ----------------------------------------------------------------------


def slow_upstream(started: asyncio.Event, closed: asyncio.Event):
    """``/warm`` is answered at once; ``/slow`` never: it waits for the gateway to close."""

    async def answer(path, reader, writer):
        if path == "/slow":
            started.set()
            await reader.read()  # b"" once the gateway dropped the connection
            closed.set()
            return False
        return await answer_ok(writer)

    return keepalive(answer)


async def in_flight_slow(gw, recorder, client, started):
    """A task-free GET /slow in flight on a raw client connection: (reader, writer)."""
    await warm(client, gw, recorder)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(b"GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
        async with asyncio.timeout(1):
            await started.wait()
        # While it waits for the answer, the exchange has no task.
        (conn,) = [c for c in gw._connections if c.active is not None]
        assert (conn.task, conn.exchange is not None) == (None, True)
        assert ways(gw) == (1, 0)
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def test_client_gone_cancels_the_exchange(pool, raw_upstream, gateway, client, recorder):
    started, closed = asyncio.Event(), asyncio.Event()
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "slow", await raw_upstream(slow_upstream(started, closed)))
    gw = await gateway()
    _, writer = await in_flight_slow(gw, recorder, client, started)
    writer.close()  # the client goes away while the upstream has not answered
    assert pool.service("web").inflight == {"slow": 1}

    async with asyncio.timeout(1):
        await closed.wait()  # the upstream connection was dropped, not kept idle
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.error, record.upstream_id) == (499, "cancelled", "slow")
    assert ways(gw) == (1, 0)  # cut off without ever going to a task
    assert pool.service("web").inflight == {}
    assert gw.proxy.connector.idle_count() == 0


# -- streaming answers ---------------------------------------------------------------------------

PIECE = 40 * 1024
PIECES = 5


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_streamed_answer_arrives_whole(
    pool, raw_upstream, gateway, client, recorder, framing
):
    more = asyncio.Event()
    pieces = [bytes([65 + i]) * PIECE for i in range(PIECES)]  # 200 KiB: spliced if framed
    came_on: list[tuple[str, int]] = []

    async def answer(path, reader, writer):
        came_on.append((path, port_of(writer)))
        if path == "/warm":
            return await answer_ok(writer)
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (PIECE * PIECES))
        for i, piece in enumerate(pieces):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
            await writer.drain()
            if i == 0:
                async with asyncio.timeout(1):
                    await more.wait()  # the client has the first piece: no single read
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "streamer", await raw_upstream(keepalive(answer)))
    gw = await gateway()
    await warm(client, gw, recorder)

    received = b""
    async with client.get(url(gw, "/stream")) as resp:
        assert resp.status == 200
        first = await resp.content.readexactly(PIECE)
        more.set()
        received = first + await resp.content.read()

    assert received == b"".join(pieces)
    # Task-free all along; and as the upstream held the rest of the body until the client had
    # its first piece, the body ended after the head was handled (``Exchange._streamed``).
    assert ways(gw) == (1, 0)
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.error, record.bytes_out) == (200, None, PIECE * PIECES)
    assert record.ttfb is not None
    assert record.ttfb <= record.duration
    assert pool.service("web").inflight == {}
    # The exchange ended cleanly: the connection is idle again and serves the next request.
    assert gw.proxy.connector.idle_count() == 1
    async with client.get(url(gw, "/warm")) as resp:
        assert await resp.read() == b"ok"
    assert ways(gw) == (2, 0)
    port = came_on[0][1]  # one connection, kept alive throughout
    assert came_on == [("/warm", port), ("/stream", port), ("/warm", port)]


@pytest.mark.parametrize(
    ("head", "sent"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", 100),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n", 200_000),  # spliced
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n", 100),
    ],
    ids=["content-length", "large-content-length", "chunked"],
)
async def test_broken_body_aborts_the_client(
    pool, raw_upstream, gateway, client, recorder, head, sent
):
    got_head = asyncio.Event()

    async def answer(path, reader, writer):
        if path == "/warm":
            return await answer_ok(writer)
        writer.write(head + b"x" * sent)
        await writer.drain()
        async with asyncio.timeout(1):
            await got_head.wait()  # the client is reading the body: it breaks off mid-way
        return False  # close

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "broken", await raw_upstream(keepalive(answer)))
    gw = await gateway()
    await warm(client, gw, recorder)

    async with client.get(url(gw, "/broken")) as resp:
        assert resp.status == 200
        got_head.set()
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()

    assert ways(gw) == (1, 0)
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.error) == (200, "upstream_protocol_error")
    assert record.bytes_out == sent
    assert pool.service("web").inflight == {}
    assert gw.proxy.connector.idle_count() == 0


# -- retry on status ---------------------------------------------------------------------------


async def test_503_on_a_reused_connection_is_retried_on_the_other_upstream(
    pool, raw_upstream, upstream, gateway, client, recorder
):
    dropped = asyncio.Event()

    async def busy(path, reader, writer):
        if path == "/warm":
            return await answer_ok(writer)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
        await writer.drain()
        await reader.read()  # b"" once the gateway dropped the connection
        dropped.set()
        return False

    retries = RetriesConfig(on_status=True)
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin", retries=retries))
    add(pool, "web", "busy", await raw_upstream(keepalive(busy)))
    gw = await gateway()
    await warm(client, gw, recorder)
    await upstream("web", "ok")  # after the warm-up: only "busy" has an idle connection

    async with client.get(url(gw, "/x")) as resp:
        status = resp.status
        body = await resp.json()

    assert (status, body["upstream"]) == (200, "ok")
    # Sent by ``begin``; the 503 handed to a task, which retried (the reason is in the record).
    assert ways(gw) == (1, 1)
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.upstream_id, record.error) == (200, "ok", None)
    assert (record.retries, record.retry_reasons) == (1, ("status",))
    assert pool.service("web").inflight == {}
    # The 503's connection was dropped (its body unread), the retry's kept.
    async with asyncio.timeout(1):
        await dropped.wait()
    assert gw.proxy.connector.idle_count() == 1


# -- round robin -----------------------------------------------------------------------------------


async def test_round_robin_stays_fair_when_only_one_upstream_has_idle_connections(
    pool, upstream, gateway, client, recorder
):
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin"))
    await upstream("web", "a")
    await upstream("web", "b", health=Health.UNKNOWN)
    gw = await gateway()
    await warm(client, gw, recorder)  # to "a": the only routable one
    pool.set_health("web", "b", Health.HEALTHY)

    served = []
    handed_on = []  # the requests ``begin`` handed to a task
    for i in range(20):
        before = gw.proxy.handed_on
        async with client.get(url(gw, f"/{i}")) as resp:
            served.append((await resp.json())["upstream"])
        await recorder.wait(i + 1)  # made once the request was no longer in flight
        assert pool.service("web").inflight == {}
        if gw.proxy.handed_on != before:
            handed_on.append(i)

    assert served.count("a") == 10
    assert served.count("b") == 10
    assert served[:2] == ["a", "b"]
    # Only b's first request had no idle connection and went to a task (to connect).
    assert handed_on == [1]
    assert ways(gw) == (19, 1)


# -- drain timeout ---------------------------------------------------------------------------------


async def test_drain_timeout_cuts_off_a_task_free_exchange(
    pool, raw_upstream, gateway, client, recorder
):
    started, closed = asyncio.Event(), asyncio.Event()
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "slow", await raw_upstream(slow_upstream(started, closed)))
    gw = await gateway()
    reader, writer = await in_flight_slow(gw, recorder, client, started)
    try:
        drained = pool.drain("web", "slow", timeout=0.05)
        async with asyncio.timeout(1):
            assert await read_until_closed(reader) == b""  # dropped without an answer
            await closed.wait()  # the upstream connection was dropped too
            await drained
    finally:
        writer.close()

    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.error, record.upstream_id) == (499, "cancelled", "slow")
    assert ways(gw) == (1, 0)  # cut off without ever going to a task
    assert pool.service("web").inflight == {}
    assert pool.service("web").leases == {}
    assert gw.proxy.connector.idle_count() == 0


async def test_drain_timeout_of_a_task_free_exchange_resolves_false(
    pool, raw_upstream, gateway, client, recorder, caplog
):
    started, closed = asyncio.Event(), asyncio.Event()
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "slow", await raw_upstream(slow_upstream(started, closed)))
    events = []
    pool.subscribe(type("Sub", (), {"on_pool_event": lambda self, e: events.append(e)})())
    gw = await gateway()
    _, writer = await in_flight_slow(gw, recorder, client, started)
    try:
        drained = pool.drain("web", "slow", timeout=0.05)
        async with asyncio.timeout(1):
            result = await drained
            await closed.wait()
    finally:
        writer.close()
    await asyncio.sleep(0)  # _drain_timeout's own callback has returned (or raised)

    # As documented in Pool.drain: False when the timeout cut something off.
    assert result is False
    (event,) = [e for e in events if e.kind == "drained"]
    assert (event.clean, event.reason) == (False, "drain timeout")
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def held_app(started: asyncio.Event, release: asyncio.Event) -> web.Application:
    """An upstream that holds its answer to /slow until ``release``; others at once."""

    async def slow(request):
        if request.path == "/slow":
            started.set()
            await release.wait()
        return web.Response(text="done")

    app = web.Application()
    app.router.add_get("/{tail:.*}", slow)
    return app


async def held_get(client, gw) -> tuple[int, str]:
    """GET /slow through the gateway (run as a task: ``held_app`` holds it)."""
    async with client.get(url(gw, "/slow")) as resp:
        return resp.status, await resp.text()


async def test_drain_waits_for_a_task_free_exchange(pool, upstream, gateway, client, recorder):
    started, release = asyncio.Event(), asyncio.Event()
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "a", held_app(started, release))
    gw = await gateway()
    await warm(client, gw, recorder)

    in_flight = asyncio.create_task(held_get(client, gw))
    async with asyncio.timeout(1):
        await started.wait()
    drained = pool.drain("web", "a", timeout=5)
    await asyncio.sleep(0)  # a turn of the loop: nothing would end the drain but the answer
    assert not drained.done()
    release.set()
    async with asyncio.timeout(1):
        assert await in_flight == (200, "done")
        assert await drained is True
    assert ways(gw) == (1, 0)


# -- requests that do not take the task-free path ----------------------------------------------


@pytest.mark.parametrize("kind", ["body", "upgrade", "total-timeout"])
async def test_other_requests_go_to_a_task_and_are_served(
    pool, upstream, gateway, client, recorder, kind
):
    timeouts = TimeoutsConfig(total=5) if kind == "total-timeout" else TimeoutsConfig()
    pool.set_service(routing("web", prefix="/", timeouts=timeouts))
    await upstream("web", "u1", ported(echo_app("u1")))
    gw = await gateway()
    warm_port = await warm(client, gw, recorder)
    assert warm_port is not None

    if kind == "body":
        async with client.post(url(gw, "/p"), data=b"12345") as resp:
            status, body, port = resp.status, await resp.json(), resp.headers["X-Peer-Port"]
        assert body["body"] == 5
    elif kind == "upgrade":
        answer = await raw_request(
            gw.port,
            b"GET /p HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n",
        )
        head, _, payload = answer.partition(b"\r\n\r\n")
        status, body = int(head.split(b" ", 2)[1]), json.loads(payload)
        (port,) = [
            line.split(b":", 1)[1].strip().decode()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"x-peer-port:")
        ]
    else:
        async with client.get(url(gw, "/p")) as resp:
            status, body, port = resp.status, await resp.json(), resp.headers["X-Peer-Port"]

    assert (status, body["upstream"]) == (200, "u1")
    # Not sent by ``begin``: served by a task (``begin`` declines a body or an upgrade itself,
    # and hands a request with a total timeout on).
    assert ways(gw) == (0, 1 if kind == "total-timeout" else 0)
    # The task reused the idle connection all the same.
    assert port == warm_port
    await recorder.wait()
    (record,) = recorder.records
    assert (record.status, record.upstream_id, record.error, record.retries) == (200, "u1", None, 0)
    assert pool.service("web").inflight == {}


# -- shutdown --------------------------------------------------------------------------------------


async def test_stop_lets_a_task_free_exchange_finish(pool, upstream, gateway, client, recorder):
    started, release = asyncio.Event(), asyncio.Event()
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", held_app(started, release))
    gw = await gateway(shutdown_timeout=5)
    await warm(client, gw, recorder)

    in_flight = asyncio.create_task(held_get(client, gw))
    async with asyncio.timeout(1):
        await started.wait()
    assert ways(gw) == (1, 0)
    stopping = asyncio.create_task(gw.stop())
    await asyncio.sleep(0)  # a turn of the loop: ``stop`` waits for the request in flight
    try:
        # As for a request with a task (test_server.py): it is waited for ...
        assert not in_flight.done()
        assert not stopping.done()
        release.set()
        async with asyncio.timeout(1):
            assert await in_flight == (200, "done")
    finally:
        release.set()
        async with asyncio.timeout(2):
            await stopping
            await asyncio.gather(in_flight, return_exceptions=True)


async def test_stop_records_and_releases_a_task_free_exchange_it_cuts_off(
    pool, raw_upstream, gateway, client, recorder, caplog
):
    started, closed = asyncio.Event(), asyncio.Event()
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "slow", await raw_upstream(slow_upstream(started, closed)))
    gw = await gateway(shutdown_timeout=0.05)
    reader, writer = await in_flight_slow(gw, recorder, client, started)
    try:
        async with asyncio.timeout(1):
            await gw.stop()
            assert await read_until_closed(reader) == b""
            await closed.wait()
    finally:
        writer.close()

    (record,) = await recorder.wait()  # made once the request was no longer in flight
    assert pool.service("web").inflight == {}
    assert (record.status, record.error) == (499, "cancelled")
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
