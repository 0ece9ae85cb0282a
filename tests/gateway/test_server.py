"""The traffic listener: catch-all app, shutdown order, header timeout, limits."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import socket
from collections.abc import Coroutine

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from gateway.config import ListenerLimits, ProxyConfig, parse_settings
from gateway.listening import listening_socket
from gateway.proxy.handler import Proxy
from gateway.server import TrafficServer
from tests.support.raw_servers import closed_by_peer

from .conftest import raw_request, routing, url
from .test_prober import ipv6_loopback


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response with a Content-Length from a kept-alive raw connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


async def test_every_method_and_path_reaches_the_proxy(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway()

    for method in ("GET", "POST", "PATCH", "DELETE", "OPTIONS", "PROPFIND"):
        async with client.request(method, url(gw, "/a/b/c?d=e")) as resp:
            body = await resp.json()
        assert (resp.status, body["method"], body["path"]) == (200, method, "/a/b/c?d=e")


async def test_both_legs_share_one_set_of_read_buffers_made_on_use(pool, upstream, gateway, client):
    """The client connections read into the connector's buffers (``splice.Buffers``), and
    small requests and answers make none: uvloop reads those into its own buffer."""
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway()
    for _ in range(3):
        async with client.get(url(gw, "/small")) as resp:
            assert resp.status == 200
    assert gw._gate is not None
    buffers = gw.proxy.connector.buffers
    assert gw._gate.buffers is buffers
    assert buffers._scratch is None


async def test_stop_lets_in_flight_requests_finish(pool, upstream, gateway, client):
    started, release = asyncio.Event(), asyncio.Event()
    upstream_closed = asyncio.get_running_loop().create_future()

    async def slow(request):
        started.set()
        await release.wait()
        return web.Response(text="done")

    async def ws_echo(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_str(msg.data)
        upstream_closed.set_result(ws.close_code)
        return ws

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/ws", ws_echo)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", app)
    gw = await gateway(shutdown_timeout=10)

    async def fetch():
        async with client.get(url(gw, "/slow")) as resp:
            return resp.status, await resp.text()

    in_flight = asyncio.create_task(fetch())
    await started.wait()
    async with client.ws_connect(url(gw, "/ws")) as ws, asyncio.timeout(5):
        stopping = asyncio.create_task(gw.stop())
        # Shutdown closes relayed WebSockets with 1001 once the listener is closed ...
        msg = await ws.receive()
        assert (msg.type, msg.data) == (WSMsgType.CLOSE, 1001)
        assert await upstream_closed == 1001
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", gw.port)
        # ... and waits for the request in flight.
        assert not in_flight.done()
        assert not stopping.done()
        release.set()
        assert await in_flight == (200, "done")
        await stopping


@pytest.mark.parametrize("turns", range(5))
async def test_a_connection_accepted_as_the_listener_stops_is_closed(gateway, turns):
    """asyncio's loop makes an accepted connection's transport a turn after the accept, and
    its ``connection_made`` a turn later: a server closed in between left the socket open
    for good (CPython gh-109564), one made after ``stop`` closed the others was never
    closed. ``turns``: the loop's turns between the connect and the stop (2 and 3 left it
    open on Python 3.11)."""
    gw = await gateway()
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        for _ in range(turns):
            await asyncio.sleep(0)
        await gw.stop()
        assert await closed_by_peer(sock)


async def test_stop_cancels_what_outlives_the_shutdown_timeout(pool, upstream, gateway, client):
    started, cancelled, never = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def stuck(request):
        started.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response()

    app = web.Application()
    app.router.add_get("/", stuck)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", app)
    gw = await gateway(shutdown_timeout=0.2)

    in_flight = asyncio.create_task(client.get(url(gw)))
    await started.wait()
    async with asyncio.timeout(5):
        await gw.stop()
        with pytest.raises(aiohttp.ClientError):
            await in_flight
        # The gateway's upstream request was cancelled too: its connection is gone.
        await cancelled.wait()


async def test_header_timeout_disconnects_a_slow_client(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway(limits=ListenerLimits(header_timeout=0.3))
    loop = asyncio.get_running_loop()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        opened = loop.time()
        writer.write(b"GET / HTTP/1.1\r\nHost: slow.example\r\nX-Drip: ")
        await writer.drain()
        # A normal client is served meanwhile.
        async with client.get(url(gw)) as resp:
            assert resp.status == 200
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        # (uvloop's clock has millisecond steps; the timer starts on the gateway's side)
        assert loop.time() - opened >= 0.25
    finally:
        writer.close()


async def test_header_timeout_applies_to_each_request_of_a_connection(pool, upstream, gateway):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway(limits=ListenerLimits(header_timeout=0.3))

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        async with asyncio.timeout(5):
            writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
            head, _ = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200")
        # Idle between requests is the keep-alive timeout's business, not the header's.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.5)
        async with asyncio.timeout(5):
            writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
            head, _ = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200")
            writer.write(b"GET / HTTP/1.1\r\n")  # and never the rest
            assert await reader.read() == b""
    finally:
        writer.close()


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "two-reads"])
async def test_keepalive_timeout_closes_after_an_answer_the_gateway_gave_itself(
    pool, gateway, split
):
    """A 404 is answered from the parser's callback, before the request's end was read: the
    idle connection that follows is timed all the same, whether the head came in one read
    or in two."""
    gw = await gateway(limits=ListenerLimits(keepalive_timeout=0.3))
    loop = asyncio.get_running_loop()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        async with asyncio.timeout(5):
            head = b"GET /nowhere HTTP/1.1\r\nHost: h\r\n\r\n"
            if split:
                writer.write(head[:10])
                await writer.drain()
                await asyncio.sleep(0.05)  # the rest in a read of its own
                head = head[10:]
            writer.write(head)
            answer, _ = await read_response(reader)
            assert answer.startswith(b"HTTP/1.1 404")
            idle = loop.time()
            assert await reader.read() == b""
        assert loop.time() - idle >= 0.25
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("request_head", "status", "code"),
    [
        (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: h\r\n\r\n", 414, "uri_too_long"),
        (b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"b" * 5000 + b"\r\n\r\n", 431, None),
        (b"GET / HTTP/1.1\r\nHost: h\r\nX-" + b"n" * 5000 + b": 1\r\n\r\n", 431, None),
        (
            b"GET / HTTP/1.1\r\nHost: h\r\n"
            + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
            + b"\r\n",
            431,
            None,
        ),
        (b"GET / HTTP/1.1\r\nHost h\r\n\r\n", 400, "bad_request"),
    ],
    ids=["long-uri", "long-value", "long-name", "many-headers", "malformed"],
)
async def test_bad_request_heads_get_json_errors(pool, gateway, request_head, status, code):
    gw = await gateway(limits=ListenerLimits(max_header_size=4096))

    answer = await raw_request(gw.port, request_head)

    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"%d" % status
    assert json.loads(body)["error"] == (code or "header_too_large")


async def test_connections_beyond_the_limit_are_refused(pool, upstream, gateway):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway(limits=ListenerLimits(max_connections=2))

    first = await asyncio.open_connection("127.0.0.1", gw.port)
    second = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        answer = await raw_request(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503")
        assert b"too_many_connections" in answer
        # The connections within the limit are served.
        reader, writer = first
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        async with asyncio.timeout(5):
            head, _ = await read_response(reader)
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        first[1].close()
        second[1].close()


async def test_port_is_the_bound_one(gateway):
    gw = await gateway()
    assert gw.port > 0
    assert f"port={gw.port}" in repr(gw)


def test_an_ip_address_is_bound_by_a_socket_of_ours_a_name_is_left_to_create_server():
    """uvloop's ``create_server`` looks up even an IP address in libuv's thread pool (four
    threads for one lookup): the listener binds an address itself, as it would."""
    sock = listening_socket("127.0.0.1", 0, reuse_port=True)
    assert sock is not None
    with sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert not sock.getblocking()
        with socket.create_connection(sock.getsockname(), timeout=5):
            pass
    sock = listening_socket("127.0.0.1", 0, reuse_port=False)
    assert sock is not None
    with sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
    assert listening_socket("localhost", 0, reuse_port=False) is None


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_an_ipv6_listener_takes_only_ipv6():
    sock = listening_socket("::1", 0, reuse_port=False)
    assert sock is not None
    with sock:
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1


def test_a_taken_port_is_refused_in_create_servers_words_and_nothing_is_left_open():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError, match="address already in use") as refused:
            listening_socket("127.0.0.1", port, reuse_port=False)
        assert refused.value.errno == errno.EADDRINUSE
        assert str(refused.value) == (
            f"[Errno {errno.EADDRINUSE}] error while attempting to bind on address "
            f"('127.0.0.1', {port}): address already in use"
        )
        assert len(os.listdir("/proc/self/fd")) == before


async def test_bind_holds_the_port_and_start_serves_what_queued_meanwhile(pool, upstream, recorder):
    """``bind`` takes the port before ``start`` (the composition root binds before it touches
    any state): another bind fails, a client's connection waits in the backlog and is
    answered once serving starts; ``stop`` releases a port never served too."""
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    settings = parse_settings(ProxyConfig, {"listen": "127.0.0.1:0"})
    server = TrafficServer(Proxy(pool, settings, [recorder]), settings)
    server.bind()
    port = server.port
    with pytest.raises(OSError, match="address already in use"):
        listening_socket("127.0.0.1", port, reuse_port=False)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
    try:
        await server.start()
        assert server.port == port
        head, _ = await asyncio.wait_for(read_response(reader), 5)
        assert head.startswith(b"HTTP/1.1 200"), head
    finally:
        writer.close()
        await server.stop()
    listening_socket("127.0.0.1", port, reuse_port=False).close()  # released

    never = TrafficServer(Proxy(pool, settings, [recorder]), settings)
    never.bind()
    port = never.port
    await never.stop()
    listening_socket("127.0.0.1", port, reuse_port=False).close()


async def test_a_finished_request_leaves_no_cyclic_garbage(pool, upstream, gateway, client):
    """What a request makes is freed by reference counting when it ends, not by the cyclic
    collector: a cycle per request (a lease that held a bound method of itself did) made
    the collector run every ~100 requests and cost about 5 us of CPU per request."""
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "a")
    server = await gateway()
    for _ in range(5):  # warm: connections made, caches filled
        async with client.get(url(server)) as response:
            await response.read()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(50):
            async with client.get(url(server)) as response:
                assert response.status == 200
                await response.read()
        gc.collect()
        kinds = {type(o).__qualname__ for o in gc.garbage}
        coroutines = {o.__qualname__ for o in gc.garbage if isinstance(o, Coroutine)}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not kinds & {"Lease", "IncomingRequest", "Exchange", "RequestBody", "ResponseHead"}
    assert not {c for c in coroutines if c.startswith(("Proxy.", "ClientConnection."))}
