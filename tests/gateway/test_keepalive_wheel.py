"""The deadline wheel (``wheel.Wheel``): the deadlines of connections waiting for a request
(idle, or for a head) in slots under one timer of the loop. On a fake loop whose clock the
test moves: nothing sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gateway.config import ListenerLimits
from gateway.proxy.http1_downstream import ClientConnection, ConnectionGate
from gateway.proxy.wheel import WHEEL_SLOT, wheel_of

from .fakeloop import FakeLoop, running

GET = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"


class Transport:
    def __init__(self) -> None:
        self.closed = False
        self.written = b""
        self.on_close: Callable[[], None] | None = None

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 50000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True
        if self.on_close is not None:
            self.on_close()

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Served:
    """A ``Begin`` that takes every request and answers nothing: the test finishes them."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def __call__(self, conn: ClientConnection, request: Any) -> bool:
        self.requests.append(request)
        return True


def connect(
    loop: FakeLoop, keepalive: float = 75.0, head: float = 10.0
) -> tuple[ClientConnection, Transport, Served]:
    served = Served()

    async def handler(conn: ClientConnection, request: Any) -> None:
        raise AssertionError("every request is taken by begin")

    limits = ListenerLimits(keepalive_timeout=keepalive, header_timeout=head)
    conn = ClientConnection(handler, limits, ConnectionGate(100), set(), served)
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport, served


def serve_one(conn: ClientConnection, served: Served) -> None:
    conn.data_received(GET)
    conn.finished(served.requests[-1], asyncio.get_running_loop().time())


def wheel_entries(loop: FakeLoop) -> int:
    return sum(len(readers) for readers in wheel_of(loop).slots.values())  # type: ignore[arg-type]


def test_an_idle_connection_is_in_the_wheel_and_holds_no_timer(loop):
    conn, transport, served = connect(loop)
    assert wheel_entries(loop) == 1  # the first request's head is due: in the wheel too
    serve_one(conn, served)
    assert wheel_entries(loop) == 1
    assert len(loop.pending()) == 1  # the wheel's only
    loop.advance(75 - 0.1)
    assert not transport.closed
    loop.advance(0.1 + WHEEL_SLOT)
    assert transport.closed
    conn.connection_lost(None)
    assert wheel_entries(loop) == 0


def test_a_connection_busy_when_its_slot_fires_is_skipped_then_timed_again(loop):
    conn, transport, served = connect(loop)
    serve_one(conn, served)
    loop.advance(70)
    conn.data_received(GET)  # busy from 70 s, answered at 80 s
    loop.advance(10)
    assert not transport.closed  # its slot came at 75 s: skipped
    conn.finished(served.requests[-1], loop.time())
    assert wheel_entries(loop) == 1
    loop.advance(75 - 0.1)
    assert not transport.closed
    loop.advance(0.1 + WHEEL_SLOT)
    assert transport.closed


def test_a_deadline_moved_later_goes_back_in(loop):
    conn, transport, served = connect(loop)
    serve_one(conn, served)
    loop.advance(50)
    serve_one(conn, served)  # idle again, due at 125 s; still in its slot of 75 s
    loop.advance(25 + WHEEL_SLOT)
    assert not transport.closed
    assert wheel_entries(loop) == 1  # put back
    loop.advance(50 - WHEEL_SLOT - 0.1)
    assert not transport.closed
    loop.advance(0.1 + WHEEL_SLOT)
    assert transport.closed


def test_a_connection_put_back_does_not_delay_an_earlier_slot(loop):
    again, again_transport, again_served = connect(loop)
    serve_one(again, again_served)  # idle from 0 s: its slot is at 75 s
    loop.advance(10)
    other, other_transport, other_served = connect(loop)
    serve_one(other, other_served)  # idle from 10 s: its slot is at 85 s
    loop.advance(40)
    serve_one(again, again_served)  # idle again from 50 s: due at 125 s, still at 75 s
    loop.advance(25 + WHEEL_SLOT)  # 75 s: put back, for 125 s
    assert not again_transport.closed
    loop.advance(10)  # 85 s
    assert other_transport.closed  # on time, not at 125 s with the one put back
    assert not again_transport.closed
    loop.advance(40)
    assert again_transport.closed


def test_a_closed_connection_leaves_the_wheel(loop):
    conns = [connect(loop) for _ in range(3)]
    for conn, _, served in conns:
        serve_one(conn, served)
    assert wheel_entries(loop) == 3
    conns[1][0].connection_lost(None)
    assert wheel_entries(loop) == 2
    loop.advance(76)
    assert [transport.closed for _, transport, _ in conns] == [True, False, True]


def test_a_short_keepalive_timeout_closes_within_a_slot(loop):
    conn, transport, served = connect(loop, keepalive=0.2)
    serve_one(conn, served)
    loop.advance(0.19)
    assert not transport.closed
    loop.advance(0.01 + WHEEL_SLOT)
    assert transport.closed


