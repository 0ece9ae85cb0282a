"""Misbehaving upstreams: each ends in a 502/504 or an aborted response, is counted by
passive detection, and leaves the gateway's memory bounded.

Passive detection is set to eject on the first failure, so "counted" is visible as the
upstream being ejected. A client must never be shown a short body as if it were complete:
an aborted response is a connection closed before the Content-Length was reached or before
the terminating chunk.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.config import OutlierConfig, TimeoutsConfig
from tests.gateway.conftest import add, routing
from tests.support.raw_servers import RawServers

from .conftest import MiB, rss, send_raw

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
GET = b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"


def _script(*steps):
    """A raw upstream: read the request head, then write/sleep/close as scripted."""

    async def serve(reader, writer):
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            for step in steps:
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                elif step == "hang":
                    await asyncio.sleep(30)
                elif step == "pause":  # let the head reach the client first
                    await asyncio.sleep(0.1)
                elif callable(step):
                    await step(writer)
        writer.close()

    return serve


async def _flood(writer):
    writer.write(b"HTTP/1.1 200 OK\r\n")
    for i in range(5000):
        writer.write(b"X-Flood-%d: %s\r\n" % (i, b"v" * 20))
        if i % 100 == 0:
            await writer.drain()
    writer.write(b"Content-Length: 0\r\n\r\n")


async def _endless(writer):
    writer.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"z" * 64 * 1024)
    while True:
        writer.write(chunk)
        await writer.drain()


SERVICE = dict(
    timeouts=TimeoutsConfig(connect=1, read=0.3),
    outlier=OutlierConfig(
        consecutive_5xx=1, consecutive_connect_failures=1, max_ejection_percent=100
    ),
)


@pytest.fixture
async def raw_upstream():
    """Like tests/gateway's: every connection handler is ended at teardown (a handler that
    hangs would otherwise outlive the test's loop), every connection closed."""
    servers = RawServers()

    async def start(serve):
        async def closing(reader, writer):
            try:
                await serve(reader, writer)
            finally:
                writer.close()

        server = await servers.start(closing)
        return server.sockets[0].getsockname()[1]

    yield start
    await servers.close()


async def _setup(pool, raw_upstream, gateway, serve):
    pool.set_service(routing("web", prefix="/", **SERVICE))
    add(pool, "web", "u1", await raw_upstream(serve))
    return await gateway()


CASES = {
    "garbage": (_script(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), 502),
    "garbage_status_line": (_script(b"HTTP/1.1 abc OK\r\n\r\n"), 502),
    "close_mid_headers": (_script(b"HTTP/1.1 200 OK\r\nContent-Le"), 502),
    "close_before_anything": (_script(), 502),
    "hang_before_headers": (_script("hang"), 504),
    "header_flood": (_script(_flood), 502),
    "huge_header": (_script(b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * 200_000 + b"\r\n\r\n"), 502),
    "bad_content_length": (
        _script(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello"),
        502,
    ),
}


@pytest.mark.parametrize(("serve", "status"), CASES.values(), ids=CASES.keys())
async def test_a_broken_answer_is_a_gateway_error_and_counted(
    pool, raw_upstream, gateway, serve, status
):
    gw = await _setup(pool, raw_upstream, gateway, serve)
    answer = await send_raw(gw.port, GET)
    assert answer.statuses == [status], answer.data[:300]
    assert b'"error"' in answer.data
    assert pool.upstream("web", "u1").ejected


ABORTS = {
    "close_mid_body_length": _script(HEAD + b"Content-Length: 1000\r\n\r\n" + b"x" * 10),
    "close_mid_body_chunked": _script(HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"),
    "broken_chunk": _script(
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "pause", b"zz\r\n"
    ),
    "broken_chunk_data": _script(
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n",
        "pause",
        b"5\r\nhello\r\n",
        "pause",
        b"5\r\nhelloXX\r\n0\r\n\r\n",
    ),
    "hang_after_headers": _script(HEAD + b"Content-Length: 10\r\n\r\n", "hang"),
    "hang_mid_body": _script(HEAD + b"Content-Length: 10\r\n\r\nabc", "hang"),
}


@pytest.mark.parametrize("serve", ABORTS.values(), ids=ABORTS.keys())
async def test_a_body_that_breaks_off_aborts_the_response_and_is_counted(
    pool, raw_upstream, gateway, recorder, serve
):
    gw = await _setup(pool, raw_upstream, gateway, serve)
    answer = await send_raw(gw.port, GET)
    assert answer.statuses == [200]
    assert answer.closed
    head, _, body = answer.data.partition(b"\r\n\r\n")
    if b"content-length: " in head.lower():
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert len(body) < length
    else:
        assert not body.endswith(b"0\r\n\r\n")
    # Before: "ok" was reported on the headers, so a body breaking off never counted.
    assert pool.upstream("web", "u1").ejected
    assert recorder.records[-1].error is not None


async def test_a_complete_answer_is_ok_for_passive_detection(pool, raw_upstream, gateway):
    gw = await _setup(pool, raw_upstream, gateway, _script(HEAD + b"Content-Length: 2\r\n\r\nok"))
    answer = await send_raw(gw.port, GET)
    assert answer.statuses == [200]
    assert answer.data.endswith(b"\r\n\r\nok")
    assert not pool.upstream("web", "u1").ejected


async def test_an_endless_body_streams_with_bounded_memory(pool, raw_upstream, gateway):
    gw = await _setup(pool, raw_upstream, gateway, _script(_endless))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(GET)
        await reader.readuntil(b"\r\n\r\n")
        got = 0
        before = rss()
        async with asyncio.timeout(20):
            while got < 200 * MiB:
                got += len(await reader.read(1 << 20))
        grown = rss() - before
    finally:
        writer.close()
    print(f"endless body: {got / MiB:.0f} MiB streamed, RSS grew {grown / MiB:.1f} MiB")
    assert grown < 40 * MiB
