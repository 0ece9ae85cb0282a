"""An HTTP/2 connection's protocol state (RFC 9113), compiled: the frames both ways, the
streams' states, both sides' flow-control windows, SETTINGS, and the checks of what a peer
sends, for the gateway's two HTTP/2 legs (``proxy.h2_downstream`` as the server,
``proxy.h2_upstream`` as the client). Its own in place of the ``h2`` library's
``H2Connection``: ``h2`` and ``hyperframe`` took two thirds of the gateway's CPU a request
over HTTP/2 (bench/RESULTS.md ``h2-session``).

A ``Session`` does no I/O: ``receive`` takes bytes as they are read and gives the events they
make, the ``send_*`` calls queue frames, ``take`` gives what is to be written. HPACK is
``hpack_codec``'s. A peer's connection error raises ``ProtocolError`` from ``receive`` with
the GOAWAY already queued, after which the session takes nothing more; a stream error
(a malformed head, a body longer or shorter than its Content-Length, a frame on a stream
that is closed) resets that stream alone, with a ``StreamReset`` event if the stream was
reported.

What it checks of a peer's frames: sizes (over our SETTINGS_MAX_FRAME_SIZE: refused at the
frame's header, before its body is buffered), stream identifiers and states, padding,
windows (a peer that sends beyond them: FLOW_CONTROL_ERROR), SETTINGS values, header blocks
(CONTINUATION frames only, at most ``MAX_CONTINUATIONS`` of them; HPACK errors are a
COMPRESSION_ERROR, a list over ``max_header_list_size`` ENHANCE_YOUR_CALM), and heads
(RFC 9113 8.2, 8.3: lower-case names, no connection-specific field, pseudo-fields known,
once each, before the others; the ones a request or an answer must have). Streams a server
is sent beyond its ``max_concurrent_streams`` are refused (REFUSED_STREAM), as nginx does,
with their heads still decoded (HPACK's state is the connection's).

Windows: ours open again as the owner acknowledges what it took (``acknowledge``), with a
WINDOW_UPDATE once half a window was taken; the peer's bound what ``send_data`` may send
(``send_window``), which the owner asks before each DATA frame.
"""

from __future__ import annotations

from typing import Final, NoReturn

from .hpack_codec import Decoder, Encoder, HPACKError, OversizedHeaderListError
from .http2 import CONNECTION_SPECIFIC, PREFACE, Fields

# Frame types (RFC 9113 6).
DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

# Flags.
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# Error codes (RFC 9113 7).
NO_ERROR: Final = 0x0
PROTOCOL_ERROR: Final = 0x1
INTERNAL_ERROR: Final = 0x2
FLOW_CONTROL_ERROR: Final = 0x3
SETTINGS_TIMEOUT: Final = 0x4
STREAM_CLOSED: Final = 0x5
FRAME_SIZE_ERROR: Final = 0x6
REFUSED_STREAM: Final = 0x7
CANCEL: Final = 0x8
COMPRESSION_ERROR: Final = 0x9
CONNECT_ERROR: Final = 0xA
ENHANCE_YOUR_CALM: Final = 0xB

# Settings (RFC 9113 6.5.2).
HEADER_TABLE_SIZE: Final = 0x1
ENABLE_PUSH: Final = 0x2
MAX_CONCURRENT_STREAMS: Final = 0x3
INITIAL_WINDOW_SIZE: Final = 0x4
MAX_FRAME_SIZE: Final = 0x5
MAX_HEADER_LIST_SIZE: Final = 0x6

DEFAULT_WINDOW: Final = 65535
DEFAULT_FRAME_SIZE: Final = 16384
MAX_WINDOW: Final = 2**31 - 1
MAX_FRAME_LIMIT: Final = 2**24 - 1
UNLIMITED: Final = 2**31
"""A peer's SETTINGS_MAX_CONCURRENT_STREAMS until it sets one."""
MAX_CONTINUATIONS: Final = 64
"""CONTINUATION frames a header block may take (CVE-2024-27316: a block that never ends)."""

REQUEST_PSEUDO: Final = frozenset({b":method", b":scheme", b":authority", b":path"})
_FORBIDDEN_IN_NAME: Final = frozenset(b"\x00\r\n: ")
_FORBIDDEN_IN_VALUE: Final = frozenset(b"\x00\r\n")


