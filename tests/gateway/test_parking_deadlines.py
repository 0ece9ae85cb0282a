"""When an idle connection is parked (``ClientConnection._park``, in a slot of the loop's
``Wheel``), and when a parked one is closed (``Parking``'s deadlines): on a fake loop whose
clock the test moves. Parked descriptors are real sockets (a socket pair's ends)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.config import ListenerLimits
from gateway.proxy.http1_downstream import ClientConnection, ConnectionGate
from gateway.proxy.parking import Parking
from gateway.proxy.wheel import WHEEL_SLOT

from .fakeloop import FakeLoop
from .test_keepalive_wheel import GET, Served, Transport


class Sock:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


class SocketTransport(Transport):
    """A transport over a real descriptor (for ``get_extra_info("socket")``), with unsent
    bytes if the test says so."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.unsent = 0

    def get_extra_info(self, name: str) -> Any:
        if name == "socket":
            return Sock(self.fd)
        return super().get_extra_info(name)

    def get_write_buffer_size(self) -> int:
        return self.unsent


class Lot:
    """Stands for ``Parking`` where the test looks only at what the connection asks of it."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.parked: list[tuple[int, float, float]] = []
        """(descriptor, deadline, when asked)."""

    def park(self, fd: int, deadline: float, park_after: float) -> bool:
        self.parked.append((fd, deadline, asyncio.get_running_loop().time()))
        return self.accept


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def connect(
    gate: ConnectionGate, fd: int, park_after: float = 1.0, keepalive: float = 75.0
) -> tuple[ClientConnection, SocketTransport, Served]:
    served = Served()

    async def handler(conn: ClientConnection, request: Any) -> None:
        raise AssertionError("every request is taken by begin")

    limits = ListenerLimits(keepalive_timeout=keepalive, park_after=park_after)
    conn = ClientConnection(handler, limits, gate, set(), served)
    transport = SocketTransport(fd)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport, served


def answer(conn: ClientConnection, served: Served) -> None:
    conn.data_received(GET)
    conn.finished(served.requests[-1], asyncio.get_running_loop().time())


def gate_with(lot: Lot | None) -> ConnectionGate:
    gate = ConnectionGate(100)
    gate.parking = lot  # type: ignore[assignment]
    return gate


# -- when a connection is parked ------------------------------------------------------------


def test_an_idle_connection_is_parked_after_park_after_with_its_deadline(loop, pair):
    lot = Lot()
    gate = gate_with(lot)
    conn, transport, served = connect(gate, pair[0].fileno())
    answer(conn, served)
    idle_from = loop.now
    assert gate.open == 1

    loop.advance(1 - 0.01)
    assert lot.parked == []
    loop.advance(0.01 + WHEEL_SLOT)

    [(fd, deadline, when)] = lot.parked
    assert fd == pair[0].fileno()
    assert deadline == idle_from + 75  # the keep-alive deadline goes with it
    assert idle_from + 1 <= when <= idle_from + 1 + WHEEL_SLOT
    assert transport.closed  # the loop's transport is let go: its descriptor, not the socket
    assert conn.transport is None
    assert gate.open == 0
    conn.connection_lost(None)  # the transport's: nothing more to undo
    assert gate.open == 0


def test_a_connection_busy_at_its_slot_is_parked_after_its_next_idle_spell(loop, pair):
    lot = Lot()
    conn, _, served = connect(gate_with(lot), pair[0].fileno())
    answer(conn, served)
    loop.advance(0.5)
    conn.data_received(GET)  # busy across its slot
    loop.advance(1)
    assert lot.parked == []
    conn.finished(served.requests[-1], loop.now)
    idle_from = loop.now
    loop.advance(1 + WHEEL_SLOT)
    [(_, deadline, when)] = lot.parked
    assert deadline == idle_from + 75
    assert idle_from + 1 <= when


def test_a_connection_answered_again_within_park_after_is_not_parked_early(loop, pair):
    lot = Lot()
    conn, _, served = connect(gate_with(lot), pair[0].fileno())
    for _ in range(10):  # a request every 0.5 s: never idle for 1 s
        answer(conn, served)
        loop.advance(0.5)
    assert lot.parked == []
    loop.advance(0.5 + WHEEL_SLOT)
    assert len(lot.parked) == 1


def test_a_new_connections_first_idle_spell_is_parked_before_its_head_slot(loop, pair):
    lot = Lot()
    conn, _, served = connect(gate_with(lot), pair[0].fileno())  # its head due in 10 s
    answer(conn, served)
    loop.advance(1 + WHEEL_SLOT)
    assert len(lot.parked) == 1  # moved from its head's slot to an earlier one


@pytest.mark.parametrize("why", ["tls", "unsent", "head begun", "refused"])
def test_a_connection_that_cannot_be_parked_stays_and_closes_at_its_deadline(loop, pair, why):
    lot = Lot(accept=why != "refused")
    conn, transport, served = connect(gate_with(lot), pair[0].fileno())
    answer(conn, served)
    if why == "tls":
        conn.secure = True
    elif why == "unsent":
        transport.unsent = 1
    elif why == "head begun":
        conn.data_received(b"GET / HT")
    loop.advance(1 + WHEEL_SLOT)
    assert len(lot.parked) == (1 if why == "refused" else 0)  # asked only when it can be
    assert not transport.closed
    assert conn.transport is transport
    loop.advance(75)
    assert transport.closed  # its deadline (or its head's) held


@pytest.mark.parametrize("park_after", [0, 75, 100])
def test_parking_off_or_not_before_the_deadline_never_parks(loop, pair, park_after):
    lot = Lot()
    conn, transport, served = connect(gate_with(lot), pair[0].fileno(), park_after=park_after)
    answer(conn, served)
    loop.advance(75 + WHEEL_SLOT)
    assert lot.parked == []
    assert transport.closed


def test_a_connection_on_a_listener_without_parking_is_not_parked(loop, pair):
    conn, transport, served = connect(gate_with(None), pair[0].fileno())
    answer(conn, served)
    loop.advance(1 + WHEEL_SLOT)
    assert conn.transport is transport
    loop.advance(75)
    assert transport.closed


# -- a parked connection's deadline -----------------------------------------------------------


class Made(asyncio.Protocol):
    def __init__(self, park_after: float) -> None:
        self.park_after = park_after


def parking(loop: FakeLoop) -> tuple[Parking, ConnectionGate]:
    gate = ConnectionGate(100)
    lot = Parking(loop, Made, socket.AF_UNIX, gate, 1.0)  # type: ignore[arg-type]
    gate.parking = lot
    return lot, gate


def closed(peer: socket.socket) -> bool:
    """The gateway's side of ``peer`` is closed: it reads the end."""
    peer.setblocking(False)
    try:
        return peer.recv(1) == b""
    except BlockingIOError:
        return False


