"""What the two sides of a proxied request share: bodies on their way between them.

The client's side (``client``) and the upstream's (``connector``) never import each other;
each sees the other only through the protocols here:

- ``Producer``: the other side, paused while this one's socket buffer is over
  ``WRITE_HIGH_WATER`` (back-pressure, both ways);
- ``BodySink``: where a request body goes (the upstream connection of the current attempt);
- ``ResponseStream``: an answer's body on its way to a client (a ``ClientSide``), framed as
  its head said.

Invariant: a view of a read buffer is written at once, never held (``splice``).
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

from ..wire import http1

WRITE_HIGH_WATER: Final = 512 * 1024
"""Bytes queued for a socket before the other side is paused (asyncio's default is 64 KiB:
streaming a large body then pauses and resumes the other side every few dozen KiB)."""


class Producer(Protocol):
    """The other side, paused while this one cannot take more."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class BodySink(Protocol):
    """Where a request body goes: the upstream connection of the current attempt."""

    transport: asyncio.Transport | None
    """What ``body_data`` writes to (a spliced body's buffers wait until it sent them)."""

    def body_data(self, data: bytes | memoryview) -> None: ...
    def body_end(self) -> None: ...
    def body_error(self, exc: BaseException) -> None: ...


class ClientSide(Protocol):
    """The client connection an answer is written to."""

    @property
    def transport(self) -> asyncio.Transport | None: ...
    @property
    def writing_paused(self) -> bool:
        """Its transport holds more than ``WRITE_HIGH_WATER`` (its producer is paused)."""

    def write(self, data: bytes) -> None:
        """Write ``data`` (now, or with the loop turn's other writes)."""

    def flush(self) -> None:
        """Write what ``write`` holds now: before anything else uses the transport."""


class ResponseStream:
    """The body of one answer on its way to the client, framed as its head said."""

    __slots__ = ("bytes_out", "chunked", "conn")

    def __init__(self, conn: ClientSide, chunked: bool) -> None:
        self.conn = conn
        self.chunked = chunked
        self.bytes_out = 0

    def response_data(self, data: bytes | memoryview) -> None:
        transport = self._writing(len(data))
        if transport is not None:
            http1.write_body(transport, data, chunked=self.chunked)

    def relay(self, data: bytes, body: int) -> None:
        """Chunks as the upstream framed them (``wire.chunked``), ``body`` bytes of data in
        them: written as they came, with no new chunk header and no copy."""
        transport = self._writing(body)
        if transport is not None:
            transport.write(data)

    def _writing(self, body: int) -> asyncio.Transport | None:
        """The client's transport, what its connection holds written first (the head; a
        view of a read buffer is never held), ``body`` bytes counted; None if it is gone."""
        conn = self.conn
        transport = conn.transport
        if transport is None:
            return None
        self.bytes_out += body
        conn.flush()
        return transport

    def response_end(self) -> None:
        if self.chunked:
            self.conn.write(http1.LAST_CHUNK)
