"""WebSocket relay: after the upstream's 101, the two connections are spliced byte for byte.

Frames cross untouched, both ways, close frames included, so a close code and reason, pings
and pongs mean the same on both sides. The relay only follows the frame boundaries
(``FrameCursor``, no unmasking) to count payload bytes and to know where a frame of its own
may go in:

- a side that vanishes without a close handshake closes the other: 1001 (going away)
  towards the upstream, 1014 (bad gateway) towards the client;
- ``going_away()`` (a drain timeout, a shutdown) sends 1001 to both sides; each side's
  connection is closed once it answered with its close frame, or after
  ``WS_CLOSE_TIMEOUT``. A side in the middle of a frame at that moment is cut off instead
  (a frame cannot be interrupted).

Invariant: ``done`` resolves once both connections are closed; what crossed is in
``bytes_in`` (client to upstream) and ``bytes_out`` (upstream to client), payload bytes of
data frames.
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Protocol

WS_CLOSE_TIMEOUT = 10.0
"""How long a side may take to answer the relay's own close frame."""
GOING_AWAY = 1001
BAD_GATEWAY = 1014

_DATA_OPCODES = frozenset({0, 1, 2})
_CLOSE = 8


class Side(Protocol):
    """One of the two connections (``ClientConnection``, ``UpstreamConnection``)."""

    def write(self, data: bytes) -> None: ...
    def close_transport(self) -> None:
        """Close once what was written is sent."""

    def abort(self) -> None: ...


class FrameCursor:
    """Where one direction of a WebSocket stream is: in a header, a payload, or between."""

    __slots__ = ("_header", "_opcode", "_remaining", "closed", "payload")

    def __init__(self) -> None:
        self._header = b""
        self._remaining = 0
        self._opcode = 0
        self.payload = 0
        """Payload bytes of data frames seen so far."""
        self.closed = False
        """A close frame was seen whole."""

    @property
    def at_boundary(self) -> bool:
        return not self._header and not self._remaining

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._remaining:
                n = min(self._remaining, len(view))
                self._remaining -= n
                if self._opcode in _DATA_OPCODES:
                    self.payload += n
                view = view[n:]
                if not self._remaining and self._opcode == _CLOSE:
                    self.closed = True
                continue
            header = self._header + bytes(view[:14])
            size = _header_size(header)
            if size is None or len(header) < size:
                self._header = header
                return
            taken = size - len(self._header)
            self._header = b""
            view = view[taken:]
            self._opcode = header[0] & 0x0F
            self._remaining = _payload_length(header)
            if not self._remaining and self._opcode == _CLOSE:
                self.closed = True


def _header_size(header: bytes) -> int | None:
    if len(header) < 2:
        return None
    length = header[1] & 0x7F
    size = 2 + (2 if length == 126 else 8 if length == 127 else 0)
    return size + (4 if header[1] & 0x80 else 0)


def _payload_length(header: bytes) -> int:
    length = header[1] & 0x7F
    if length == 126:
        return int(struct.unpack_from("!H", header, 2)[0])
    if length == 127:
        return int(struct.unpack_from("!Q", header, 2)[0])
    return length


def close_frame(code: int, *, masked: bool) -> bytes:
    """A close frame with ``code`` (masked: as a client must send it)."""
    payload = struct.pack("!H", code)
    if not masked:
        return bytes((0x88, len(payload))) + payload
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes((0x88, 0x80 | len(payload))) + mask + body


class Relay:
    """Splices a client connection and an upstream connection after a 101."""

    def __init__(self, client: Side, upstream: Side) -> None:
        self.client = client
        self.upstream = upstream
        self._to_upstream = FrameCursor()
        self._to_client = FrameCursor()
        self._client_open = True
        self._upstream_open = True
        self._going_away = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None
        self.closed_cleanly = False
        """Both sides closed with a close handshake the relay saw or made."""

    @property
    def bytes_in(self) -> int:
        return self._to_upstream.payload

    @property
    def bytes_out(self) -> int:
        return self._to_client.payload

    # -- data ---------------------------------------------------------------------------------

    def from_client(self, data: bytes) -> None:
        self._to_upstream.feed(data)
        if self._going_away:
            if self._to_upstream.closed:
                self._close_client()
            return
        if self._upstream_open:
            self.upstream.write(data)

    def from_upstream(self, data: bytes) -> None:
        self._to_client.feed(data)
        if self._going_away:
            if self._to_client.closed:
                self._close_upstream()
            return
        if self._client_open:
            self.client.write(data)

    # -- ends ---------------------------------------------------------------------------------

    def client_lost(self) -> None:
        self._client_open = False
        if self._upstream_open:
            if not self._to_upstream.closed and not self._going_away:
                # The client vanished without a close frame: tell the upstream it went away.
                if self._to_upstream.at_boundary:
                    self.upstream.write(close_frame(GOING_AWAY, masked=True))
            self._close_upstream()
        self._check_done()

    def upstream_lost(self) -> None:
        self._upstream_open = False
        if self._client_open:
            if not self._to_client.closed and not self._going_away:
                if self._to_client.at_boundary:
                    self.client.write(close_frame(BAD_GATEWAY, masked=False))
            self._close_client()
        self._check_done()

    def going_away(self) -> None:
        """Close both sides with 1001 (a drain timeout, a shutdown)."""
        if self._going_away or self.done.done():
            return
        self._going_away = True
        for open_, cursor, side, masked in (
            (self._upstream_open, self._to_upstream, self.upstream, True),
            (self._client_open, self._to_client, self.client, False),
        ):
            if not open_:
                continue
            if cursor.at_boundary and not cursor.closed:
                side.write(close_frame(GOING_AWAY, masked=masked))
            else:
                side.abort()
        self._timer = asyncio.get_running_loop().call_later(WS_CLOSE_TIMEOUT, self._give_up)

    def _give_up(self) -> None:
        self._timer = None
        if self._client_open:
            self.client.abort()
        if self._upstream_open:
            self.upstream.abort()

    def _close_client(self) -> None:
        if self._client_open:
            self.client.close_transport()

    def _close_upstream(self) -> None:
        if self._upstream_open:
            self.upstream.close_transport()

    def _check_done(self) -> None:
        if self._client_open or self._upstream_open:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.closed_cleanly = self._going_away or (
            self._to_client.closed and self._to_upstream.closed
        )
        if not self.done.done():
            self.done.set_result(None)

    def __repr__(self) -> str:
        return (
            f"<Relay client_open={self._client_open} upstream_open={self._upstream_open} "
            f"in={self.bytes_in} out={self.bytes_out}>"
        )