def test_a_parked_connection_is_closed_at_its_deadline_not_before(loop, pair):
    lot, gate = parking(loop)
    ours, peer = pair
    assert lot.park(ours.fileno(), loop.now + 60, 1.0)
    ours.close()  # as the transport does: the parked duplicate holds the connection
    assert gate.parked == 1

    loop.advance(60 - 0.01)
    assert not closed(peer)
    assert gate.parked == 1
    loop.advance(0.01 + WHEEL_SLOT)
    assert closed(peer)
    assert gate.parked == 0


def test_a_slot_that_comes_before_the_deadline_closes_nothing_early(loop, pair):
    # A loop may run the wheel's timer a little before its time (its clock's resolution).
    lot, gate = parking(loop)
    ours, peer = pair
    lot.park(ours.fileno(), loop.now + 60, 1.0)
    ours.close()
    [expiry] = lot._expiries.values()

    expiry.on_wheel()  # 60 s early

    assert not closed(peer)
    assert gate.parked == 1
    loop.advance(60 + WHEEL_SLOT)  # put in the wheel again: closed at its deadline
    assert closed(peer)
    assert gate.parked == 0


def test_a_client_that_closed_while_parked_is_closed_without_a_transport(loop, pair):
    lot, gate = parking(loop)
    ours, peer = pair
    lot.park(ours.fileno(), loop.now + 60, 1.0)
    ours.close()
    [ready] = loop.readers.values()
    peer.close()

    ready()  # the loop saw the parked set readable

    assert gate.parked == 0
    loop.advance(60 + WHEEL_SLOT)  # its deadline's slot finds nothing left to close


def test_close_closes_every_parked_connection_and_stops_watching(loop):
    lot, gate = parking(loop)
    peers = []
    for _ in range(3):
        ours, peer = socket.socketpair()
        lot.park(ours.fileno(), loop.now + 60, 1.0)
        ours.close()
        peers.append(peer)
    assert gate.parked == 3

    lot.close()

    assert gate.parked == 0
    assert loop.readers == {}
    assert all(closed(peer) for peer in peers)
    assert not lot.park(peers[0].fileno(), loop.now + 60, 1.0)  # closed: nothing parks any more
    for peer in peers:
        peer.close()


@pytest.mark.parametrize(
    ("parked_for", "waited", "next_wait"),
    [
        (0.5, 1.0, 2.0),  # back sooner than it had waited: parking it did not pay
        (1.5, 2.0, 4.0),
        (1.5, 1.0, 1.0),  # parked longer: the idle kind, the listener's delay again
        (30.0, 8.0, 1.0),
    ],
)
def test_a_connection_back_soon_from_parking_waits_longer_next_time(
    loop, pair, parked_for, waited, next_wait
):
    lot, gate = parking(loop)
    ours, peer = pair
    lot.park(ours.fileno(), loop.now + 60, waited)
    ours.close()
    loop.advance(parked_for)
    peer.sendall(b"GET / HTTP/1.1\r\n\r\n")

    loop.readers[next(iter(loop.readers))]()

    [(made, sock)] = loop.resumed
    assert isinstance(made, Made)
    assert made.park_after == next_wait
    assert gate.parked == 0
    sock.close()  # type: ignore[attr-defined]


def test_the_heap_is_trimmed_with_glibcs_malloc_trim(loop):
    lot, _ = parking(loop)
    lot._trim_heap()  # finds it, and calls it
    from gateway.proxy.parking import _malloc_trim

    assert _malloc_trim.function is not None
