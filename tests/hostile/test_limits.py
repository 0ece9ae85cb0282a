"""Oversized requests and connection floods: 414/431/413, bounded memory, no fd exhaustion."""

from __future__ import annotations

import asyncio
import contextlib
import resource

import pytest

from gateway.config import LimitsConfig, ListenerLimits
from tests.gateway.conftest import routing
from tests.support.eventually import eventually

from .conftest import MiB, rss, send_raw


@pytest.fixture
async def served(pool, recording, gateway):
    pool.set_service(routing("web", prefix="/", limits=LimitsConfig(max_body_size=1 * MiB)))
    rec = await recording("web", "u1")
    return await gateway(limits=ListenerLimits(max_header_size=8192)), rec


async def _stream_until_answered(
    port: int, head: bytes, filler: bytes, total: int
) -> tuple[bytes, int]:
    """Send ``head`` then ``filler`` repeatedly (up to ``total`` bytes) until the gateway
    answers; returns the start of the answer and how many bytes were sent by then."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    try:
        writer.write(head)
        reading = asyncio.create_task(reader.read(4096))
        with contextlib.suppress(ConnectionError):
            while sent < total and not reading.done():
                writer.write(filler)
                sent += len(filler)
                await writer.drain()
        async with asyncio.timeout(5):
            answer = await reading
    finally:
        writer.close()
    return answer, sent


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /", 414),
        (b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: ", 431),
        (b"GET / HTTP/1.1\r\nHost: h\r\nX-", 431),
    ],
    ids=["request-line", "header-value", "header-name"],
)
async def test_an_endless_head_is_refused_early_with_bounded_memory(served, head, status):
    gw, rec = served
    before = rss()
    answer, sent = await _stream_until_answered(gw.port, head, b"a" * 65536, 256 * MiB)
    grown = rss() - before
    assert answer.split(b" ", 2)[1] == b"%d" % status, answer[:200]
    print(f"\n{status}: refused after {sent / MiB:.1f} MiB sent; RSS grew {grown / MiB:.1f} MiB")
    assert sent < 64 * MiB  # refused on the way, not after the whole thing
    assert grown < 32 * MiB
    assert rec.raw == []


async def test_a_thousand_headers_get_431(served):
    gw, rec = served
    many = b"".join(b"X-%d: v\r\n" % i for i in range(1000))
    answer = await send_raw(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\n" + many + b"\r\n")
    assert answer.statuses == [431]
    assert rec.raw == []


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_oversized_body_gets_413_with_bounded_memory(served, framing):
    gw, rec = served
    if framing == "chunked":
        head = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
        filler = b"10000\r\n" + b"b" * 65536 + b"\r\n"
    else:
        head = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % (1 << 40)
        filler = b"b" * 65536
    before = rss()
    answer, sent = await _stream_until_answered(gw.port, head, filler, 128 * MiB)
    grown = rss() - before
    print(f"\n413 ({framing}): {sent / MiB:.1f} MiB sent; RSS grew {grown / MiB:.1f} MiB")
    assert b" 413 " in answer.split(b"\r\n", 1)[0]
    assert grown < 32 * MiB
    # The upstream never got more than the limit.
    assert sum(len(r) for r in rec.raw) < 2 * MiB


async def test_thousands_of_idle_connections_cannot_exhaust_fds(pool, recording, gateway):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = 2000
    if soft < 2 * count + 200:
        pytest.skip(f"ulimit -n {soft} is too low for {count} connections on each side")
    pool.set_service(routing("web", prefix="/"))
    await recording("web", "u1")
    gw = await gateway(limits=ListenerLimits(max_connections=500, header_timeout=30))

    async def idle():
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        return reader, writer

    conns = []
    try:
        for _ in range(count // 250):
            conns += await asyncio.gather(*(idle() for _ in range(250)))

        # Those beyond the limit were answered 503 and closed at once.
        async def first_bytes(reader):
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(reader.read(200), 0.5)
            return b""

        answers = await asyncio.gather(*(first_bytes(r) for r, _ in conns))
        refused = sum(a.startswith(b"HTTP/1.1 503") for a in answers)
        print(f"\n{count} connections, max_connections 500: {refused} refused with 503")
        assert refused == count - 500
        # The 500 kept are served, and a new client is refused, not hung.
        answer = await send_raw(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n", wait=2)
        assert answer.statuses == [503]
        assert b"too_many_connections" in answer.data
        reader, writer = conns[0]
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
    finally:
        for _, writer in conns:
            writer.close()
    # Once they are gone the gateway takes new connections again.
    await eventually(lambda: gw.connections == 0, what="the closed connections gone")
    answer = await send_raw(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert answer.statuses == [200]
