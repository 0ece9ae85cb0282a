"""What the two sides of a proxied request share: bodies on their way between them.

The client's side (``http1_downstream``) and the upstream's (``connector``) never import each
other; each sees the other only through the protocols here:

- ``Producer``: the other side, paused while this one's socket buffer is over
  ``WRITE_HIGH_WATER`` (back-pressure, both ways);
- ``BodySink``: where a request body goes (the upstream connection of the current attempt);
- ``ResponseStream``: an answer's body on its way to a client (a ``ClientSide``), framed as
  its head said.

Invariants: a view of a read buffer is written at once, never held (``splice``). While an
answer's body is under way, only its ``ResponseStream`` writes to the client (a pipelined
request refused meanwhile is answered after it: ``ClientConnection._refuse``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Final, Protocol

from ..wire import http1
from .tokens import TokenCount

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

    def socket_fd(self) -> int:
        """The descriptor of its socket if bytes written to it reach the client as they are
        (not over TLS), else -1."""


_write: Final = os.write


class ResponseStream:
    """The body of one answer on its way to the client, framed as its head said.

    Relayed chunks (``relay``: a stream of server-sent events, most often) are written to
    the client's socket itself (``os.write``) while its transport holds nothing: uvloop's
    ``write`` of a small bytes object costs about as much user time again as the rest of
    the relay (nine calls, on a transport object a read of another stream has pushed out
    of the CPU's caches). Whatever the socket does not take at once goes to the transport,
    and so does everything after it until the transport holds nothing again: the bytes
    stay in order. Never over TLS (``socket_fd``), and never once the transport is closing:
    the connection was closed or cut off, and the transport drops what it is written then
    (its descriptor stays open until ``connection_lost``, so the socket would not).
    """

    __slots__ = ("bytes_out", "chunked", "clock", "conn", "direct", "fd", "head", "held", "tokens")

    def __init__(self, conn: ClientSide, chunked: bool, head: bytes = b"") -> None:
        self.conn = conn
        self.chunked = chunked
        self.head = head
        """The answer's head, as the codec made it, until ``write_head`` writes it."""
        self.bytes_out = 0
        self.held = False
        """The head went through the client's ``write``, which may hold it until the end of
        the loop's turn: the body's next write flushes it first."""
        self.direct: asyncio.Transport | None = None
        """The client's transport while it held nothing after the stream's last write: the
        next relay goes to the socket (unless the transport is closing). None: ask it."""
        self.fd = -2
        """The client's socket (``socket_fd``; -2: not asked yet)."""
        self.tokens: TokenCount | None = None
        """On a model path, what counts the body's tokens as it goes by (``scan``)."""
        self.clock: Callable[[], float] | None = None
        """The loop's time, read when ``tokens`` is fed."""

    def write_head(self, body: bytes = b"") -> None:
        """The answer's head, or its head and whole ``body``, written with the loop turn's
        other writes (``ClientSide.write``)."""
        head = self.head
        self.head = b""
        self.conn.write(head + body if body else head)
        self.held = True
        if body and self.tokens is not None:
            self.scan(body)

    def scan(self, data: bytes | memoryview) -> None:
        """Body bytes on their way to the client, read for ``tokens`` (if counted)."""
        tokens, clock = self.tokens, self.clock
        if tokens is not None and clock is not None:
            tokens.feed(data, clock())

    def response_data(self, data: bytes | memoryview) -> None:
        if self.tokens is not None:
            self.scan(data)  # before the write: a spliced view is free once written
        transport = self._writing(len(data))
        if transport is not None:
            http1.write_body(transport, data, chunked=self.chunked)
            self.direct = None  # (a spliced view's buffer is free once the transport sent it)

    def relay(self, data: bytes, body: int) -> None:
        """Chunks as the upstream framed them (``wire.chunked``), ``body`` bytes of data in
        them: written as they came, with no new chunk header and no copy."""
        transport = self.direct
        if transport is not None and not transport.is_closing():
            self.bytes_out += body  # (the client is there: its transport is not closing)
        else:
            transport = self._writing(body)
            if transport is None:
                return
            if not self._socket_takes(transport):
                transport.write(data)
                return
        try:
            sent = _write(self.fd, data)
        except OSError:
            sent = 0  # full, or the client is gone: the transport's write finds out which
        if sent < len(data):
            transport.write(data[sent:] if sent else data)
            self.direct = None

    def _socket_takes(self, transport: asyncio.Transport) -> bool:
        """Whether what comes next may be written to the client's socket itself: not over
        TLS, the transport not closing and holding nothing (then kept in ``direct``)."""
        fd = self.fd
        if fd == -2:
            fd = self.fd = self.conn.socket_fd()
        if fd < 0 or transport.is_closing() or transport.get_write_buffer_size():
            return False
        self.direct = transport
        return True

    def _writing(self, body: int) -> asyncio.Transport | None:
        """The client's transport, what its connection holds written first (the head; a
        view of a read buffer is never held), ``body`` bytes counted; None if it is gone."""
        conn = self.conn
        transport = conn.transport
        if transport is None:
            return None
        self.bytes_out += body
        if self.held:  # (before the body's first write: ``direct`` is not set yet)
            self.held = False
            conn.flush()
        return transport

    def response_end(self) -> None:
        if self.chunked:
            self.conn.write(http1.LAST_CHUNK)