class ProtocolError(Exception):
    """A connection error (raised by ``receive``: GOAWAY with ``code`` is queued), or a call
    that the stream's state refuses (raised by a ``send_*``: nothing is queued)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Event:
    """Something a peer's frames said."""

    stream_id: int = 0


class RequestReceived(Event):
    """A request head (a server's session): ``end_stream``: no body follows."""

    def __init__(self, stream_id: int, headers: Fields, end_stream: bool) -> None:
        self.stream_id = stream_id
        self.headers = headers
        self.end_stream = end_stream


class ResponseReceived(Event):
    """An answer's final head (a client's session)."""

    def __init__(self, stream_id: int, headers: Fields, end_stream: bool) -> None:
        self.stream_id = stream_id
        self.headers = headers
        self.end_stream = end_stream


class InformationalResponseReceived(Event):
    """A 1xx head before the answer's (a client's session)."""

    def __init__(self, stream_id: int, headers: Fields) -> None:
        self.stream_id = stream_id
        self.headers = headers


class TrailersReceived(Event):
    """The trailers that end a stream."""

    def __init__(self, stream_id: int, headers: Fields) -> None:
        self.stream_id = stream_id
        self.headers = headers


class DataReceived(Event):
    """A DATA frame: ``flow_controlled_length`` is what it took of the windows (its
    padding too), to ``acknowledge`` once the data is taken."""

    def __init__(
        self, stream_id: int, data: bytes, flow_controlled_length: int, end_stream: bool
    ) -> None:
        self.stream_id = stream_id
        self.data = data
        self.flow_controlled_length = flow_controlled_length
        self.end_stream = end_stream


class StreamEnded(Event):
    """The peer ended its side of the stream (after the event of the frame that did)."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class StreamReset(Event):
    """The stream is closed by a reset: the peer's (``remote_reset``), or ours for its
    error."""

    def __init__(self, stream_id: int, error_code: int, remote_reset: bool) -> None:
        self.stream_id = stream_id
        self.error_code = error_code
        self.remote_reset = remote_reset


class WindowUpdated(Event):
    """The peer opened a window: the connection's (``stream_id`` 0) or a stream's."""

    def __init__(self, stream_id: int, delta: int) -> None:
        self.stream_id = stream_id
        self.delta = delta


class RemoteSettingsChanged(Event):
    """The peer's SETTINGS (acknowledged already): setting -> value."""

    def __init__(self, changed: dict[int, int]) -> None:
        self.changed = changed


