"""The channel to worker processes: framing, the end of the stream, and what is refused."""

from __future__ import annotations

import asyncio
import pickle
import struct

import pytest

from gateway.config import ProxyConfig
from gateway.observability.tally import RequestTally
from gateway.pool.snapshot import PoolSnapshot
from gateway.pool.upstream import AdminState, Upstream
from gateway.workers import ipc

from .conftest import routing


def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_messages_arrive_whole_and_in_order() -> None:
    upstream = Upstream("a", "web", "127.0.0.1", 9000, admin=AdminState.DRAINING)
    install = ipc.Install(routing("web", prefix="/"), PoolSnapshot.of("web", 7, [upstream]))
    messages: list[ipc.ToWorker | ipc.FromWorker] = [
        ipc.Setup(0, ProxyConfig(), "127.0.0.1", 8080, None, "info", 1.0, (install,)),
        install,
        ipc.Idle("web", "a", 7),
        ipc.Report({("web", "a"): 2}, RequestTally().take(), 3),
        ipc.Stop(),
    ]
    reader = reader_of(b"".join(ipc.encode(m) for m in messages))
    assert [await ipc.receive(reader) for _ in messages] == messages
    assert await ipc.receive(reader) is None  # the other side is gone


async def test_a_message_cut_short_is_the_end_of_the_stream() -> None:
    data = ipc.encode(ipc.Idle("web", "a", 7))
    assert await ipc.receive(reader_of(data[:-3])) is None
    assert await ipc.receive(reader_of(data[:2])) is None


async def test_a_length_beyond_the_bound_is_refused_before_reading_it() -> None:
    reader = reader_of(struct.pack("!I", ipc.MAX_MESSAGE + 1), eof=False)
    with pytest.raises(ValueError, match="exceeds"):
        await ipc.receive(reader)


async def test_anything_but_a_message_is_refused() -> None:
    data = pickle.dumps({"not": "a message"})
    with pytest.raises(TypeError, match="not an ipc message"):
        await ipc.receive(reader_of(struct.pack("!I", len(data)) + data))
