"""The client's side of the proxy over HTTP/2: one ``H2Connection`` (an asyncio protocol) per
client connection that speaks it, on a ``wire.h2_session.Session``.

A connection becomes one when the plain listener reads the HTTP/2 preface (h2c by prior
knowledge: ``ClientConnection`` hands its transport over, ``take_over``), or when a TLS
handshake chose ``h2`` by ALPN (``tls.transport``). Each stream the client opens is an
independent request (``h2_stream.H2Stream``, its ``Downstream``) served as an HTTP/1.1
request is: ``begin`` without a task if it can, else as a task of ``handler``; the upstream
leg stays HTTP/1.1. The session frames, decodes HPACK, checks the streams' states and keeps
the windows; this module feeds it, turns its events into requests and body pieces (a request's
trailers ride on its body: ``RequestBody.trailers``, relayed by an HTTP/2 upstream leg), and
sends what the streams queue as the client's windows allow.

Limits: at most ``http2.max_concurrent_streams`` streams open at once (a stream the client
opens beyond them is refused: RST_STREAM REFUSED_STREAM, as nginx does), a header list at
most ``http2.max_header_list_size`` bytes decoded, checked as it is decoded (an HPACK bomb:
GOAWAY ENHANCE_YOUR_CALM; and, by the session, at most 64 CONTINUATION frames), and each
head under the listener's own field limits (``request``: 431, 400), answered on its stream;
a field block that does not decode is a COMPRESSION_ERROR; a frame over
SETTINGS_MAX_FRAME_SIZE is refused at its header (FRAME_SIZE_ERROR); a malformed head is
refused on its stream (RST_STREAM PROTOCOL_ERROR); a request body that pauses past
``limits.body_timeout``, or averages under ``limits.body_min_rate`` once ``body_timeout``
has passed since it began, fails with 408 on its stream, as HTTP/1.1's does. Slow heads
(slowloris), as HTTP/1.1's ``header_timeout``: a connection's first request must come whole
within ``limits.header_timeout`` of its start (else GOAWAY NO_ERROR and closed), and a
header block (HEADERS, then CONTINUATION until END_HEADERS) within it of its first frame:
while a block is open the client may send nothing else on the connection (RFC 9113 6.10),
and a block cut short leaves HPACK's state undecodable, so an unfinished one ends the
connection (GOAWAY ENHANCE_YOUR_CALM), not its stream alone. Answers waiting for the
client's windows are bounded per stream (``h2_stream``) and per connection
(``HELD_HIGH_WATER``), and reset after ``limits.send_timeout`` without progress. Floods
end the connection with GOAWAY ENHANCE_YOUR_CALM (docs/hostile.md): streams the client
resets before their answer, beyond ``max_concurrent_streams`` more than it let be answered
(rapid reset, CVE-2023-44487: each began a request); frames the client makes the
gateway write while it reads nothing of them (its socket buffer full: answers' DATA then
wait in their streams), control frames beyond ``CONTROL_FLOOD`` (PING and SETTINGS
acknowledgements, resets), any beyond ``OUTBOUND_FLOOD`` bytes; DATA frames with nothing
in them (``EMPTY_FLOOD`` in a row); PRIORITY and WINDOW_UPDATE frames beyond what the
streams opened and the DATA sent justify (``PRIORITY_FLOOD``, ``WINDOW_UPDATE_FLOOD``).
An idle connection (no stream open) is closed after ``keepalive_timeout`` with GOAWAY.
``close`` (drain, shutdown): GOAWAY at once, no new stream taken, the connection closed
once the open ones are answered.

Invariants: a protocol error of the client's ends the connection with GOAWAY and cuts off
every stream on it; no stream's answer is ever presented as complete unless it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final, Protocol

from ..config import Http2Config, ListenerLimits
from ..errors import RequestTimeout
from ..pool.events import ClientTimeout
from ..wire import grpc, h2_session, http1, http2
from ..wire.h2_session import (
    DataReceived,
    Event,
    PriorityUpdated,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from . import openai
from .codec import Begin, Handler
from .h2_stream import H2Stream
from .request import HOST, IncomingRequest, Refused, RequestBody

log = logging.getLogger(__name__)

_PSEUDO: Final = frozenset({b":method", b":path", b":authority", b":scheme"})
CONTROL_FLOOD: Final = 1000
"""Control frames (PING and SETTINGS acknowledgements, RST_STREAM: ``wire.http2.PING``...)
written while the connection's socket buffer is full (the client reads nothing), before the
connection is ended (Envoy's ``max_outbound_control_frames``)."""
OUTBOUND_FLOOD: Final = 1024 * 1024
"""Bytes the connection's transport may hold beyond what it held when its buffer went over
its high-water mark (the client reads nothing), before the connection is ended: Envoy's
``max_outbound_frames`` measured in what an asyncio transport holds, bytes. Answers' DATA
wait in their streams meanwhile (bounded there: ``HELD_HIGH_WATER``), so what fills it is
what the client's own frames make the gateway write: answers' heads, resets,
acknowledgements."""
EMPTY_FLOOD: Final = 100
"""DATA frames in a row that carry nothing and do not end their stream (Envoy's
``max_consecutive_inbound_frames_with_empty_payload``), before the connection is ended."""
PRIORITY_FLOOD: Final = 100
"""PRIORITY frames taken per stream the client opened, and one more stream's worth (Envoy's
``max_inbound_priority_frames_per_stream``), before the connection is ended."""
WINDOW_UPDATE_FLOOD: Final = 10
"""WINDOW_UPDATE frames taken per DATA frame sent and per stream opened, and one more
(Envoy's ``max_inbound_window_update_frames_per_data_frame_sent``), before the connection
is ended: each has every stream's queue looked at."""
HELD_HIGH_WATER: Final = 2 * 1024 * 1024
"""Answer bytes queued on all of a connection's streams, waiting for the client's windows,
before every stream's upstream connection is paused: more than one stream can hold
(``h2_stream.OUT_HIGH_WATER`` and one read), so one slow stream never holds back the
others, and a client that opens many streams and opens no window makes the gateway hold
this and a read, not ``max_concurrent_streams`` times what one stream may."""
TURN_SLICE: Final = 16 * 1024
TURN_EVENTS: Final = 256
"""What the session is fed of a read before the loop turns: slices of ``TURN_SLICE`` bytes until
they made this many events (a read of 256 KiB of PINGs is 15,000 frames: the other
connections wait while the session takes them)."""
LINGER_TIMEOUT: Final = 2.0
"""An ended connection reads and discards what the client still sends, for up to this long,
after its GOAWAY (``http1_downstream.LINGER_TIMEOUT``)."""


class Gate(Protocol):
    """The listener's count of open connections, and what its connections share
    (``http1_downstream.ConnectionGate``)."""

    open: int
    parked: int
    limit: int
    model_prefix: str | None
    timed_out: Callable[[str, ClientTimeout], None] | None


class H2Connection(asyncio.Protocol):
    """One client connection over HTTP/2: its streams' requests and their answers."""

    def __init__(
        self,
        handler: Handler,
        begin: Begin | None,
        limits: ListenerLimits,
        settings: Http2Config,
        gate: Gate,
        connections: set[H2Connection],
    ) -> None:
        self._handler = handler
        self._begin = begin
        self._limits = limits
        self._settings = settings
        self._gate = gate
        self._counted = False
        self._connections = connections
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.secure = False
        self.socket_full = False
        """The transport's write buffer is over its high-water mark (``pause_writing``):
        no DATA is sent meanwhile (``send_out``), and what is written counts against the
        outbound floods (``_written_while_full``)."""
        self._full_at = 0
        """What the transport held when it went over its high-water mark."""
        self.held = 0
        """Answer bytes queued on the streams for the client's windows (``hold``)."""
        self.streams: dict[int, H2Stream] = {}
        """Streams whose exchange, or whose answer's sending, is not over."""
        self.going_away = False
        """GOAWAY was sent: no new stream is taken."""
        self.ended = False
        """Ended for a protocol error or a flood: what still comes is discarded."""
        self._on_closed: list[asyncio.Future[None]] = []
        self._sending = 0
        """Inside ``data_received``: what the events make is written once, at its end."""
        self._flushing = False
        """A write of what the session made is due at the end of the loop's turn (``_flush``)."""
        self._idle_timer: asyncio.TimerHandle | None = None
        self.resets = 0
        """Streams the client reset before their answer, less those answered whole (never
        below 0): over ``max_concurrent_streams``, a rapid reset."""
        self.control = 0
        """Control frames written since the socket buffer went full."""
        self.empty = 0
        """DATA frames in a row with nothing in them and no END_STREAM."""
        self.opened = 0
        self.priorities = 0
        """PRIORITY frames taken (``PRIORITY_FLOOD`` for each stream ``opened``)."""
        self.data_sent = 0
        self.window_updates = 0
        """WINDOW_UPDATE frames taken (``WINDOW_UPDATE_FLOOD`` for each DATA frame sent and
        each stream opened)."""
        self._body_due: dict[int, float] = {}
        """When each body under way must have been read from again (``_await_body``)."""
        self._body_timers: dict[int, asyncio.TimerHandle] = {}
        self._body_rate: dict[int, tuple[float, int]] = {}
        """When each body under way began (or the gateway last held it back) and how much of
        it had come then: the baseline of ``body_min_rate``."""
        self._block_timer: asyncio.TimerHandle | None = None
        """A header block is open (the session holds its frames): it must end by then."""
        self._first = True
        """No request came yet: the idle timer is ``header_timeout``'s."""
        self._session = h2_session.Session(
            False, settings.max_concurrent_streams, settings.max_header_list_size
        )
        self._backlog = b""
        """What was read and not yet fed to the session (``_take``)."""

    # -- taking the connection ------------------------------------------------------------

    def take_over(self, transport: asyncio.Transport, secure: bool, read: bytes | None) -> None:
        """Serve ``transport`` from now on: ``read`` is what the HTTP/1.1 listener read of
        it (the preface, and what came after it); None: nothing yet (a TLS connection whose
        handshake chose h2, which counts against ``max_connections`` from now on)."""
        transport.set_protocol(self)
        gate = self._gate
        if read is None and gate.open + gate.parked >= gate.limit:
            transport.close()
            return
        gate.open += 1
        self._counted = True
        self.transport = transport
        self.secure = secure
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        self._connections.add(self)
        self._session.initiate()
        self._flush()
        self._idle(self._limits.header_timeout)  # the first request, as HTTP/1.1's head
        if read:
            self.data_received(read)
        if not self._backlog:  # (else once it is taken: ``_take_backlog``)
            transport.resume_reading()

    # -- asyncio.Protocol -----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        if self._backlog:  # (what a transport had read before it paused)
            self._backlog += data
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        """Feed ``data`` to the session a slice at a time; once the slices made ``TURN_EVENTS``
        events, the rest waits for the loop's next turn (reading paused meanwhile)."""
        if len(data) <= TURN_SLICE:
            self._receive(data)
            return
        events = 0
        for at in range(0, len(data), TURN_SLICE):
            if events >= TURN_EVENTS:
                self._backlog = data[at:]
                if self.transport is not None:
                    self.transport.pause_reading()
                self.loop.call_soon(self._take_backlog)
                return
            events += self._receive(data[at : at + TURN_SLICE])
            if self.ended:
                return

    def _take_backlog(self) -> None:
        data, self._backlog = self._backlog, b""
        if self.transport is None:
            return
        if not self.ended:  # (ended: what still comes is read and discarded)
            self._take(data)
        if not self._backlog and self.transport is not None:
            self.transport.resume_reading()

    def _receive(self, data: bytes) -> int:
        """Feed ``data`` to the session and act on its events: how many there were."""
        self._sending += 1
        try:
            try:
                events = self._session.receive(data)
            except h2_session.ProtocolError as exc:
                self._broken(exc)
                return 0
            for event in events:
                self._event(event)
                if self.ended:
                    return len(events)
            self._watch_block()
        finally:
            self._sending -= 1
        self._flush()
        return len(events)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._gate.open -= 1
        self.transport = None
        self._backlog = b""
        self._connections.discard(self)
        self._stop_idle()
        self._stop_block()
        for timer in self._body_timers.values():
            timer.cancel()
        self._body_timers.clear()
        self._body_due.clear()
        self._body_rate.clear()
        streams = list(self.streams.values())
        self.streams.clear()
        for stream in streams:
            stream.lost()
        self._resolve_closed()

    def pause_writing(self) -> None:
        self.socket_full = True
        self.control = 0
        if self.transport is not None:
            self._full_at = self.transport.get_write_buffer_size()
        self._flow_all()

    def resume_writing(self) -> None:
        self.socket_full = False
        self._send_all()  # what waited in the streams for the socket
        self._flow_all()

    def _flow_all(self) -> None:
        for stream in list(self.streams.values()):
            stream.flow()

    @property
    def writing_paused(self) -> bool:
        """The streams' upstream connections are to pause: the socket buffer is full, or
        the streams hold ``HELD_HIGH_WATER`` between them."""
        return self.socket_full or self.held > HELD_HIGH_WATER

    # -- events ---------------------------------------------------------------------------

    def _event(self, event: Event) -> None:
        if isinstance(event, RequestReceived):
            self.empty = 0
            self.opened += 1
            self._request(event)
        elif isinstance(event, DataReceived):
            self._data(event)
        elif isinstance(event, TrailersReceived):
            stream = self.streams.get(event.stream_id)
            request = stream.request if stream is not None else None
            if request is not None and request.body is not None:
                request.body.trailers = event.headers  # (checked: none connection-specific)
        elif isinstance(event, StreamEnded):
            stream = self.streams.get(event.stream_id)
            request = stream.request if stream is not None else None
            if request is not None and request.body is not None:
                self._body_done(event.stream_id)
                request.body.finish()
        elif isinstance(event, StreamReset):
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                self._body_done(event.stream_id)
                if event.remote_reset and not stream.ended:
                    self.resets += 1
                stream.lost()
                if self.resets > self._settings.max_concurrent_streams:
                    self._calm("rapid reset")
                    return
                self._maybe_idle()
        elif isinstance(event, RemoteSettingsChanged):
            self._send_all()
        elif isinstance(event, WindowUpdated):
            self.window_updates += 1
            if self.window_updates > WINDOW_UPDATE_FLOOD * (1 + self.data_sent + self.opened):
                self._calm("WINDOW_UPDATE flood")
                return
            self._send_all()
        elif isinstance(event, PriorityUpdated):
            self.priorities += 1
            if self.priorities > PRIORITY_FLOOD * (1 + self.opened):
                self._calm("PRIORITY flood")
        elif isinstance(event, h2_session.ConnectionTerminated):
            self.close()

    def _send_all(self) -> None:
        """The windows grew: send what the streams hold."""
        for stream in list(self.streams.values()):
            if stream.out or (stream.ending and not stream.ended):
                self.send_out(stream)

    def _request(self, event: RequestReceived) -> None:
        stream_id = event.stream_id  # (after GOAWAY, the session refuses new streams itself)
        self._stop_idle()
        self._first = False
        stream = H2Stream(self, stream_id, self.peer, self.secure, self._limits.send_timeout)
        self.streams[stream_id] = stream
        try:
            request = incoming(event.headers, self._limits.max_header_size, not event.end_stream)
        except Refused as refused:
            self._refuse(stream, event.headers, refused)
            stream.finished(IncomingRequest(None), self.loop.time())
            return
        if not event.end_stream:
            request.body = RequestBody(stream, False)
            self._await_body(stream_id)
        stream.request = request
        begin = self._begin
        if begin is None or not begin(stream, request):
            stream.run(request, self._handler(stream, request))

    def _refuse(self, stream: H2Stream, fields: http2.Fields, refused: Refused) -> None:
        """Answer a head ``incoming`` refused, as HTTP/1.1's codec answers one: in gRPC's
        shape to a gRPC request, in OpenAI's on a model path (``models.path_prefix``)."""
        if grpc.is_grpc(fields):
            stream.grpc_error(refused.status, refused.message, b"")
            return
        path = next((value for name, value in fields if name == b":path"), b"")
        answer = openai.refused_head(
            self._gate.model_prefix, path, refused.status, refused.code, refused.message
        )
        if answer is not None:
            stream.send_whole(http1.plain_response(refused.status, answer.body, answer.headers))
        else:
            stream.refuse(refused.status, refused.code, refused.message)

    def _data(self, event: DataReceived) -> None:
        stream_id = event.stream_id
        size = event.flow_controlled_length
        if event.data or event.end_stream:
            self.empty = 0
        else:  # (padding alone is nothing)
            self.empty += 1
            if self.empty > EMPTY_FLOOD:
                self._calm("empty DATA flood")
                return
        stream = self.streams.get(stream_id)
        request = stream.request if stream is not None else None
        if stream is None or request is None or request.body is None:
            self._acknowledge(stream_id, size)  # a stream answered, or refused: dropped
            return
        request.body.feed(event.data)
        stream.received(size)
        if stream_id in self._body_due:
            limits = self._limits
            due = self.loop.time() + limits.body_timeout
            rate = limits.body_min_rate
            if rate:
                since, base = self._body_rate[stream_id]
                due = min(due, since + limits.body_timeout + (request.body.received - base) / rate)
                timer = self._body_timers.get(stream_id)
                if timer is not None and due < timer.when():  # (a read moves it on, lazily)
                    timer.cancel()
                    self._body_timers[stream_id] = self.loop.call_at(
                        due, self._body_check, stream_id
                    )
            self._body_due[stream_id] = due

    # -- request bodies' deadlines ------------------------------------------------------------

    def _await_body(self, stream_id: int) -> None:
        """A body is due on ``stream_id``: each of its reads within ``body_timeout`` of the
        last (as HTTP/1.1's, ``limits.body_timeout``), unless the gateway holds it back."""
        timeout = self._limits.body_timeout
        if timeout:
            now = self.loop.time()
            self._body_due[stream_id] = now + timeout
            self._body_rate[stream_id] = (now, 0)
            self._body_timers[stream_id] = self.loop.call_later(
                timeout, self._body_check, stream_id
            )

    def _body_check(self, stream_id: int) -> None:
        """A body's timer came (moved lazily: a read only moves ``_body_due``)."""
        self._body_timers.pop(stream_id, None)
        due = self._body_due.get(stream_id)
        stream = self.streams.get(stream_id)
        body = stream.request.body if stream is not None and stream.request else None
        if due is None or stream is None or body is None or body.complete or body.error:
            self._body_due.pop(stream_id, None)
            self._body_rate.pop(stream_id, None)
            return
        timeout = self._limits.body_timeout
        now = self.loop.time()
        if stream.holding:  # not acknowledged by the gateway: the client waits on it
            due = self._body_due[stream_id] = now + timeout
            self._body_rate[stream_id] = (now, body.received)  # the rate counted from now
        if now < due:
            self._body_timers[stream_id] = self.loop.call_at(due, self._body_check, stream_id)
            return
        self._body_due.pop(stream_id, None)
        self._body_rate.pop(stream_id, None)
        rate = self._limits.body_min_rate
        slow = f" or averaged under {rate} B/s" if rate else ""
        self._timed_out("body")
        body.fail(
            RequestTimeout(
                f"the request body paused for over {timeout:g} s{slow}", body_timeout=timeout
            )
        )

    def _body_done(self, stream_id: int) -> None:
        self._body_due.pop(stream_id, None)
        self._body_rate.pop(stream_id, None)
        timer = self._body_timers.pop(stream_id, None)
        if timer is not None:
            timer.cancel()

    # -- what streams ask for (``h2_stream.StreamOwner``) -----------------------------------

    def send_head(self, stream: H2Stream, fields: list[tuple[bytes, bytes]], end: bool) -> None:
        try:
            self._session.send_headers(stream.stream_id, fields, end)
        except h2_session.ProtocolError:
            self._gone(stream)
            return
        if end:
            stream.ended = True
        self._flush()
        self._forget(stream)

    def send_out(self, stream: H2Stream) -> None:
        if self.socket_full:  # it waits in ``out`` (``resume_writing``), bounded there
            stream.flow()
            return
        conn = self._session
        stream_id = stream.stream_id
        out = stream.out
        try:
            while out:
                window = conn.sendable(stream_id)
                if window <= 0:
                    break
                chunk = http2.take(out, window)
                stream.out_bytes -= len(chunk)
                self.hold(-len(chunk))
                last = not out and stream.ending and stream.trailing is None
                conn.send_data(stream_id, chunk, last)
                self.data_sent += 1
                if last:
                    stream.ended = True
            if not out and stream.ending and not stream.ended:
                if stream.trailing is not None:
                    conn.send_headers(stream_id, stream.trailing, True)
                else:
                    conn.end_stream(stream_id)
                stream.ended = True
        except h2_session.ProtocolError:
            self._gone(stream)
            return
        self._flush()
        stream.flow()
        self._forget(stream)

    def reset(self, stream: H2Stream) -> None:
        if stream.send_timed_out:
            self._timed_out("send")
        try:
            self._session.reset_stream(stream.stream_id, h2_session.INTERNAL_ERROR)
        except h2_session.ProtocolError:
            pass
        self._flush()
        self._forget(stream)

    def acknowledge(self, stream: H2Stream, size: int) -> None:
        self._acknowledge(stream.stream_id, size)
        self._flush()

    def over(self, stream: H2Stream) -> None:
        self._forget(stream)

    def hold(self, size: int) -> None:
        held = self.held
        self.held = held + size
        if (held > HELD_HIGH_WATER) != (self.held > HELD_HIGH_WATER) and not self.socket_full:
            self._flow_all()  # every stream's upstream paused, or resumed, at once

    # -- the connection -------------------------------------------------------------------

    def _acknowledge(self, stream_id: int, size: int) -> None:
        self._session.acknowledge(stream_id, size)

    def _gone(self, stream: H2Stream) -> None:
        """The client closed the stream meanwhile (or the connection ended: the session takes
        nothing more on it)."""
        self.streams.pop(stream.stream_id, None)
        stream.lost()
        self._maybe_idle()

    def _forget(self, stream: H2Stream) -> None:
        """A stream whose exchange is over and whose answer went whole (or was reset) is
        forgotten; if the client still sends its body, it is told to stop (RST_STREAM
        NO_ERROR, RFC 9113 8.1)."""
        if not stream.finished_exchange or not (stream.ended or stream.closed):
            return
        if self.streams.pop(stream.stream_id, None) is None:
            return
        self._body_done(stream.stream_id)
        if stream.ended and self.resets:
            self.resets -= 1
        request = stream.request
        if stream.ended and request is not None and request.body is not None:
            if not request.body.complete:
                try:
                    self._session.reset_stream(stream.stream_id, h2_session.NO_ERROR)
                except h2_session.ProtocolError:
                    pass
                self._flush()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self.streams:
            return
        self._resolve_closed()
        if self.going_away:
            self._close_transport()
        else:
            self._idle()

    def _flush(self) -> None:
        """Write what the session made, with the rest of the loop turn's frames (every stream's
        answers in one write: ``wire.batch``'s reason for HTTP/1.1)."""
        if self._sending or self._flushing:
            return
        self._flushing = True
        self.loop.call_soon(self._write_out)

    def _write_out(self) -> None:
        self._flushing = False
        data = self._session.take()
        transport = self.transport
        if data and transport is not None:
            full = self.socket_full
            transport.write(data)
            if full:
                self._written_while_full(transport, data)

    def _written_while_full(self, transport: asyncio.Transport, data: bytes) -> None:
        """``data`` was written while the client reads nothing: frames it makes the gateway
        queue, bounded (Envoy's ``max_outbound_control_frames``, ``max_outbound_frames``)."""
        self.control += http2.control_frames(data)
        if self.control > CONTROL_FLOOD:
            self._calm("outbound control frame flood")
        elif transport.get_write_buffer_size() > self._full_at + OUTBOUND_FLOOD:
            self._calm("outbound frame flood")

    def _calm(self, flood: str) -> None:
        """A flood: GOAWAY ENHANCE_YOUR_CALM, every stream cut off."""
        log.info("HTTP/2 %s from %s: connection closed", flood, self.peer)
        self._end(h2_session.ENHANCE_YOUR_CALM)

    def _broken(self, exc: h2_session.ProtocolError) -> None:
        """The client broke the protocol: GOAWAY with its error (queued by the session),
        every stream cut off."""
        log.debug("HTTP/2 protocol error from %s: %s", self.peer, exc)
        self._end(exc.code)

    def _end(self, code: int) -> None:
        """GOAWAY with ``code``, every stream cut off, the connection closed (dropped if
        the client reads nothing)."""
        self.ended = self.going_away = True
        self._session.goaway(code)  # (none if the session sent one for the client's error)
        transport = self.transport
        if transport is not None:
            transport.write(self._session.take())
        streams = list(self.streams.values())
        self.streams.clear()
        for stream in streams:
            stream.lost()
        self._stop_idle()
        self._stop_block()
        if transport is None:
            return
        if self.socket_full or not transport.can_write_eof():
            transport.abort()
            return
        # As HTTP/1.1's connection lingers: a close with the client's frames unread would
        # reset the connection, and the client might never read the GOAWAY.
        transport.write_eof()
        self._idle_timer = self.loop.call_later(LINGER_TIMEOUT, transport.abort)

    def close(self) -> None:
        """GOAWAY: take no new stream, close once the open ones are answered (shutdown)."""
        if self.going_away:
            return
        self.going_away = True
        if self.transport is not None:
            self._session.goaway(h2_session.NO_ERROR)
            self._write_out()  # now: the transport may be closed next
        if not self.streams:
            self._close_transport()

    def abort(self) -> None:
        """Drop the connection at once."""
        if self.transport is not None:
            self.transport.abort()

    def request_over(self) -> asyncio.Future[None]:
        """A future resolved once no stream is open (shutdown waits for it)."""
        future = self.loop.create_future()
        if not self.streams or self.transport is None:
            future.set_result(None)
        else:
            self._on_closed.append(future)
        return future

    def cancel_streams(self) -> list[asyncio.Task[None]]:
        """Cut off every open stream's exchange (shutdown after its timeout): the tasks
        cancelled, to be awaited."""
        tasks = []
        for stream in list(self.streams.values()):
            if stream.task is not None and not stream.task.done():
                tasks.append(stream.task)
            stream.abort()
        return tasks

    @property
    def busy(self) -> bool:
        return bool(self.streams)

    def _resolve_closed(self) -> None:
        waiting, self._on_closed = self._on_closed, []
        for future in waiting:
            if not future.done():
                future.set_result(None)

    def _close_transport(self) -> None:
        self._stop_idle()
        if self.transport is not None:
            self._write_out()  # the last streams' frames, before the close
            self.transport.close()

    def _idle(self, timeout: float | None = None) -> None:
        """No stream open: the connection is closed after ``keepalive_timeout`` (``timeout``
        for its first request: ``header_timeout``), unless one opens."""
        if timeout is None:
            timeout = self._limits.header_timeout if self._first else self._limits.keepalive_timeout
        if timeout and self._idle_timer is None:
            self._idle_timer = self.loop.call_later(timeout, self._idle_timed_out)

    def _stop_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_timed_out(self) -> None:
        self._idle_timer = None
        if not self.streams:
            if self._first:
                log.debug("no HTTP/2 request from %s within the header timeout", self.peer)
                self._timed_out("header")
            self.close()

    # -- a header block's deadline (``header_timeout``) -------------------------------------

    def _watch_block(self) -> None:
        """After each read: a header block that the session holds open must end within
        ``header_timeout`` of the read that began it."""
        if not self._session.block_open:
            self._stop_block()
        elif self._block_timer is None and self._limits.header_timeout:
            self._block_timer = self.loop.call_later(
                self._limits.header_timeout, self._block_timed_out
            )

    def _stop_block(self) -> None:
        if self._block_timer is not None:
            self._block_timer.cancel()
            self._block_timer = None

    def _block_timed_out(self) -> None:
        self._block_timer = None
        if self.ended or not self._session.block_open:
            return
        log.info("HTTP/2 header block from %s unfinished within the header timeout", self.peer)
        self._timed_out("header")
        self._end(h2_session.ENHANCE_YOUR_CALM)

    def _timed_out(self, timeout: ClientTimeout) -> None:
        timed_out = self._gate.timed_out
        if timed_out is not None:
            timed_out("h2", timeout)

    def __repr__(self) -> str:
        return (
            f"<H2Connection peer={self.peer} streams={len(self.streams)} "
            f"going_away={self.going_away}>"
        )


def incoming(fields: list[tuple[bytes, bytes]], limit: int, body: bool) -> IncomingRequest:
    """A request head as HTTP/2 fields (the session checked their form: pseudo-fields first and
    once each, lower-case names, no connection-specific field) as an ``IncomingRequest``;
    ``Refused`` where an HTTP/1.1 head would be (``IncomingRequest.add_field``, ``limit``:
    ``max_header_size``, of a field and of the target), or if it asks for CONNECT.
    ``body``: a body follows (a body of no known length goes upstream chunked)."""
    request = IncomingRequest([])
    request.version = "2"
    authority = b""
    checked = b""
    for name, value in fields:
        if name in _PSEUDO:
            if name == b":method":
                request.method = value.decode("ascii", "replace")
            elif name == b":path":
                if len(value) > limit:  # as HTTP/1.1's request line
                    raise Refused(414, "uri_too_long", "the request target is too long")
                request.target = value
            elif name == b":authority":
                authority = value
            continue
        try:
            checked = request.add_field(name, value, limit, checked)
        except ValueError:  # a Content-Length that is no number
            raise Refused(400, "bad_request", "the Content-Length is not a number") from None
    if request.method == "CONNECT":
        raise Refused(405, "method_not_allowed", "CONNECT is not served by this gateway")
    if authority and not request.host_seen:
        if not HOST.fullmatch(authority):
            raise Refused(
                400, "bad_request", "the request is refused: :authority is not host[:port]"
            )
        request.host = authority
        request.headers.append((b"host", authority))  # the upstream leg's Host
    if body and request.content_length is None:
        request.chunked = True
    return request
