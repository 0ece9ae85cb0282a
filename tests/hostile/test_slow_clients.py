"""Slow clients: slowloris heads, trickled bodies, a client that never reads.

Each is cut off by a timeout while normal clients keep being served; the latency those see
under attack is measured and printed (``-s``) and only loosely asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time

import aiohttp
from aiohttp import web

from gateway.config import ListenerLimits, OutlierConfig
from tests.gateway.conftest import routing, url
from tests.support.eventually import eventually

from .conftest import MiB, rss

OUTLIER = OutlierConfig(consecutive_5xx=1, consecutive_connect_failures=1, max_ejection_percent=100)


async def _latencies(session: aiohttp.ClientSession, target: str, count: int) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        async with session.get(target) as response:
            assert response.status == 200
            await response.read()
        out.append(time.perf_counter() - started)
    return out


def _summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[int(len(ordered) * 0.99) - 1]
    return f"p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"


async def test_slowloris_heads_are_closed_and_others_are_served(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway(limits=ListenerLimits(header_timeout=1.0))
    baseline = await _latencies(client, url(gw), 100)

    connected = 0

    async def slowloris() -> float:
        nonlocal connected
        started = time.perf_counter()
        _reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        connected += 1
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n")
            for i in range(100):  # a header byte every 50 ms, never the end of the head
                writer.write(b"X-%d: 1\r\n" % i)
                await writer.drain()
                await asyncio.sleep(0.05)
        except ConnectionError:
            pass
        finally:
            writer.close()
        return time.perf_counter() - started

    attackers = [asyncio.create_task(slowloris()) for _ in range(300)]
    await eventually(lambda: connected == 300, what="the 300 slowloris connections")
    under_attack = await _latencies(client, url(gw), 100)
    lasted = await asyncio.gather(*attackers)
    print(
        f"\nslowloris x300: baseline {_summary(baseline)}; under attack {_summary(under_attack)};"
        f" attackers cut off after {min(lasted):.2f}-{max(lasted):.2f} s"
    )
    assert max(lasted) < 3.0  # the header timeout (1 s), not the 5 s the attack wanted
    assert max(under_attack) < 2.0


async def _stalled_upload(port: int, trickle: float | None) -> tuple[bytes, float]:
    """POST a 1000-byte body: 10 bytes then nothing (``trickle`` None) or a byte every
    ``trickle`` s. Returns what the gateway answered and how long until it closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.perf_counter()
    writer.write(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            while trickle is not None:
                await asyncio.sleep(trickle)
                writer.write(b"x")
                await writer.drain()

    dripping = asyncio.create_task(drip())
    try:
        async with asyncio.timeout(10):
            answer = await reader.read()
        return answer, time.perf_counter() - started
    finally:
        dripping.cancel()
        writer.close()


async def test_a_stalled_body_gets_408_and_the_upstream_is_not_blamed(
    pool, upstream, gateway, recorder
):
    pool.set_service(routing("web", prefix="/", outlier=OUTLIER))
    await upstream("web", "u1")
    gw = await gateway(limits=ListenerLimits(body_timeout=0.5))
    answer, took = await _stalled_upload(gw.port, None)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"request_timeout"' in answer
    assert took < 3.0
    assert not pool.upstream("web", "u1").ejected
    assert pool.service("web").inflight.get("u1", 0) == 0  # the lease was released


async def test_a_body_trickled_a_byte_at_a_time_is_cut_off_by_the_minimum_rate(
    pool, upstream, gateway
):
    pool.set_service(routing("web", prefix="/", outlier=OUTLIER))
    await upstream("web", "u1")
    # A byte every 0.1 s never pauses 0.5 s: only the minimum rate catches it.
    gw = await gateway(limits=ListenerLimits(body_timeout=0.5, body_min_rate=100))
    answer, took = await _stalled_upload(gw.port, 0.1)
    assert answer.startswith(b"HTTP/1.1 408 ")
    print(f"\ntrickled body (1 B / 0.1 s, min rate 100 B/s): 408 after {took:.2f} s")
    assert took < 3.0
    assert not pool.upstream("web", "u1").ejected


async def test_a_client_that_never_reads_is_cut_off_with_bounded_buffers(
    pool, upstream, gateway, recorder
):
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b"z" * 65536
        with contextlib.suppress(ConnectionError):
            while True:
                await response.write(chunk)
                sent += len(chunk)
        return response

    app = web.Application()
    app.router.add_get("/", endless)
    pool.set_service(routing("web", prefix="/", outlier=OUTLIER))
    await upstream("web", "u1", app)
    gw = await gateway(limits=ListenerLimits(send_timeout=1.0))

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
    _reader, writer = await asyncio.open_connection(sock=sock)
    before = rss()
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        record = await asyncio.wait_for(recorder.next(), 10)  # never reading meanwhile
        grown = rss() - before
    finally:
        writer.close()
    print(
        f"\nnever-reading client: cut off after {record.duration:.2f} s;"
        f" upstream wrote {sent / MiB:.1f} MiB before backpressure held it; RSS grew"
        f" {grown / MiB:.1f} MiB"
    )
    assert record.error == "client_too_slow"
    assert sent < 64 * MiB
    assert not pool.upstream("web", "u1").ejected


async def test_a_websocket_client_that_never_reads_is_cut_off(pool, upstream, gateway, recorder):
    upstream_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sent = 0

    async def flood(request: web.Request) -> web.WebSocketResponse:
        nonlocal sent
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()  # "go"
        chunk = b"z" * 65536
        try:
            with contextlib.suppress(ConnectionError, RuntimeError):
                while not ws.closed:
                    await ws.send_bytes(chunk)
                    sent += len(chunk)
        finally:  # the gateway closed the connection: a reset, or this handler cancelled
            upstream_done.set_result(None)
        return ws

    app = web.Application()
    app.router.add_get("/ws", flood)
    pool.set_service(routing("web", prefix="/", outlier=OUTLIER))
    await upstream("web", "u1", app)
    gw = await gateway(limits=ListenerLimits(send_timeout=1.0))

    async with aiohttp.ClientSession() as session:
        # aiohttp's client stops reading its socket once it holds ~64 KiB it was not asked
        # for: this client never calls receive(), so the gateway's writes back up.
        ws = await session.ws_connect(url(gw, "/ws"))
        await ws.send_str("go")
        record = await asyncio.wait_for(recorder.next(), 10)
        await asyncio.wait_for(upstream_done, 5)
        await ws.close()

    print(f"\nnever-reading WebSocket client: cut off after {record.duration:.2f} s;"
          f" the upstream wrote {sent / MiB:.1f} MiB before back-pressure held it")  # fmt: skip
    assert record.status == 101
    assert record.error == "client_too_slow"
    assert sent < 64 * MiB
    assert pool.service("web").inflight == {}
