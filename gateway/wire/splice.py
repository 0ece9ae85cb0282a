"""Splicing a large body from one leg's socket to the other's without copying it in Python.

uvloop reads into a buffer of its own and copies each read into a new bytes object (up to
256 KiB: a memcpy and a malloc per read). A protocol that is an ``asyncio.BufferedProtocol``
names the buffer instead. While a large body framed by a Content-Length goes through (the
raw-body bypasses of ``proxy.http1_downstream`` and ``proxy.connector``), a leg's transport has a
``SplicedReads`` for protocol: each read goes into buffers of the body's own, and a
memoryview of it is written to the other leg's transport as it is. The rest of the time the
connection is a plain protocol again (``splice_reads``): for a small read uvloop's own copy
costs less than two more calls into Python per read. A read that cannot be spliced (no
transport to write to yet) goes into one scratch buffer (``Buffers.scratch``) and is copied
out at once, as uvloop does: a read and its ``buffer_updated`` are one step of one loop.

Invariant: uvloop's ``write`` keeps a memoryview of what it cannot send at once, without
copying it, so a buffer is read into again only once the transport holds nothing written
from it. The transport's queue is a FIFO: with the count of bytes written to it, what it
still holds (``get_write_buffer_size()``) tells which buffers are free. Back-pressure (the
other leg's high-water mark) bounds the buffers one body holds to a few.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, Protocol, cast

RAW_BODY_MIN: Final = 64 * 1024
"""Bodies framed by a Content-Length above this skip llhttp once their head is parsed, and
are spliced (both sides: ``proxy.http1_downstream`` for requests, ``proxy.connector`` for
answers)."""
READ_SIZE: Final = 256 * 1024
"""The scratch buffer: bytes read at once outside a splice (uvloop's own is as large)."""
SPLICE_SIZE: Final = 1024 * 1024
"""A splice buffer: bytes read at once while splicing. Fewer, larger reads and writes cost
less CPU than 256 KiB ones (bench/RESULTS.md `code-figures`)."""
SPARE_BUFFERS: Final = 4
"""Splice buffers kept for the next large body."""


class Buffers:
    """The read buffers of one event loop's connections: the scratch one, spare ones. One
    for both legs: the client connections share the connector's (``ConnectionGate``)."""

    __slots__ = ("_scratch", "_spare")

    def __init__(self) -> None:
        self._scratch: memoryview | None = None
        self._spare: list[memoryview] = []

    def scratch(self) -> memoryview:
        """Where reads that are copied out at once go: made at the first such read (a
        connection reads into it only while a large body may be spliced)."""
        view = self._scratch
        if view is None:
            view = self._scratch = memoryview(bytearray(READ_SIZE))
        return view

    def take(self) -> memoryview:
        if self._spare:
            return self._spare.pop()
        return memoryview(bytearray(SPLICE_SIZE))

    def give(self, view: memoryview) -> None:
        if len(self._spare) < SPARE_BUFFERS:
            self._spare.append(view)


class Reader:
    """Where one connection's reads go: the loop's scratch buffer, or the splice of the body
    under way. Both legs' ``get_buffer`` and ``buffer_updated`` are these two steps."""

    __slots__ = ("_buffers", "_splicing", "splice")

    def __init__(self, buffers: Buffers) -> None:
        self._buffers = buffers
        self.splice: Splice | None = None
        """The large body's splice, once it began; None between bodies."""
        self._splicing = False
        """The last ``buffer`` gave out a splice buffer (not the scratch one)."""

    def buffer(self, transport: asyncio.WriteTransport | None) -> memoryview:
        """Where the next read goes: the splice to ``transport``, or (None) the scratch."""
        if transport is None:
            self._splicing = False
            return self._buffers.scratch()
        if self.splice is None:
            self.splice = Splice(self._buffers)
        self._splicing = True
        return self.splice.buffer(transport)

    def spliced(self, nbytes: int, data_received: Callable[[bytes], object]) -> Splice | None:
        """A read of ``nbytes`` is in: the splice it went into (``view(nbytes)``), or None
        when it went into the scratch buffer, copied out to ``data_received`` (the next
        read reuses the buffer)."""
        if self._splicing and self.splice is not None:
            self._splicing = False
            return self.splice
        data_received(self._buffers.scratch()[:nbytes].tobytes())
        return None

    def end(self, transport: asyncio.WriteTransport | None) -> None:
        """The body ended: its splice closed (see ``Splice.close``)."""
        if self.splice is not None:
            self.splice.close(transport)
            self.splice = None


class Spliceable(Protocol):
    """A connection whose reads ``SplicedReads`` takes while a large body is spliced."""

    def read_into(self, sizehint: int) -> memoryview: ...
    def read_done(self, nbytes: int) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: BaseException | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


class SplicedReads(asyncio.BufferedProtocol):
    """A connection's protocol while a large body is spliced: uvloop reads into the buffer
    the connection names (``read_into``, ``read_done``); the rest goes to the connection."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Spliceable) -> None:
        self._conn = conn

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._conn.read_into(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._conn.read_done(nbytes)

    def eof_received(self) -> bool | None:
        return self._conn.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._conn.connection_lost(exc)

    def pause_writing(self) -> None:
        self._conn.pause_writing()

    def resume_writing(self) -> None:
        self._conn.resume_writing()


def splice_reads(
    transport: asyncio.Transport | None, conn: asyncio.Protocol, spliced: bool
) -> None:
    """Reads of ``transport`` go to a ``SplicedReads`` for ``conn`` (``spliced``) or to
    ``conn`` itself again. uvloop takes the change from the next read on."""
    if transport is not None and not transport.is_closing():
        transport.set_protocol(SplicedReads(cast(Spliceable, conn)) if spliced else conn)


class _Buffer:
    __slots__ = ("until", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.until = 0
        """The count of bytes written once the last ones written from here were."""


class Splice:
    """One body on its way to one transport: the buffers it is read into.

    ``buffer(transport)`` before each read; once read, ``view(n)`` is what to write and
    ``wrote(n)`` counts what was written from it; ``close`` at the end of the body.
    """

    __slots__ = ("_buffers", "_pool", "_reading", "_written")

    def __init__(self, pool: Buffers) -> None:
        self._pool = pool
        self._buffers: list[_Buffer] = []
        self._reading: _Buffer | None = None
        self._written = 0
        """Bytes written to the transport, counting those it held when the splice began:
        what it still holds is the end of this count."""

    def buffer(self, transport: asyncio.WriteTransport) -> memoryview:
        """A buffer the transport holds nothing from, to read into."""
        if not self._buffers:
            self._written = transport.get_write_buffer_size()
        sent = self._written - transport.get_write_buffer_size()
        for buffer in self._buffers:
            if buffer.until <= sent:
                break
        else:
            buffer = _Buffer(self._pool.take())
            self._buffers.append(buffer)
        self._reading = buffer
        return buffer.view

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of what was read into the last ``buffer()``."""
        assert self._reading is not None
        return self._reading.view[:nbytes]

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` of the last read went to the transport."""
        assert self._reading is not None
        self._written += nbytes
        self._reading.until = self._written

    def close(self, transport: asyncio.WriteTransport | None) -> None:
        """The body ended: buffers the transport holds nothing from go back to the pool
        (the others are left to it, and freed once sent). None: the transport is gone."""
        if transport is not None:
            sent = self._written - transport.get_write_buffer_size()
            for buffer in self._buffers:
                if buffer.until <= sent:
                    self._pool.give(buffer.view)
        self._buffers = []
        self._reading = None

    def __repr__(self) -> str:
        return f"<Splice buffers={len(self._buffers)} written={self._written}>"
