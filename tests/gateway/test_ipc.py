"""The channel to worker processes: framing, the end of the stream, and what is refused."""

from __future__ import annotations

import asyncio
import marshal
import struct
from enum import Enum

import pytest

from gateway.config import (
    AuthRouting,
    Hsts,
    ProxyConfig,
    RateLimit,
    RouteConfig,
    ServiceRouting,
    StickyConfig,
)
from gateway.observability.tally import RequestTally, Tally
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
    data = marshal.dumps(ipc.flatten({"not": "a message"}))
    with pytest.raises(TypeError, match="not an ipc message"):
        await ipc.receive(reader_of(struct.pack("!I", len(data)) + data))


def test_settings_of_every_kind_arrive_as_they_were_sent() -> None:
    """Nested records, enums, keyword-only fields, dicts with tuple keys, None and infinity."""
    routing = ServiceRouting(
        "web",
        RouteConfig(hosts=("a.example",), path_prefix="/api", hsts=Hsts(preload=True)),
        sticky=StickyConfig(cookie="route"),
        auth=AuthRouting(tokens={"k": "v"}),
        rate_limits=(RateLimit(path_prefix="/api", rps=2.5, burst=3),),
    )
    upstream = Upstream("a", "web", "::1", 9000, admin=AdminState.DRAINING, ejected=True)
    snapshot = PoolSnapshot.of("web", 3, [upstream], split=(2, 30))
    outcomes = {("web", 2, 200, None, ("connect",)): 4}
    durations = {("web", None): ((1, 0, 2), float("inf"))}
    tokens = {("web", 2): (((0, 1), 0.25), ((3, 0), 0.02), 17)}
    tally = Tally(outcomes, durations, {"web": ((1,), 0.5)}, tokens)
    report = ipc.Report(
        {("web", "a"): 2}, tally, 0, counts={"web": (1, 2)}, guards={"web": ({}, 0)}
    )
    for message in (ipc.Install(routing, snapshot), report):
        back = ipc.restore(marshal.loads(marshal.dumps(ipc.flatten(message))))
        assert back == message
        assert back.__class__ is message.__class__
    assert ipc.restore(ipc.flatten(upstream)).admin is AdminState.DRAINING
    assert ipc.restore(ipc.flatten(upstream)).address == "[::1]:9000"


class Color(Enum):
    RED = 1


def test_only_the_gateways_own_classes_are_made() -> None:
    """A message names each record's class: one outside the package is refused, not imported."""
    with pytest.raises(TypeError, match="not an ipc class"):
        ipc.restore(ipc.flatten(Color.RED))
    kind, _, *fields = ipc.flatten(Upstream("a", "web", "127.0.0.1", 9000))
    with pytest.raises(TypeError, match="not an ipc class"):
        ipc.restore((kind, "os:system", *fields))
    with pytest.raises(TypeError, match="holds a set"):
        ipc.flatten({1})
