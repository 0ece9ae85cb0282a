"""The admin listener's HTTP/1.1 (``controller.admin.server``) on real sockets: requests in
order, the limits of a head and a body, ``100 Continue`` only for a body read, timeouts, a
client that goes away, and shutdown. And the route table (``controller.admin.routes``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.admin import server as server_module
from controller.admin import web
from controller.admin.app import http_error_response
from controller.admin.routes import Router
from controller.admin.server import AdminListener

Echo = dict[str, Any]


class Harness:
    def __init__(self, listener: AdminListener) -> None:
        self.listener = listener
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.large = 0

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.listener.port)

    async def exchange(self, raw: bytes) -> bytes:
        """Send ``raw``; everything the server sends until it closes the connection."""
        reader, writer = await self.connect()
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
        await closed(writer)
        return data


async def closed(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def answers(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Each answer of a byte stream of Content-Length answers: status, fields, body."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        size = int(fields.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), fields, data[:size]))
        data = data[size:]
    return out


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    router = Router()
    app = web.App(router, [])
    app.max_body = 1000
    app.refusal = http_error_response
    h: Harness

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {"method": request.method, "path": request.path, "query": request.query,
             "match": request.match_info, "body": body.decode(), "type": request.content_type}
        )  # fmt: skip

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"refused": True}, status=401)

    async def slow(request: web.Request) -> web.Response:
        h.started.set()
        try:
            await h.release.wait()
        except asyncio.CancelledError:
            h.cancelled.set()
            raise
        return web.json_response({"slow": True})

    async def stream(request: web.Request) -> web.Response:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        h.started.set()
        await h.release.wait()
        await response.write(b"data: 2\n\n")
        return response

    async def broken(request: web.Request) -> web.Response:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"part")
        raise RuntimeError("the handler failed mid-stream")

    async def large(request: web.Request) -> web.Response:
        h.large += 1
        return web.Response(body=b"x" * 1024 * 1024)

    async def unsafe(request: web.Request) -> web.Response:
        return web.Response(body=b"x", headers={"X-Bad": "a\r\nSet-Cookie: evil=1"})

    router.add_route("POST", "/echo/{name}", echo)
    router.add_route("GET", "/echo/{name}", echo)
    router.add_route("POST", "/refuse", refuse)
    router.add_route("GET", "/slow", slow)
    router.add_route("GET", "/stream", stream)
    router.add_route("GET", "/unsafe", unsafe)
    router.add_route("GET", "/broken", broken)
    router.add_route("GET", "/large", large)
    listener = AdminListener(app, "127.0.0.1", 0)
    await listener.start()
    h = Harness(listener)
    app.on_shutdown.append(lambda app: _release(h))
    yield h
    await listener.stop(grace=1)


async def _release(h: Harness) -> None:
    h.release.set()


async def test_pipelined_requests_are_answered_in_order(harness: Harness) -> None:
    raw = (
        b"GET /echo/a?x=1&y=a+b HTTP/1.1\r\nHost: t\r\n\r\n"
        b"POST /echo/b%2Fc HTTP/1.1\r\nHost: t\r\nContent-Type: Application/JSON; q=1\r\n"
        b"Content-Length: 2\r\n\r\n{}"
        b"GET /echo/c HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    got = answers(await harness.exchange(raw))
    assert [status for status, _, _ in got] == [200, 200, 200]
    first, second, third = (json.loads(body) for _, _, body in got)
    assert first["query"] == {"x": "1", "y": "a b"}
    assert second["match"] == {"name": "b/c"}  # %2F stays inside its segment
    assert (second["body"], second["type"]) == ("{}", "application/json")
    assert third["path"] == "/echo/c"
    assert got[2][1]["connection"] == "close"
    assert "date" in got[0][1]


async def test_no_route_is_404_and_another_method_405_with_allow(harness: Harness) -> None:
    got = answers(
        await harness.exchange(
            b"GET /nothing HTTP/1.1\r\nHost: t\r\n\r\n"
            b"DELETE /echo/a HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        )
    )
    assert got[0][0] == 404
    assert json.loads(got[0][2]) == {"error": "not_found", "message": "no route GET /nothing"}
    assert got[1][0] == 405
    assert got[1][1]["allow"] == "GET, POST"
    assert json.loads(got[1][2])["error"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: t\r\nX: " + b"a" * 40_000 + b"\r\n\r\n", 431,
         "request_header_fields_too_large"),
        (b"GET / HTTP/1.1\r\nHost: t\r\n" + b"X: a\r\n" * 101 + b"\r\n", 431,
         "request_header_fields_too_large"),
        (b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400,
         "bad_request"),
        (b"GET / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
         400, "bad_request"),
        (b"G\x00T / HTTP/1.1\r\n\r\n", 400, "bad_request"),
        (b"POST /echo/a HTTP/1.1\r\nHost: t\r\nExpect: 200-ok\r\nContent-Length: 1\r\n\r\nx",
         417, "expectation_failed"),
    ],
)  # fmt: skip
async def test_a_hostile_head_is_refused_and_the_connection_closed(
    harness: Harness, raw: bytes, status: int, code: str
) -> None:
    [(got, _, body)] = answers(await harness.exchange(raw))
    assert got == status
    assert json.loads(body)["error"] == code


async def test_a_body_over_the_limit_is_413_and_never_continued(harness: Harness) -> None:
    declared = await harness.exchange(
        b"POST /echo/a HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 1001\r\n\r\n"
    )
    assert b"100 Continue" not in declared
    [(status, fields, body)] = answers(declared)
    assert (status, fields["connection"]) == (413, "close")
    assert json.loads(body)["error"] == "payload_too_large"
    chunked = await harness.exchange(
        b"POST /echo/a HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"1f4\r\n" + b"a" * 500 + b"\r\n") * 2
        + b"1\r\nb\r\n0\r\n\r\n"
    )
    assert answers(chunked)[0][0] == 413


async def test_continue_is_sent_only_when_the_handler_reads_the_body(harness: Harness) -> None:
    reader, writer = await harness.connect()
    writer.write(
        b"POST /refuse HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    )
    # Refused before reading: no 100, and the connection ends (the body never came).
    data = await asyncio.wait_for(reader.read(), 5)
    assert data.startswith(b"HTTP/1.1 401 ")
    await closed(writer)
    reader, writer = await harness.connect()
    writer.write(
        b"POST /echo/a HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    )
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(b"hello")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ")
    await closed(writer)


async def test_a_slow_request_is_408(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "READ_TIMEOUT", 0.05)
    slow_head = await harness.exchange(b"GET /echo/a HTTP/1.1\r\nHost: t\r\n")
    [(status, _, body)] = answers(slow_head)
    assert (status, json.loads(body)["error"]) == (408, "request_timeout")
    slow_body = await harness.exchange(
        b"POST /echo/a HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc"
    )
    assert answers(slow_body)[0][0] == 408


async def test_an_idle_kept_connection_is_closed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "IDLE_TIMEOUT", 0.05)
    reader, writer = await harness.connect()
    writer.write(b"GET /echo/a HTTP/1.1\r\nHost: t\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)  # the answer, then the close
    assert answers(data)[0][0] == 200
    await closed(writer)


async def test_http_1_0_and_head(harness: Harness) -> None:
    [(status, fields, _)] = answers(await harness.exchange(b"GET /echo/a HTTP/1.0\r\n\r\n"))
    assert (status, fields["connection"]) == (200, "close")
    kept = answers(
        await harness.exchange(
            b"GET /echo/a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /echo/b HTTP/1.0\r\n\r\n"
        )
    )
    assert [(s, f["connection"]) for s, f, _ in kept] == [(200, "keep-alive"), (200, "close")]
    data = await harness.exchange(b"HEAD /echo/a HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert data.endswith(b"\r\n\r\n")  # a head, with no body after it
    assert data.startswith(b"HTTP/1.1 405 ")


async def test_a_client_that_pipelines_and_never_reads_holds_one_answer(
    harness: Harness,
) -> None:
    _, writer = await harness.connect()
    writer.write(b"GET /large HTTP/1.1\r\nHost: t\r\n\r\n" * 50)
    [conn] = harness.listener.connections
    while not conn._paused_writing:  # the first answer fills the socket's buffers
        await asyncio.sleep(0)
    for _ in range(100):
        await asyncio.sleep(0)
    assert harness.large < 10  # what the sockets hold, not 50 MiB for a client that reads nothing
    await closed(writer)


async def test_a_client_that_goes_away_cancels_its_handler(harness: Harness) -> None:
    _, writer = await harness.connect()
    writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
    await harness.started.wait()
    await closed(writer)
    await asyncio.wait_for(harness.cancelled.wait(), 5)


async def test_an_answer_with_an_unsafe_field_is_never_sent(harness: Harness) -> None:
    [(status, _, body)] = answers(
        await harness.exchange(b"GET /unsafe HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    )
    assert status == 500
    assert b"evil" not in body


async def test_a_stream_whose_handler_fails_is_cut_short(harness: Harness) -> None:
    data = await harness.exchange(b"GET /broken HTTP/1.1\r\nHost: t\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 ")
    assert data.endswith(b"\r\n\r\n4\r\npart\r\n")  # no last chunk: the client sees a cut
    assert b"500" not in data


async def test_stop_ends_streams_and_waits_for_answers(harness: Harness) -> None:
    reader, writer = await harness.connect()
    writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
    await harness.started.wait()
    idle_reader, idle_writer = await harness.connect()
    await harness.listener.stop(grace=5)
    data = await asyncio.wait_for(reader.read(), 5)
    assert b"Transfer-Encoding: chunked" in data
    assert data.endswith(b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")
    assert await asyncio.wait_for(idle_reader.read(), 5) == b""
    assert not harness.listener.connections
    for w in (writer, idle_writer):
        await closed(w)
    with pytest.raises(ConnectionRefusedError):
        await harness.connect()


def test_the_route_table_refuses_ambiguous_and_malformed_templates() -> None:
    router = Router()

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    router.add_route("GET", "/a/{name}", handler)
    with pytest.raises(ValueError, match="two routes"):
        router.add_route("GET", "/a/{other}", handler)
    with pytest.raises(ValueError, match="whole segment"):
        router.add_route("GET", "/a/x{name}", handler)
    with pytest.raises(ValueError, match="starts with"):
        router.add_route("GET", "a", handler)
    assert router.resolve("GET", "/a/b%20c")[1] == {"name": "b c"}
    for path in ("/a/", "/a", "/a/b/c", "//a/b"):
        with pytest.raises(web.HTTPError) as error:
            router.resolve("GET", path)
        assert error.value.status == 404


# -- raw bytes ----------------------------------------------------------------------------------

_METHODS = st.sampled_from(
    [b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"CONNECT", b"get", b"G T"]
)
_TARGETS = st.sampled_from(
    [b"/echo/a", b"/echo/%2F%00", b"*", b"http://h/echo/b?x=1", b"/echo/", b"//", b"/a b", b""]
)
_VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b"HTP/1.1"])
_FIELDS = st.sampled_from(
    [b"Host: t", b"Content-Length: 3", b"Content-Length: -1", b"Content-Length: 99999999999",
     b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked", b"Expect: 100-continue",
     b"Connection: close", b"Connection: keep-alive, Upgrade", b"Upgrade: websocket",
     b"X: a\x00b", b" folded", b"NoColon", b": empty", b"X:\xff\xfe"]
)  # fmt: skip
_EOL = st.sampled_from([b"\r\n", b"\n", b"\r"])


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    eol = draw(_EOL)
    line = b" ".join([draw(_METHODS), draw(_TARGETS), draw(_VERSIONS)])
    fields = draw(st.lists(_FIELDS, max_size=5))
    body = draw(st.binary(max_size=40))
    raw = eol.join([line, *fields]) + eol + eol + body
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw * draw(st.integers(1, 2))


@settings(max_examples=150, deadline=None)
@given(raw=_requests())
def test_any_bytes_get_an_answer_or_a_close_and_the_listener_serves_on(raw: bytes) -> None:
    """Whatever arrives: a well-formed answer (or none) and a closed connection within the
    timeouts, nothing logged as a failure of the server, and the next client served."""

    async def run() -> None:
        router = Router()

        async def echo(request: web.Request) -> web.Response:
            return web.Response(body=await request.read())

        router.add_route("GET", "/echo/{name}", echo)
        router.add_route("POST", "/echo/{name}", echo)
        app = web.App(router, [])
        app.refusal = http_error_response
        listener = AdminListener(app, "127.0.0.1", 0)
        await listener.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(raw)
            data = await asyncio.wait_for(reader.read(), 5)
            await closed(writer)
            assert not data or re.match(rb"HTTP/1\.1 [1-5][0-9][0-9] ", data), data
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(b"POST /echo/a HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nok")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 5)).startswith(
                b"HTTP/1.1 200 "
            )
            await closed(writer)
        finally:
            await listener.stop(grace=1)

    failures: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = failures.append  # type: ignore[method-assign]
    logger = logging.getLogger()  # the server's own, and asyncio's (a callback that raised)
    logger.addHandler(handler)
    saved = server_module.READ_TIMEOUT, server_module.IDLE_TIMEOUT
    server_module.READ_TIMEOUT = server_module.IDLE_TIMEOUT = 0.05
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as it serves
            runner.run(run())
    finally:
        server_module.READ_TIMEOUT, server_module.IDLE_TIMEOUT = saved
        logger.removeHandler(handler)
    assert not failures, [r.getMessage() for r in failures]
