"""Writes held to the end of the loop's turn: the turn's first goes at once, the rest go
together and in order, and nothing else reaches a transport before what it holds."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import ListenerLimits
from gateway.proxy.connector import Connector
from gateway.proxy.http1_downstream import ClientConnection, ConnectionGate
from gateway.proxy.streams import ResponseStream
from gateway.wire.batch import WriteBatch

from .conftest import add, routing


async def end_of_turn() -> None:
    """Wait until the callbacks scheduled so far ran (the batch's end of turn among them)."""
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done


class _Holder:
    def __init__(self, name: str, flushed: list[str], fails: bool = False) -> None:
        self.name = name
        self.flushed = flushed
        self.fails = fails

    def flush(self) -> None:
        self.flushed.append(self.name)
        if self.fails:
            raise RuntimeError("transport gone")


IN_FLIGHT = ("a request", "another")
"""Two requests in flight: writes of one turn are batched (``WriteBatch(in_flight)``)."""


async def test_the_first_write_of_a_turn_goes_at_once_and_the_rest_at_its_end():
    batch = WriteBatch(IN_FLIGHT)
    flushed: list[str] = []
    a, b, c = (_Holder(name, flushed) for name in "abc")

    assert batch.hold(a) is False  # the first: written by its connection now
    assert batch.hold(b) is True
    assert batch.hold(c) is True
    assert flushed == []
    await end_of_turn()
    assert flushed == ["b", "c"]
    assert batch.held_writes == 2

    assert batch.hold(a) is False  # a new turn
    await end_of_turn()
    assert flushed == ["b", "c"]


async def test_with_one_request_in_flight_every_write_goes_at_once():
    batch = WriteBatch(["the only request"])
    flushed: list[str] = []
    assert [batch.hold(_Holder(name, flushed)) for name in "abc"] == [False, False, False]
    await end_of_turn()
    assert (flushed, batch.held_writes) == ([], 0)


async def test_one_failed_flush_does_not_keep_the_others_from_writing(caplog):
    batch = WriteBatch(IN_FLIGHT)
    flushed: list[str] = []
    batch.hold(_Holder("first", flushed))
    batch.hold(_Holder("broken", flushed, fails=True))
    batch.hold(_Holder("after", flushed))
    await end_of_turn()
    assert flushed == ["broken", "after"]
    assert "writing held bytes" in caplog.text


class _Transport:
    """Records what a connection does to it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes | memoryview) -> None:
        self.calls.append(("write", bytes(data)))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.calls.append(("write_eof", b""))

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _client() -> tuple[ClientConnection, _Transport]:
    async def handler(request: object) -> None:
        raise AssertionError("no request comes on this connection")

    conn = ClientConnection(
        handler, ListenerLimits(), ConnectionGate(1, WriteBatch(IN_FLIGHT)), set()
    )
    transport = _Transport()
    conn.transport = transport  # type: ignore[assignment]
    return conn, transport


async def test_a_connection_writes_what_it_holds_before_it_closes():
    conn, transport = _client()
    conn.write(b"first")  # the turn's first write: at once
    conn.write(b"second")
    conn.write(b"+third")  # joins what is held
    assert transport.calls == [("write", b"first")]
    conn.close()
    assert transport.calls == [("write", b"first"), ("write", b"second+third"), ("close", b"")]
    await end_of_turn()  # the batch finds nothing left to write
    assert len(transport.calls) == 3


@pytest.mark.parametrize("end", ["abort", "close_transport", "linger"])
async def test_every_way_to_end_a_connection_writes_what_it_holds_first(end):
    conn, transport = _client()
    conn.write(b"opens the turn")
    conn.write(b"held")
    {"abort": conn.abort, "close_transport": conn.close_transport, "linger": conn._linger}[end]()
    assert transport.calls[1] == ("write", b"held")
    assert transport.calls[2][0] in ("abort", "close", "write_eof")
    await end_of_turn()
    assert sum(call == ("write", b"held") for call in transport.calls) == 1


async def test_a_streamed_body_follows_its_held_head():
    conn, transport = _client()
    conn.write(b"opens the turn")
    stream = ResponseStream(conn, chunked=True)
    stream.write_head(b"HEAD\r\n\r\n")
    assert transport.calls[1:] == []  # held with the turn's other writes
    stream.response_data(memoryview(b"body"))  # a view of a read buffer: never held
    assert transport.calls[1:] == [("write", b"HEAD\r\n\r\n"), ("write", b"4\r\nbody\r\n")]


async def test_what_a_lost_connection_held_is_dropped():
    conn, transport = _client()
    conn.write(b"opens the turn")
    conn.write(b"held")
    conn.connection_lost(None)
    await end_of_turn()
    assert transport.calls == [("write", b"opens the turn")]


async def test_a_request_head_is_held_unless_a_body_follows_it():
    connector = Connector()
    conns, transports = [], []
    for _ in range(3):
        conn = connector.connection("127.0.0.1", 1)
        transport = _Transport()
        conn.transport = transport  # type: ignore[assignment]
        conns.append(conn)
        transports.append(transport)
    connector._busy.update(conns)  # what acquire does: three requests in flight
    send = {"chunked": False, "head_only": False, "read_timeout": 0, "now": 0.0}
    conns[0].send(b"GET /first", body=False, **send)  # type: ignore[arg-type]
    conns[1].send(b"POST /body-follows", body=True, **send)  # type: ignore[arg-type]
    conns[2].send(b"GET /held", body=False, **send)  # type: ignore[arg-type]
    assert [t.calls for t in transports] == [
        [("write", b"GET /first")],
        [("write", b"POST /body-follows")],
        [],
    ]
    await end_of_turn()
    assert transports[2].calls == [("write", b"GET /held")]


async def test_many_clients_at_once_each_get_their_own_answers_whole(raw_upstream, pool, gateway):
    """64 connections, 20 requests each (some pipelined, the last closing the connection):
    with many answers written in each turn, every answer is whole, in order, and its own."""

    async def serve(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(path), path))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    port = await raw_upstream(serve)
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", port)
    gw = await gateway()

    async def client(n: int) -> list[bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        paths = [b"/c%d/r%d" % (n, i) for i in range(20)]
        answers = []
        try:
            for i in range(0, 20, 2):  # two at a time: pipelined
                last = i == 18
                writer.write(
                    b"GET %b HTTP/1.1\r\nHost: h\r\n\r\n" % paths[i]
                    + b"GET %b HTTP/1.1\r\nHost: h\r\n%b\r\n"
                    % (paths[i + 1], b"Connection: close\r\n" if last else b"")
                )
                for _ in range(2):
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200")
                    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    answers.append(await reader.readexactly(length))
            assert await reader.read() == b""  # closed after the last answer, nothing more
        finally:
            writer.close()
        assert answers == paths
        return answers

    async with asyncio.timeout(20):
        await asyncio.gather(*(client(n) for n in range(64)))
    assert gw.proxy.connector.batch.held_writes > 0  # the batch was at work
