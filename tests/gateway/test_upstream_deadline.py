"""An upstream connection's read timeout (``UpstreamConnection``'s one lazily re-armed
timer): due ``read_timeout`` after the request was sent or the
last read, whatever request armed the timer; after a streamed chunked body's last read, up
to ``LOOK`` of it later, never earlier. On a fake loop whose clock the test moves: nothing
sleeps."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import GatewayError
from gateway.proxy.messages import ResponseHead
from gateway.proxy.streams import ResponseStream
from gateway.proxy.upstream_connection import LOOK, UpstreamConnection
from gateway.wire.batch import WriteBatch
from gateway.wire.splice import Buffers

from .fakeloop import FakeLoop

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


# -- a chunked body: each read is counted, not timed; the timer reads the clock (``LOOK``) --

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def event(n: int) -> bytes:
    data = b"data: %d\n\n" % n
    return b"%x\r\n%s\r\n" % (len(data), data)


class Client:
    """The client an answer streams to (``streams.ClientSide``), through its transport."""

    def __init__(self) -> None:
        self.transport = Transport()
        self.writing_paused = False

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def flush(self) -> None:
        pass

    def socket_fd(self) -> int:
        return -1


def streaming(conn: UpstreamConnection) -> tuple[Client, asyncio.Future[None]]:
    """A request sent now, its answer's head and first event read, its body under way."""
    waiter = Waiter()
    send(conn, waiter)
    conn.data_received(CHUNKED + event(0))
    assert waiter.statuses == [200]
    client = Client()
    done = conn.stream_to(ResponseStream(client, chunked=True, head=b"head"))  # type: ignore[arg-type]
    assert done is not None
    return client, done


def test_a_chunked_body_read_at_intervals_below_the_timeout_is_never_cut(loop):
    conn, transport = connect()
    client, done = streaming(conn)
    for n in range(1, 41):  # 20 timeouts long, a read every half of one
        loop.advance(READ_TIMEOUT / 2)
        conn.data_received(event(n))
    assert not done.done()
    assert not transport.aborted
    conn.data_received(b"0\r\n\r\n")
    assert done.done()
    assert done.exception() is None
    assert b"".join(client.transport.written).endswith(event(40) + b"0\r\n\r\n")


def cut_after(loop: FakeLoop, done: asyncio.Future[None], step: float = 0.01) -> float:
    """Seconds until ``done`` failed, the clock moved ``step`` at a time (at most two
    timeouts)."""
    start = loop.time()
    while not done.done() and loop.time() - start < 2 * READ_TIMEOUT:
        loop.advance(step)
    error = done.exception()
    assert isinstance(error, GatewayError)
    assert error.kind == "timeout"
    return loop.time() - start


@pytest.mark.parametrize(
    ("reads", "apart"),
    [(0, 0.0), (1, 0.01), (1, 0.5), (4, 1 / 3), (4, 0.9)],
)
@pytest.mark.parametrize("then", [0.0, 0.3, 0.99])
def test_a_chunked_body_that_stops_is_cut_between_one_and_one_and_look_timeouts(
    loop, reads, apart, then
):
    """``reads`` more reads ``apart`` (a fraction of the timeout), then one ``then`` (a
    fraction of ``LOOK`` times the timeout) later, then none: cut never before the timeout
    after that last read, never more than ``LOOK`` of it after."""
    conn, transport = connect()
    _, done = streaming(conn)
    for n in range(1, reads + 1):
        loop.advance(READ_TIMEOUT * apart)
        conn.data_received(event(n))
    loop.advance(READ_TIMEOUT * LOOK * then)
    conn.data_received(event(reads + 1))
    cut = cut_after(loop, done)
    assert READ_TIMEOUT <= cut <= READ_TIMEOUT * (1 + LOOK) + 0.01
    assert transport.aborted


def test_a_connection_goes_idle_at_the_read_that_ended_its_chunked_answer(loop):
    conn, _ = connect()
    streaming(conn)
    loop.advance(7.0)
    conn.data_received(event(1))
    loop.advance(3.0)
    conn.data_received(b"0\r\n\r\n")
    ended = loop.time()
    loop.advance(2.0)  # the connector releases it later
    assert conn.idle() == ended


def test_the_next_request_after_a_chunked_answer_is_timed_from_its_own_send(loop):
    conn, transport = connect()
    streaming(conn)
    loop.advance(5.0)
    conn.data_received(event(1) + b"0\r\n\r\n")
    conn.idle()
    loop.advance(1.0)
    waiter = Waiter()
    send(conn, waiter)  # no answer: its reads of the chunked body before count for nothing
    loop.advance(READ_TIMEOUT - 0.01)
    assert waiter.errors == []
    loop.advance(0.02)
    assert [e.kind for e in waiter.errors] == ["timeout"]
    assert transport.aborted
