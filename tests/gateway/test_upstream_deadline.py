"""An upstream connection's read timeout (``UpstreamConnection``, its one lazily re-armed
timer): due ``read_timeout`` after the request was sent or the last read, whatever request
armed the timer. On a fake loop whose clock the test moves: nothing sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.errors import GatewayError
from gateway.proxy.messages import ResponseHead
from gateway.proxy.upstream_connection import UpstreamConnection
from gateway.wire.batch import WriteBatch
from gateway.wire.splice import Buffers

from .fakeloop import FakeLoop, running

GET = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
READ_TIMEOUT = 60.0


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Waiter:
    """Told of the answer or the failure, as an ``Exchange`` is."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.errors: list[GatewayError] = []

    def answered(self, conn: UpstreamConnection, head: ResponseHead) -> None:
        self.statuses.append(head.status)

    def failed(self, conn: UpstreamConnection, error: GatewayError) -> None:
        self.errors.append(error)


@pytest.fixture
def loop() -> Iterator[FakeLoop]:
    fake = FakeLoop()
    with running(fake):
        yield fake


def connect() -> tuple[UpstreamConnection, Transport]:
    conn = UpstreamConnection(
        "127.0.0.1:1",
        max_header_size=16 * 1024,
        buffers=Buffers(),
        batch=WriteBatch(),
        forget=lambda conn: None,
    )
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def send(conn: UpstreamConnection, waiter: Waiter) -> None:
    conn.send(
        GET,
        body=False,
        chunked=False,
        head_only=False,
        read_timeout=READ_TIMEOUT,
        now=asyncio.get_running_loop().time(),  # the fake loop's: where the test moved it
        waiter=waiter,
    )


def test_a_request_that_gets_no_answer_fails_after_the_read_timeout(loop):
    conn, transport = connect()
    waiter = Waiter()
    send(conn, waiter)
    loop.advance(READ_TIMEOUT - 0.01)
    assert waiter.errors == []
    loop.advance(0.02)
    assert [e.kind for e in waiter.errors] == ["timeout"]
    assert transport.aborted


def test_the_next_request_on_the_connection_is_timed_from_its_own_send(loop):
    conn, transport = connect()
    first = Waiter()
    send(conn, first)  # at 0 s: the timer is armed for 60 s
    conn.data_received(OK)
    assert first.statuses == [200]
    conn.idle()  # back in the pool, as ``Connector.release`` does
    loop.advance(20)
    second = Waiter()
    send(conn, second)  # at 20 s, due at 80 s; the timer of 60 s comes first
    loop.advance(READ_TIMEOUT - 0.01)
    assert second.errors == []  # 79.99 s: the timer came at 60 s and was put back
    loop.advance(0.02)
    assert [e.kind for e in second.errors] == ["timeout"]  # 80.01 s, not 90 s
    assert transport.aborted