def test_a_new_connections_head_is_due_in_the_wheel(loop):
    conn, transport, served = connect(loop)
    assert wheel_entries(loop) == 1
    assert len(loop.pending()) == 1  # the wheel's: the connection has no timer of its own
    loop.advance(10 - 0.01)
    assert not transport.closed
    loop.advance(0.01 + WHEEL_SLOT)
    assert transport.closed  # aborted: its head never came
    assert served.requests == []
    conn.connection_lost(None)
    assert wheel_entries(loop) == 0
    assert loop.pending() == []


def test_a_head_begun_on_an_idle_connection_moves_it_to_an_earlier_slot(loop):
    conn, transport, served = connect(loop)
    serve_one(conn, served)  # idle, still in its first head's slot (10 s)
    loop.advance(20)  # that slot came: put back in the slot of 75 s
    conn.data_received(b"GET / HT")  # a head begun, due within header_timeout (10 s)
    assert wheel_entries(loop) == 1  # moved, not in two slots
    loop.advance(10 - 0.01)
    assert not transport.closed
    loop.advance(0.01 + WHEEL_SLOT)
    assert transport.closed


def test_a_keepalive_shorter_than_the_head_timeout_moves_it_too(loop):
    conn, transport, served = connect(loop, keepalive=2, head=10)
    loop.advance(1)
    serve_one(conn, served)  # idle from 1 s, due at 3 s; its head's slot was at 10 s
    loop.advance(2 - 0.01)
    assert not transport.closed
    loop.advance(0.01 + WHEEL_SLOT)
    assert transport.closed


def test_a_head_that_comes_in_time_leaves_the_connection_open(loop):
    conn, transport, served = connect(loop)
    loop.advance(9)
    conn.data_received(GET)  # busy at its head's slot: skipped, then idle for 75 s
    loop.advance(1 + WHEEL_SLOT)
    assert not transport.closed
    conn.finished(served.requests[-1], loop.time())
    loop.advance(75 - 0.01)
    assert not transport.closed
    loop.advance(0.01 + WHEEL_SLOT)
    assert transport.closed


def test_many_new_connections_share_one_timer(loop):
    conns = [connect(loop) for _ in range(100)]
    assert len(loop.pending()) == 1
    loop.advance(10 + WHEEL_SLOT)
    assert all(transport.closed for _, transport, _ in conns)


def test_many_connections_share_one_timer_each_closed_once_on_time(loop):
    conns = []
    idle_at = {}
    for _ in range(100):
        conn, transport, served = connect(loop)
        serve_one(conn, served)
        conns.append((conn, transport))
        idle_at[transport] = loop.now
        loop.advance(0.1)
    assert len(loop.pending()) == 1 + 100 * 0  # the wheel's; no connection has a timer
    loop.advance(75 - 10 - 0.1)
    assert not any(t.closed for _, t in conns)
    for _ in range(24):
        loop.advance(0.5)
        for _, transport in conns:
            due = idle_at[transport] + 75
            if transport.closed:
                assert due <= loop.now  # never before its deadline
            else:
                assert due > loop.now - WHEEL_SLOT  # nor more than a slot after it
    assert all(t.closed for _, t in conns)
    for conn, _ in conns:
        conn.connection_lost(None)
    assert wheel_entries(loop) == 0
    assert loop.pending() == []


def test_an_earlier_slot_rearms_the_wheels_timer(loop):
    late, late_transport, served = connect(loop, keepalive=75)
    serve_one(late, served)
    soon, soon_transport, served = connect(loop, keepalive=1)
    serve_one(soon, served)
    assert len(loop.pending()) == 1
    loop.advance(1 + WHEEL_SLOT)
    assert soon_transport.closed
    assert not late_transport.closed
    assert len(loop.pending()) == 1  # armed again, for the later slot
    loop.advance(75)
    assert late_transport.closed


def test_a_connection_closed_by_another_in_the_same_slot_is_not_fired(loop):
    a, a_transport, a_served = connect(loop)
    b, b_transport, b_served = connect(loop)
    serve_one(a, a_served)
    serve_one(b, b_served)
    # The first closed loses the other at once (as if its close took the other's socket).
    a_transport.on_close = lambda: b.connection_lost(None)
    b_transport.on_close = lambda: a.connection_lost(None)
    loop.advance(75 + WHEEL_SLOT)
    assert a_transport.closed != b_transport.closed  # one closed by the wheel, not both
    assert wheel_entries(loop) == 0


def test_a_timer_run_a_little_early_still_fires_its_slot():
    loop = FakeLoop(early=0.001)
    with running(loop):
        conn, transport, served = connect(loop, keepalive=5.1, head=5.1)
        serve_one(conn, served)
        loop.advance(5.1 + WHEEL_SLOT)
        assert transport.closed
        assert loop.pending() == []


def test_each_loop_has_its_wheel_and_a_replaced_one_still_fires():
    one, two = FakeLoop(), FakeLoop()
    with running(one):
        conn, transport, served = connect(one, keepalive=1)
        serve_one(conn, served)
    first = wheel_of(one)  # type: ignore[arg-type]
    assert wheel_of(one) is first  # type: ignore[arg-type]
    assert wheel_of(two) is not first  # type: ignore[arg-type]
    one.advance(1 + WHEEL_SLOT)
    assert transport.closed