class PriorityUpdated(Event):
    """A PRIORITY frame, or a head's priority (taken and not acted on)."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class ConnectionTerminated(Event):
    """GOAWAY from the peer: streams above ``last_stream_id`` were not taken."""

    def __init__(self, error_code: int, last_stream_id: int) -> None:
        self.error_code = error_code
        self.last_stream_id = last_stream_id


class Stream:
    """One stream's state: which sides are closed, its windows, its body's count."""

    def __init__(self, stream_id: int, send_window: int, receive_window: int) -> None:
        self.stream_id = stream_id
        self.local_closed = False
        """We sent END_STREAM."""
        self.remote_closed = False
        """The peer sent END_STREAM."""
        self.send_window = send_window
        self.receive_window = receive_window
        self.unacknowledged = 0
        """Bytes of the stream's window acknowledged by the owner, not yet announced."""
        self.pending = 0
        """Bytes of DATA told to the owner and not acknowledged yet: the connection's
        window has them back when the stream closes (nothing more of it is acknowledged)."""
        self.head_sent = False
        self.no_body = False
        """A HEAD request (a client's session): its answer has no body, whatever its
        Content-Length."""
        self.head_received = False
        """The peer's head (a request's, or an answer's final one) came."""
        self.reported = False
        """The owner knows of the stream: it opened it, or an event told of it."""
        self.expected = -1
        """The body's length by the peer's Content-Length, or -1."""
        self.received = 0
        """Body bytes the peer sent."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """One frame: its 9-byte header and ``payload``."""
    length = len(payload)
    return (
        bytes(
            (
                (length >> 16) & 0xFF,
                (length >> 8) & 0xFF,
                length & 0xFF,
                kind,
                flags,
                (stream_id >> 24) & 0x7F,
                (stream_id >> 16) & 0xFF,
                (stream_id >> 8) & 0xFF,
                stream_id & 0xFF,
            )
        )
        + payload
    )


def goaway_frame(last_stream_id: int, code: int) -> bytes:
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big"))


def rst_frame(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def window_frame(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def settings_frame(values: dict[int, int]) -> bytes:
    payload = b"".join(code.to_bytes(2, "big") + v.to_bytes(4, "big") for code, v in values.items())
    return frame(SETTINGS, 0, 0, payload)


class Session:
    """One HTTP/2 connection's state, as a server (``client_side`` false: the peer opens
    the streams) or as a client."""

    def __init__(
        self,
        client_side: bool,
        max_concurrent_streams: int = 100,
        max_header_list_size: int = 65536,
    ) -> None:
        self.client_side = client_side
        self.max_concurrent_streams = max_concurrent_streams
        """Ours: streams the peer may have open at once."""
        self.max_header_list_size = max_header_list_size
        self.encoder = Encoder()
        self.decoder = Decoder(max_header_list_size)
        self.streams: dict[int, Stream] = {}
        """Streams not closed on both sides."""
        self.highest_inbound_stream_id = 0
        """The highest stream the peer opened (a server's session)."""
        self.next_stream_id = 1
        """The next stream we open (a client's session)."""
        self.remote_max_concurrent_streams = UNLIMITED
        self.max_outbound_frame_size = DEFAULT_FRAME_SIZE
        """The peer's SETTINGS_MAX_FRAME_SIZE: the most a DATA frame of ours may carry."""
        self.max_inbound_frame_size = DEFAULT_FRAME_SIZE
        self._remote_initial_window = DEFAULT_WINDOW
        self._local_initial_window = DEFAULT_WINDOW
        self.send_window_connection = DEFAULT_WINDOW
        self._receive_window = DEFAULT_WINDOW
        self._unacknowledged = 0
        self._out: list[bytes] = []
        self._buffer = b""
        self._preface = len(PREFACE) if not client_side else 0
        """Bytes of the client's preface still to be read (a server's session)."""
        self._settled = False
        """The peer's SETTINGS came: its preface's last part, before any other frame."""
        self.terminated = False
        """GOAWAY was sent for an error, or the peer broke the protocol: nothing more is
        taken."""
        self.goaway_sent = False
        self._block = bytearray()
        self._block_stream = 0
        """The stream whose header block is open (CONTINUATION frames expected), or 0."""
        self._block_end = False
        self._block_priority = False
        self._continuations = 0
        self._events: list[Event] = []

    # -- the owner's calls ----------------------------------------------------------------

    def initiate(self) -> None:
        """Our side of the connection's start: the client's preface, then SETTINGS."""
        values = {
            MAX_CONCURRENT_STREAMS: self.max_concurrent_streams,
            INITIAL_WINDOW_SIZE: self._local_initial_window,
            MAX_HEADER_LIST_SIZE: self.max_header_list_size,
        }
        if self.client_side:
            values[ENABLE_PUSH] = 0
            self._out.append(PREFACE)
        self._out.append(settings_frame(values))

    @property
    def block_open(self) -> bool:
        """A header block began and did not end (CONTINUATION frames are due)."""
        return self._block_stream != 0

    def take(self) -> bytes:
        """The frames queued, to be written (and forgotten here)."""
        out = self._out
        if not out:
            return b""
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return data

    def open_stream(self) -> int:
        """A new stream of ours (a client's session): its identifier, for ``send_headers``."""
        stream_id = self.next_stream_id
        self.next_stream_id += 2
        stream = Stream(stream_id, self._remote_initial_window, self._local_initial_window)
        stream.reported = True  # (the owner opened it: it waits for its answer, or a reset)
        self.streams[stream_id] = stream
        return stream_id

    def send_headers(self, stream_id: int, fields: Fields, end_stream: bool = False) -> None:
        """A head (or trailers, with ``end_stream``) on ``stream_id``."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed or self.terminated:
            raise ProtocolError(STREAM_CLOSED, f"stream {stream_id} is closed")
        if not stream.head_sent:
            stream.head_sent = True
            if self.client_side and (b":method", b"HEAD") in fields:
                stream.no_body = True
        block = self.encoder.encode(fields)
        limit = self.max_outbound_frame_size
        flags = END_STREAM if end_stream else 0
        if len(block) <= limit:
            self._out.append(frame(HEADERS, flags | END_HEADERS, stream_id, block))
        else:
            self._out.append(frame(HEADERS, flags, stream_id, block[:limit]))
            at = limit
            while at < len(block):
                end = END_HEADERS if at + limit >= len(block) else 0
                self._out.append(frame(CONTINUATION, end, stream_id, block[at : at + limit]))
                at += limit
        if end_stream:
            self._local_end(stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """A DATA frame: ``data`` within ``send_window`` and the peer's frame size."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed or self.terminated:
            raise ProtocolError(STREAM_CLOSED, f"stream {stream_id} is closed")
        size = len(data)
        if size > stream.send_window or size > self.send_window_connection:
            raise ProtocolError(FLOW_CONTROL_ERROR, "DATA beyond the peer's window")
        if size > self.max_outbound_frame_size:
            raise ProtocolError(FRAME_SIZE_ERROR, "DATA beyond the peer's frame size")
        stream.send_window -= size
        self.send_window_connection -= size
        self._out.append(frame(DATA, END_STREAM if end_stream else 0, stream_id, data))
        if end_stream:
            self._local_end(stream)

    def end_stream(self, stream_id: int) -> None:
        """END_STREAM on an empty DATA frame."""
        self.send_data(stream_id, b"", True)

    def reset_stream(self, stream_id: int, code: int) -> None:
        """RST_STREAM: the stream is closed (no event for it)."""
        if self.terminated:
            raise ProtocolError(STREAM_CLOSED, "the connection is closed")
        stream = self.streams.get(stream_id)
        if stream is None:
            raise ProtocolError(STREAM_CLOSED, f"stream {stream_id} is closed")
        self._out.append(rst_frame(stream_id, code))
        self._close(stream)

    def send_window(self, stream_id: int) -> int:
        """What may be sent on ``stream_id`` now: the least of its window and the
        connection's (0 for a stream that is closed)."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return 0
        window = stream.send_window
        connection = self.send_window_connection
        return window if window < connection else connection

    def sendable(self, stream_id: int) -> int:
        """The most one DATA frame on ``stream_id`` may carry now: ``send_window`` within
        the peer's SETTINGS_MAX_FRAME_SIZE."""
        window = self.send_window(stream_id)
        limit = self.max_outbound_frame_size
        return window if window < limit else limit

    def acknowledge(self, stream_id: int, size: int) -> None:
        """``size`` bytes the peer sent on ``stream_id`` were taken: its window and the
        connection's open again (WINDOW_UPDATE once half a window is due)."""
        stream = self.streams.get(stream_id)
        if stream is None or size <= 0:
            return  # (a closed stream's were given back as it closed: ``_close``)
        taken = size if size < stream.pending else stream.pending
        stream.pending -= taken
        self._credit(taken)
        if stream.remote_closed:
            return
        stream.unacknowledged += size
        if stream.unacknowledged >= self._local_initial_window // 2 or stream.receive_window < 1024:
            increment = stream.unacknowledged
            stream.unacknowledged = 0
            stream.receive_window += increment
            self._out.append(window_frame(stream_id, increment))

    def goaway(self, code: int, last_stream_id: int = -1) -> None:
        """GOAWAY: with NO_ERROR, the open streams go on (a drain); with an error, the
        session takes nothing more."""
        if self.terminated:
            return
        last = self.highest_inbound_stream_id if last_stream_id < 0 else last_stream_id
        self._out.append(goaway_frame(last, code))
        self.goaway_sent = True
        if code != NO_ERROR:
            self.terminated = True

    # -- the peer's frames ----------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """The events the frames in ``data`` make (a frame cut short waits for the next
        read). Raises ``ProtocolError`` for a connection error, its GOAWAY queued."""
        if self.terminated:
            return []
        events: list[Event] = []
        self._events = events
        buffer = self._buffer + data if self._buffer else data
        at = 0
        size = len(buffer)
        if self._preface:
            step = min(self._preface, size)
            offset = len(PREFACE) - self._preface
            if buffer[:step] != PREFACE[offset : offset + step]:
                self._fail(PROTOCOL_ERROR, "invalid connection preface")
            self._preface -= step
            at = step
        try:
            while at + 9 <= size:
                length = (buffer[at] << 16) | (buffer[at + 1] << 8) | buffer[at + 2]
                if length > self.max_inbound_frame_size:
                    self._fail(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = at + 9 + length
                if end > size:
                    break
                kind = buffer[at + 3]
                flags = buffer[at + 4]
                stream_id = int.from_bytes(buffer[at + 5 : at + 9], "big") & 0x7FFFFFFF
                self._frame(kind, flags, stream_id, buffer[at + 9 : end])
                at = end
        finally:
            self._buffer = buffer[at:] if at < size else b""
        return events

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if not self._settled:
            if kind != SETTINGS or flags & ACK:
                self._fail(PROTOCOL_ERROR, "the preface's SETTINGS did not come first")
            self._settled = True
        if self._block_stream:
            if kind != CONTINUATION or stream_id != self._block_stream:
                self._fail(PROTOCOL_ERROR, "a frame inside a header block")
            self._continuation(flags, payload)
        elif kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == PRIORITY:
            self._priority(stream_id, payload)
        elif kind == RST_STREAM:
            self._rst(stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == PING:
            if stream_id:
                self._fail(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                self._fail(FRAME_SIZE_ERROR, "PING of the wrong size")
            if not flags & ACK:
                self._out.append(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            if stream_id:
                self._fail(PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                self._fail(FRAME_SIZE_ERROR, "GOAWAY too short")
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            code = int.from_bytes(payload[4:8], "big")
            self._events.append(ConnectionTerminated(code, last))
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == CONTINUATION:
            self._fail(PROTOCOL_ERROR, "CONTINUATION without a header block")
        elif kind == PUSH_PROMISE:
            self._fail(PROTOCOL_ERROR, "PUSH_PROMISE, which was not allowed")
        # (other types: ignored, RFC 9113 5.5)

    def _fail(self, code: int, message: str) -> NoReturn:
        """A connection error: GOAWAY, and nothing more is taken."""
        if not self.terminated:
            self._out.append(goaway_frame(self.highest_inbound_stream_id, code))
            self.terminated = self.goaway_sent = True
        raise ProtocolError(code, message)

    def _closed_stream(self, stream_id: int) -> bool:
        """Whether ``stream_id`` (not in ``streams``) was open once: else it is idle."""
        if self.client_side:
            return stream_id % 2 == 1 and stream_id < self.next_stream_id
        return stream_id <= self.highest_inbound_stream_id

    def _reset(self, stream: Stream, code: int) -> None:
        """A stream error of the peer's: RST_STREAM, and an event if the owner knows it."""
        self._out.append(rst_frame(stream.stream_id, code))
        self._close(stream)
        if stream.reported:
            self._events.append(StreamReset(stream.stream_id, code, False))

    def _credit(self, size: int) -> None:
        """``size`` bytes of the connection's window are ours again: WINDOW_UPDATE once half
        of it is due, or once it ran low."""
        if size <= 0:
            return
        self._unacknowledged += size
        if self._unacknowledged >= DEFAULT_WINDOW // 2 or self._receive_window < 1024:
            increment = self._unacknowledged
            self._unacknowledged = 0
            self._receive_window += increment
            self._out.append(window_frame(0, increment))

    def _close(self, stream: Stream) -> None:
        """The stream is closed: forgotten, and what of its DATA the owner did not
        acknowledge given back to the connection's window."""
        self.streams.pop(stream.stream_id, None)
        pending = stream.pending
        if pending:
            stream.pending = 0
            self._credit(pending)

    # DATA

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            self._fail(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        data = self._unpad(flags, payload)
        self._receive_window -= size
        if self._receive_window < 0:
            self._fail(FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed or not stream.head_received:
            if stream is None and not self._closed_stream(stream_id):
                self._fail(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self._credit(size)  # (the connection's window: nobody else will)
            if stream is None:
                self._out.append(rst_frame(stream_id, STREAM_CLOSED))
            else:
                self._reset(stream, STREAM_CLOSED if stream.remote_closed else PROTOCOL_ERROR)
            return
        stream.receive_window -= size
        if stream.receive_window < 0:
            self._fail(FLOW_CONTROL_ERROR, f"DATA beyond stream {stream_id}'s window")
        stream.received += len(data)
        end = bool(flags & END_STREAM)
        expected = stream.expected
        if expected >= 0 and (stream.received > expected or (end and stream.received != expected)):
            self._credit(size)
            self._reset(stream, PROTOCOL_ERROR)
            return
        stream.pending += size
        self._events.append(DataReceived(stream_id, data, size, end))
        if end:
            self._remote_end(stream)

    def _unpad(self, flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload:
            self._fail(FRAME_SIZE_ERROR, "a padded frame without its pad length")
        pad = payload[0]
        if pad >= len(payload):
            self._fail(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - pad]

    # HEADERS and CONTINUATION

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            self._fail(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload)
        priority = bool(flags & PRIORITY_FLAG)
        if priority:
            if len(block) < 5:
                self._fail(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            dependency = int.from_bytes(block[:4], "big") & 0x7FFFFFFF
            if dependency == stream_id:
                self._fail(PROTOCOL_ERROR, "a stream depends on itself")
            block = block[5:]
        if flags & END_HEADERS:
            self._head(stream_id, block, bool(flags & END_STREAM), priority)
            return
        self._block = bytearray(block)
        self._block_stream = stream_id
        self._block_end = bool(flags & END_STREAM)
        self._block_priority = priority
        self._continuations = 0

    def _continuation(self, flags: int, payload: bytes) -> None:
        self._continuations += 1
        if self._continuations > MAX_CONTINUATIONS:
            self._fail(PROTOCOL_ERROR, "too many CONTINUATION frames")
        self._block += payload
        if flags & END_HEADERS:
            stream_id = self._block_stream
            block = bytes(self._block)
            self._block = bytearray()
            self._block_stream = 0
            self._head(stream_id, block, self._block_end, self._block_priority)

    def _decode(self, block: bytes) -> Fields:
        try:
            return self.decoder.decode(block, True)
        except OversizedHeaderListError:
            self._fail(ENHANCE_YOUR_CALM, "a header list over its limit")
        except HPACKError as exc:
            self._fail(COMPRESSION_ERROR, f"a header block that does not decode: {exc}")

    def _head(self, stream_id: int, block: bytes, end: bool, priority: bool) -> None:
        """A whole header block on ``stream_id``: a head, or trailers."""
        fields = self._decode(block)  # always: HPACK's table is the connection's
        stream = self.streams.get(stream_id)
        if stream is None:
            if self._closed_stream(stream_id):
                self._out.append(rst_frame(stream_id, STREAM_CLOSED))
                return
            if self.client_side:
                self._fail(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, never opened")
            if stream_id % 2 == 0:
                self._fail(PROTOCOL_ERROR, f"a client opened even stream {stream_id}")
            self.highest_inbound_stream_id = stream_id
            if self.goaway_sent:
                self._out.append(rst_frame(stream_id, REFUSED_STREAM))
                return
            if len(self.streams) >= self.max_concurrent_streams:
                self._out.append(rst_frame(stream_id, REFUSED_STREAM))
                return
            stream = Stream(stream_id, self._remote_initial_window, self._local_initial_window)
            self.streams[stream_id] = stream
        elif stream.remote_closed:
            self._reset(stream, STREAM_CLOSED)
            return
        if priority:
            self._events.append(PriorityUpdated(stream_id))
        if stream.head_received:  # trailers
            if not end:
                self._fail(PROTOCOL_ERROR, "a second head without END_STREAM")
            if not valid_trailers(fields) or (
                stream.expected >= 0 and stream.received != stream.expected
            ):
                self._reset(stream, PROTOCOL_ERROR)
                return
            self._events.append(TrailersReceived(stream_id, fields))
            self._remote_end(stream)
            return
        if self.client_side:
            status = response_status(fields)
            if status < 0:
                self._reset(stream, PROTOCOL_ERROR)
                return
            if status < 200:
                if end:
                    self._reset(stream, PROTOCOL_ERROR)
                    return
                self._events.append(InformationalResponseReceived(stream_id, fields))
                stream.reported = True
                return
            stream.expected = -1 if stream.no_body else content_length(fields, status)
            if stream.expected == -2:
                self._reset(stream, PROTOCOL_ERROR)
                return
            stream.head_received = stream.reported = True
            if stream.expected > 0 and end:
                self._reset(stream, PROTOCOL_ERROR)
                return
            self._events.append(ResponseReceived(stream_id, fields, end))
        else:
            cookies = request_cookies(fields)
            if cookies < 0:
                self._reset(stream, PROTOCOL_ERROR)
                return
            if cookies > 1:
                fields = join_cookies(fields)
            stream.expected = content_length(fields, 0)
            if stream.expected == -2 or (stream.expected > 0 and end):
                self._reset(stream, PROTOCOL_ERROR)
                return
            stream.head_received = stream.reported = True
            self._events.append(RequestReceived(stream_id, fields, end))
        if end:
            self._remote_end(stream)

    # the others

    def _priority(self, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            self._fail(PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            self._fail(FRAME_SIZE_ERROR, "PRIORITY of the wrong size")
        if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
            self._fail(PROTOCOL_ERROR, "a stream depends on itself")
        self._events.append(PriorityUpdated(stream_id))

    def _rst(self, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            self._fail(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            self._fail(FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        stream = self.streams.get(stream_id)
        if stream is None:
            if not self._closed_stream(stream_id):
                self._fail(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
            return
        self._close(stream)
        code = int.from_bytes(payload, "big")
        self._events.append(StreamReset(stream_id, code, True))

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            self._fail(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                self._fail(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            self._fail(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        changed: dict[int, int] = {}
        for at in range(0, len(payload), 6):
            code = (payload[at] << 8) | payload[at + 1]
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if code == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    self._fail(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
                delta = value - self._remote_initial_window
                self._remote_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        self._fail(FLOW_CONTROL_ERROR, "a window over its limit")
            elif code == MAX_FRAME_SIZE:
                if value < DEFAULT_FRAME_SIZE or value > MAX_FRAME_LIMIT:
                    self._fail(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.max_outbound_frame_size = value
            elif code == MAX_CONCURRENT_STREAMS:
                self.remote_max_concurrent_streams = value
            elif code == HEADER_TABLE_SIZE:
                self.encoder.header_table_size = value
            elif code == ENABLE_PUSH:
                if value > 1 or (value and self.client_side):  # (a server's must be 0)
                    self._fail(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
            else:
                continue
            changed[code] = value
        self._out.append(frame(SETTINGS, ACK, 0, b""))
        self._events.append(RemoteSettingsChanged(changed))

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                self._fail(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.send_window_connection += increment
            if self.send_window_connection > MAX_WINDOW:
                self._fail(FLOW_CONTROL_ERROR, "the connection's window over its limit")
            self._events.append(WindowUpdated(0, increment))
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if not self._closed_stream(stream_id):
                self._fail(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
            return
        if not increment:
            self._reset(stream, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._reset(stream, FLOW_CONTROL_ERROR)
            return
        self._events.append(WindowUpdated(stream_id, increment))

    # -- streams' ends --------------------------------------------------------------------

    def _local_end(self, stream: Stream) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            self._close(stream)

    def _remote_end(self, stream: Stream) -> None:
        stream.remote_closed = True
        self._events.append(StreamEnded(stream.stream_id))
        if stream.local_closed:
            self._close(stream)


def valid_name(name: bytes) -> bool:
    """A regular field's name: lower-case token characters (RFC 9113 8.2.1)."""
    if not name:
        return False
    for octet in name:
        if (0x41 <= octet <= 0x5A) or octet in _FORBIDDEN_IN_NAME or octet < 0x21 or octet > 0x7E:
            return False
    return True


def valid_value(value: bytes) -> bool:
    """A field's value: no NUL, CR or LF, and no white space at either end."""
    if not value:
        return True
    for octet in value:
        if octet in _FORBIDDEN_IN_VALUE:
            return False
    first = value[0]
    last = value[-1]
    return first != 0x20 and first != 0x09 and last != 0x20 and last != 0x09


def visible(value: bytes) -> bool:
    """No white space, control character or DEL in ``value`` (what a request line's words
    may not hold; octets over 0x7F are let through, as the HTTP/1.1 listener lets them)."""
    for octet in value:
        if octet <= 0x20 or octet == 0x7F:
            return False
    return True


def request_cookies(fields: Fields) -> int:
    """How many ``cookie`` fields a request head has, or -1 if it is not a request head
    (RFC 9113 8.3.1): the pseudo-fields of a request, once each and first, ``:method``,
    ``:scheme`` and a non-empty ``:path`` (CONNECT: ``:authority`` alone); every value
    well-formed (8.2.1, pseudo-fields' too: a CR or LF in ``:path`` would split the
    HTTP/1.1 head it becomes), and no white space or control character in ``:method``
    and ``:path`` (they become the HTTP/1.1 request line: a space in ``:path`` would add
    a word to it; an ``:authority`` that is no host[:port] is the codec's 400, as a Host
    is); regular names well-formed, none connection-specific, ``te`` only ``trailers``,
    a Host that names what ``:authority`` does."""
    seen: set[bytes] = set()
    regular = False
    method = b""
    authority = b""
    host = b""
    cookies = 0
    for name, value in fields:
        if name[:1] == b":":
            if regular or name not in REQUEST_PSEUDO or name in seen:
                return -1
            if not (valid_value(value) if name == b":authority" else visible(value)):
                return -1
            seen.add(name)
            if name == b":method":
                method = value
            elif name == b":authority":
                authority = value
            elif name == b":path" and not value:
                return -1
            continue
        regular = True
        if not valid_name(name) or not valid_value(value):
            return -1
        if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            return -1
        if name == b"cookie":
            cookies += 1
        elif name == b"host":
            host = value
    if b":method" not in seen or (host and authority and host != authority):
        return -1
    if method == b"CONNECT":
        if b":scheme" in seen or b":path" in seen or b":authority" not in seen:
            return -1
    elif b":scheme" not in seen or b":path" not in seen:
        return -1
    return cookies


def join_cookies(fields: Fields) -> Fields:
    """A request's ``cookie`` fields as one, joined with "; " (RFC 9113 8.2.3), where the
    first was: what an HTTP/1.1 upstream is to be sent."""
    joined = b"; ".join(value for name, value in fields if name == b"cookie")
    out: Fields = []
    for name, value in fields:
        if name == b"cookie":
            if joined:
                out.append((name, joined))
                joined = b""
        else:
            out.append((name, value))
    return out


def response_status(fields: Fields) -> int:
    """An answer head's status (RFC 9113 8.3.2): ``:status`` alone among the pseudo-fields,
    first and once; regular fields well-formed. -1 for a head that is not one."""
    status = -1
    regular = False
    for name, value in fields:
        if name[:1] == b":":
            if regular or name != b":status" or status >= 0:
                return -1
            if len(value) != 3 or not value.isdigit():
                return -1
            status = int(value)
            continue
        regular = True
        if not valid_name(name) or not valid_value(value):
            return -1
        if name in CONNECTION_SPECIFIC:
            return -1
    return status


def valid_trailers(fields: Fields) -> bool:
    """Trailers: no pseudo-field, regular fields well-formed, none connection-specific (so
    that they go to an HTTP/2 upstream as they came)."""
    for name, value in fields:
        if name[:1] == b":" or not valid_name(name) or not valid_value(value):
            return False
        if name in CONNECTION_SPECIFIC:
            return False
    return True


def content_length(fields: Fields, status: int) -> int:
    """The body's length a head announces (-1: none; -2: a Content-Length that is no
    number, or two that differ). An answer to HEAD, 204 and 304 have no body whatever
    their Content-Length: -1."""
    if status == 204 or status == 304:
        return -1
    length = -1
    for name, value in fields:
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18:
                return -2
            n = int(value)
            if length >= 0 and n != length:
                return -2
            length = n
    return length
