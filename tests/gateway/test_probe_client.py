"""The HTTP probe's client (``gateway.health.probe_client``): the request it writes, and what it
makes of answers from real aiohttp servers and of raw, scripted ones on loopback.

A scripted server reads the request head, writes its answer and then holds the connection
until the client goes, so a test can await the client's close instead of sleeping.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from gateway.health import probe_client
from gateway.health.probe_client import (
    HEAD_LIMIT,
    ProbeConnectionClosed,
    ProbeError,
    ProbeInvalidResponse,
    ProbeRequestInvalid,
    request_head,
)
from tests.support.raw_servers import RawServers


class Script:
    """A raw upstream: it reads the request head, writes ``answer``, then does ``then``:
    ``hold`` the connection until the client closes it, ``close`` it, or ``reset`` it."""

    def __init__(self, answer: bytes = b"", then: str = "hold") -> None:
        self.answer = answer
        self.then = then
        self.requests: list[bytes] = []
        self.asked = asyncio.Event()
        """A request head was read."""
        self.gone = asyncio.Event()
        """The client closed the connection (EOF or reset) while it was held."""

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.requests.append(await reader.readuntil(b"\r\n\r\n"))
            self.asked.set()
            writer.write(self.answer)
            await writer.drain()
            if self.then == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if self.then != "hold":
                return
            while await reader.read(65536):
                pass
            self.gone.set()
        except ConnectionError:
            self.gone.set()
        finally:
            writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[..., Awaitable[tuple[Script, int]]]]:
    """``await scripted(answer, then)``: a ``Script`` listening on loopback, and its port."""
    servers = RawServers()

    async def start(answer: bytes = b"", then: str = "hold") -> tuple[Script, int]:
        script = Script(answer, then)
        server = await servers.start(script)
        port: int = server.sockets[0].getsockname()[1]
        return script, port

    yield start
    await servers.close()


@pytest.fixture(autouse=True)
def short_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    """An upstream here that holds its connection is let go of soon after its status."""
    monkeypatch.setattr(probe_client, "LINGER_SECONDS", 0.2)


async def get(port: int, path: str = "/health", method: str = "GET", **headers: str) -> int:
    return await probe_client.status(
        "127.0.0.1", port, method, path, headers, authority=f"127.0.0.1:{port}"
    )


async def gone(script: Script) -> None:
    """The client closed the connection (a bound on a hang, not a pace)."""
    async with asyncio.timeout(5):
        await script.gone.wait()


# -- the request ---------------------------------------------------------------------------


def test_a_plain_get():
    assert request_head("GET", "/health?full=1", "10.0.0.1:8080", {}) == (
        b"GET /health?full=1 HTTP/1.1\r\n"
        b"Host: 10.0.0.1:8080\r\n"
        b"User-Agent: gateway-prober\r\n"
        b"Connection: close\r\n\r\n"
    )


def test_the_probes_headers_and_its_own_host_and_user_agent():
    head = request_head(
        "OPTIONS", "/", "[::1]:80", {"hOsT": "svc.test", "user-agent": "me", "X-A": "1"}
    )
    assert head == (
        b"OPTIONS / HTTP/1.1\r\n"
        b"hOsT: svc.test\r\n"
        b"user-agent: me\r\n"
        b"X-A: 1\r\n"
        b"Content-Length: 0\r\n"  # neither GET nor HEAD
        b"Connection: close\r\n\r\n"
    )


def test_framing_and_connection_headers_are_the_clients_own():
    head = request_head(
        "HEAD",
        "/",
        "h:1",
        {"Connection": "keep-alive", "Transfer-Encoding": "chunked", "Content-Length": "5"},
    )
    assert head == b"HEAD / HTTP/1.1\r\nHost: h:1\r\nUser-Agent: gateway-prober\r\n" + (
        b"Connection: close\r\n\r\n"
    )


def test_a_path_beyond_ascii_is_percent_encoded():
    head = request_head("GET", "/sant\u00e9?q=%20", "h:1", {"X-Name": "caf\u00e9"})
    assert head.startswith(b"GET /sant%C3%A9?q=%20 HTTP/1.1\r\n")
    assert b"X-Name: caf\xc3\xa9\r\n" in head


@pytest.mark.parametrize(
    ("method", "path", "authority", "headers"),
    [
        ("GET", "/a\r\nX-Injected: 1", "h:1", {}),
        ("GET", "/a\nb", "h:1", {}),
        ("GET", "/a b", "h:1", {}),
        ("GET", "health", "h:1", {}),
        ("GET", "/", "h:1", {"X-A": "1\r\nX-Injected: 1"}),
        ("GET", "/", "h:1", {"X-A": "1\n"}),
        ("GET", "/", "h:1", {"X-A": "\r"}),
        ("GET", "/", "h:1", {"X-A": "\0"}),
        ("GET", "/", "h:1", {"X-A\r\nX-B": "1"}),
        ("GET", "/", "h:1", {"X A": "1"}),
        ("GET", "/", "h:1", {"Host": "h\r\nX-B: 1"}),
        ("GET", "/", "h:1\r\nX-B: 1", {}),
        ("GET /x HTTP/1.0\r\n", "/", "h:1", {}),
    ],
)
def test_a_part_that_would_leave_its_line_is_refused(method, path, authority, headers):
    with pytest.raises(ProbeRequestInvalid):
        request_head(method, path, authority, headers)


async def test_a_refused_request_opens_no_connection(scripted):
    script, port = await scripted(b"HTTP/1.1 200 OK\r\n\r\n", then="close")
    with pytest.raises(ProbeRequestInvalid, match="X-A"):
        await get(port, **{"X-A": "1\r\nX-Injected: 1"})
    assert await get(port) == 200  # the first connection the server saw
    assert len(script.requests) == 1
    assert b"Injected" not in script.requests[0]


# -- against aiohttp servers ---------------------------------------------------------------


@pytest.fixture
async def seen(aiohttp_server) -> tuple[list[web.Request], int]:
    """An aiohttp server that records each request and answers /health 204, /redirect 302."""
    requests: list[web.Request] = []

    async def health(request: web.Request) -> web.Response:
        requests.append(request)
        return web.Response(status=204)

    async def redirect(request: web.Request) -> web.Response:
        requests.append(request)
        raise web.HTTPFound("/health")

    app = web.Application()
    app.router.add_route("*", "/health", health)
    app.router.add_get("/redirect", redirect)
    server = await aiohttp_server(app)
    return requests, server.port


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
async def test_method_headers_and_host_arrive(seen, method):
    requests, port = seen
    assert await get(port, method=method, **{"X-Probe": "yes"}) == 204
    [request] = requests
    assert request.method == method
    assert request.headers["X-Probe"] == "yes"
    assert request.host == f"127.0.0.1:{port}"
    assert request.headers["User-Agent"] == "gateway-prober"
    assert not request.keep_alive


async def test_a_host_header_replaces_the_address(seen):
    requests, port = seen
    assert await get(port, host="svc.example") == 204
    assert requests[0].host == "svc.example"
    assert len(requests[0].headers.getall("Host")) == 1


async def test_a_redirect_is_the_status_not_followed(seen):
    requests, port = seen
    assert await get(port, path="/redirect") == 302
    assert [r.path for r in requests] == ["/redirect"]


# -- against scripted servers --------------------------------------------------------------


async def test_the_status_comes_from_the_head_and_the_body_is_not_waited_for(scripted):
    script, port = await scripted(b"HTTP/1.1 503 Busy\r\nContent-Length: 100\r\n\r\nsome")
    assert await get(port) == 503
    await gone(script)


async def writer_of(
    body_chunks: int | None, go: asyncio.Event | None = None
) -> tuple[asyncio.Server, int, asyncio.Future[str]]:
    """An upstream that answers 200, waits for ``go`` if given, then writes 64 KiB chunks of
    body, each drained (``body_chunks`` of them, then closes; None: forever). Its future: how
    it ended."""
    ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            length = "" if body_chunks is None else f"Content-Length: {body_chunks * 65536}\r\n"
            writer.write(f"HTTP/1.1 200 OK\r\n{length}\r\n".encode())
            await writer.drain()
            if go is not None:
                await go.wait()
            sent = 0
            while body_chunks is None or sent < body_chunks:
                writer.write(b"x" * 65536)
                await writer.drain()
                sent += 1
            ended.set_result("wrote it all")
        except ConnectionError as e:
            ended.set_result(type(e).__name__)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], ended


async def test_the_body_is_read_to_its_end_so_the_upstream_is_never_reset():
    # An upstream still writing its body when the client had its status: a reset would be a
    # BrokenPipeError in its log at every probe (python -m http.server's, for one).
    go = asyncio.Event()
    server, port, ended = await writer_of(8, go)
    try:
        assert await get(port) == 200
        go.set()  # the body comes after the client has its status
        async with asyncio.timeout(5):
            assert await ended == "wrote it all"
    finally:
        server.close()


async def test_an_endless_body_is_cut_off(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(probe_client, "LINGER_BYTES", 256 * 1024)
    monkeypatch.setattr(probe_client, "LINGER_SECONDS", 30)
    server, port, ended = await writer_of(None)
    try:
        assert await get(port) == 200
        async with asyncio.timeout(5):
            assert await ended in ("ConnectionResetError", "BrokenPipeError")
    finally:
        server.close()


async def test_a_head_answer_does_not_wait_for_its_content_length(scripted):
    script, port = await scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    assert await get(port, method="HEAD") == 200
    assert script.requests[0].startswith(b"HEAD /health HTTP/1.1\r\n")
    await gone(script)


async def test_interim_answers_are_skipped(scripted):
    script, port = await scripted(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 204 No Content\r\n\r\n"
    )
    assert await get(port) == 204
    await gone(script)


async def test_closed_before_any_answer(scripted):
    _, port = await scripted(then="close")
    with pytest.raises(ProbeConnectionClosed, match="before any response"):
        await get(port)


async def test_closed_in_the_middle_of_the_head(scripted):
    _, port = await scripted(b"HTTP/1.1 200 OK\r\nContent-", then="close")
    with pytest.raises(ProbeConnectionClosed, match="middle of the response head"):
        await get(port)


async def test_a_reset_is_the_connections_own_error(scripted):
    _, port = await scripted(then="reset")
    with pytest.raises(ConnectionResetError):
        await get(port)


async def test_garbage_instead_of_http(scripted):
    script, port = await scripted(b"SSH-2.0-OpenSSH_9.6\r\n")
    with pytest.raises(ProbeInvalidResponse, match="HttpParser"):
        await get(port)
    await gone(script)


async def test_an_endless_head_is_a_broken_answer(scripted):
    script, port = await scripted(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * HEAD_LIMIT)
    with pytest.raises(ProbeInvalidResponse, match="longer than"):
        await get(port)
    await gone(script)


async def test_a_closed_port_is_the_connects_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        await get(port)


async def test_the_connection_is_closed_when_the_callers_timeout_fires(scripted):
    script, port = await scripted()  # reads the request, never answers
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await get(port)
    await gone(script)


async def test_the_connection_is_closed_when_the_probe_is_cancelled(scripted):
    script, port = await scripted()
    task = asyncio.create_task(get(port))
    async with asyncio.timeout(5):
        await script.asked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gone(script)


def test_every_failure_of_an_exchange_is_caught_as_probe_error_or_oserror():
    for error in (ProbeConnectionClosed, ProbeInvalidResponse, ProbeRequestInvalid):
        assert issubclass(error, ProbeError)
    assert issubclass(ProbeConnectionClosed, OSError)
