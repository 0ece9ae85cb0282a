"""One HTTP/2 stream as the request path sees it: the ``Downstream`` of its request.

An ``H2Stream`` is made by its connection (``h2_downstream.H2Connection``, its ``owner``)
for each request a client opens, and answers through it: the answer's head as one HEADERS
frame, its body queued (``out``) and sent by the owner as the client's windows allow, the
end of the stream once the request's exchange is over. It is also the ``streams.ClientSide``
of its answer and that side's transport: what the upstream connection writes to it is
copied into ``out`` (so a spliced view is never held: ``get_write_buffer_size`` is 0), and
nothing is written past it (``socket_fd`` is -1).

Flow control both ways, by the stream's own bound:
- answers: over ``OUT_HIGH_WATER`` queued bytes, or while the connection's socket is full
  or its streams queue too much between them (``owner.writing_paused``), the upstream
  connection (``producer``) is paused; a client that leaves the answer unread
  for ``send_timeout`` has its stream reset (``send_timed_out``);
- request bodies: what the client sends is acknowledged (its window opened again) as it is
  passed on, and held back while the body is buffered or the upstream cannot take more
  (``pause_body``, ``pause_reading``): the client's window then bounds what is buffered.

Invariants: an answer is either ended by END_STREAM after all of it, or the stream is reset
(never a short body presented as complete); the stream's exchange or task is cut off when
the client resets the stream or the connection goes (``lost``).

Compiled with the request path (``native``): a codec's ``Downstream`` is a trait compiled
classes implement. It imports no HTTP/2 library: its owner does the framing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine
from typing import Any, Final, Protocol, cast

from ..errors import ClientGone, GatewayError
from ..wire import grpc, headers, http1, http2
from ..wire.http2 import Fields
from . import messages
from .codec import Cancellable, Downstream, Tunneled
from .messages import ResponseHead
from .request import IncomingRequest
from .streams import Producer, ResponseStream
from .websocket import Relay

log = logging.getLogger(__name__)

OUT_HIGH_WATER: Final = 64 * 1024
"""Answer bytes queued on a stream (not yet within the client's windows) before its
upstream connection is paused."""

# Why the client's request body is not acknowledged (a bit each).
_HOLD_BODY: Final = 1
_HOLD_UPSTREAM: Final = 2


class StreamOwner(Protocol):
    """The connection a stream is framed on (``h2_downstream.H2Connection``)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def writing_paused(self) -> bool:
        """The connection's socket buffer is full."""

    def send_head(self, stream: H2Stream, fields: Fields, end: bool) -> None:
        """Send the answer's HEADERS frame (with END_STREAM if ``end``)."""

    def send_out(self, stream: H2Stream) -> None:
        """Send what ``stream.out`` holds as the windows allow (then END_STREAM if
        ``stream.ending`` and all of it went)."""

    def reset(self, stream: H2Stream) -> None:
        """Reset the stream (RST_STREAM)."""

    def acknowledge(self, stream: H2Stream, size: int) -> None:
        """``size`` bytes of the request body were passed on: the client may send more."""

    def over(self, stream: H2Stream) -> None:
        """The stream's exchange is over (its answer may still be being sent)."""

    def hold(self, size: int) -> None:
        """``size`` answer bytes more (fewer, if negative) are queued on a stream: the
        connection bounds what all its streams queue (``writing_paused`` while over)."""


class H2Stream(Downstream):
    """One request on an HTTP/2 connection, and its answer."""

    def __init__(
        self,
        owner: StreamOwner,
        stream_id: int,
        peer: str | None,
        secure: bool,
        send_timeout: float,
    ) -> None:
        self.owner = owner
        self.stream_id = stream_id
        self.peer = peer
        self.secure = secure
        self.send_timed_out = False
        self.exchange: Cancellable | None = None
        self.task: asyncio.Task[None] | None = None
        self.request: IncomingRequest | None = None
        self.producer: Producer | None = None
        """The upstream connection whose answer is being sent here (paused with it)."""
        self.out: deque[bytes] = deque()
        """Answer bytes waiting for the client's windows (``owner.send_out`` takes them)."""
        self.out_bytes = 0
        self._queued = 0
        """Answer bytes ever queued: less ``out_bytes``, those sent."""
        self._sent_mark = 0
        """Those sent when the send timer was armed."""
        self.ending = False
        """END_STREAM follows what ``out`` holds."""
        self.ended = False
        """END_STREAM was sent (set by the owner)."""
        self.trailing: Fields | None = None
        """Trailers the owner sends, with END_STREAM, after what ``out`` holds."""
        self.answered = False
        """The answer's HEADERS went: no other answer is possible."""
        self.closed = False
        """Reset, by either side, or its connection gone: nothing more is sent."""
        self.finished_exchange = False
        """The exchange is over (``owner.over`` was told)."""
        self.grpc = False
        """The request is gRPC (known once its answer begins)."""
        self.grpc_status: str | None = None
        self._send_timeout = send_timeout
        self._send_timer: asyncio.TimerHandle | None = None
        self._paused = False
        """The producer is paused by this stream."""
        self._hold = 0
        self._unacknowledged = 0

    # -- the request ---------------------------------------------------------------------

    def received(self, size: int) -> None:
        """``size`` flow-controlled bytes of the body arrived and were fed to it."""
        if self._hold:
            self._unacknowledged += size
        else:
            self.owner.acknowledge(self, size)

    def _unhold(self, reason: int) -> None:
        if not self._hold & reason:
            return
        self._hold &= ~reason
        if not self._hold and self._unacknowledged:
            size, self._unacknowledged = self._unacknowledged, 0
            if not self.closed:
                self.owner.acknowledge(self, size)

    def pause_body(self) -> None:
        """Too much of the request body is buffered (``request.BodySource``)."""
        self._hold |= _HOLD_BODY

    def resume_body(self) -> None:
        self._unhold(_HOLD_BODY)

    def send_continue(self) -> None:
        """Nothing: HTTP/2 has no 100 Continue step the gateway needs."""

    @property
    def holding(self) -> bool:
        """The request body is not acknowledged: the client waits on the gateway."""
        return self._hold != 0

    def pause_reading(self) -> None:
        """The upstream cannot take more of the body."""
        self._hold |= _HOLD_UPSTREAM

    def resume_reading(self) -> None:
        self._unhold(_HOLD_UPSTREAM)

    # -- answers (``codec.Downstream``) ----------------------------------------------------

    def answer(
        self,
        request: IncomingRequest,
        head: ResponseHead,
        request_id: bytes,
        extra: bytes,
        producer: Producer,
        body: bytes,
    ) -> None:
        self.producer = producer
        fields = self._answer_fields(head, request_id, extra)
        if grpc.is_grpc(request.headers):
            self.grpc = True
            self.grpc_status = grpc.status(fields)  # a trailers-only answer's
        if body and request.method != "HEAD":
            self._head(fields, False)
            self._queue(body, True)
        else:
            self._head(fields, True)

    def open_answer(
        self,
        request: IncomingRequest,
        head: ResponseHead,
        request_id: bytes,
        extra: bytes,
        producer: Producer,
    ) -> ResponseStream:
        self.producer = producer
        self.grpc = grpc.is_grpc(request.headers)
        self._head(self._answer_fields(head, request_id, extra), False)
        return ResponseStream(self, False)

    def _answer_fields(self, head: ResponseHead, request_id: bytes, extra: bytes) -> Fields:
        """The upstream's answer head as HTTP/2 fields: HTTP/1.1's rules for which fields
        pass (``headers.client_response``), then its length if known, then ``extra``."""
        lines = headers.client_response(head.fields, head.hop, request_id.decode())
        status = head.status
        if head.content_length is not None and status != 204:
            lines.append(b"Content-Length: %d" % head.content_length)
        if extra:
            lines.append(extra)
        return http2.answer_fields(status, lines)

    def send_error(self, request: IncomingRequest, exc: GatewayError, request_id: str) -> None:
        if grpc.is_grpc(request.headers):  # never a JSON body to a gRPC client
            self.grpc_error(exc.status, exc.message, request_id.encode())
            return
        self.send_whole(messages.gateway_error_response(exc, request_id, False))

    def grpc_error(self, status: int, message: str, request_id: bytes) -> None:
        """The gateway's own answer to a gRPC request (HTTP ``status``): trailers-only."""
        if self.answered:
            self.abort()
            return
        code = grpc.status_of(status)
        self.grpc = True
        if not self.closed:
            self.grpc_status = str(code)
        self._head(grpc.trailers_only(code, message, request_id), True)

    def trailers(self, fields: Fields) -> None:
        if not self.closed and not self.ending:
            self.trailing = fields
            if self.grpc:
                self.grpc_status = grpc.status(fields)

    def refuse(self, status: int, code: str, message: str) -> None:
        """Answer a request head that cannot be served (``request.Refused``)."""
        self.send_whole(http1.json_response(status, {"error": code, "message": message}))

    def send_whole(self, data: bytes) -> None:
        """A whole answer the gateway made itself, in HTTP/1.1's bytes (``http2``)."""
        if self.answered:
            self.abort()
            return
        _, fields, body = http2.split_answer(data)
        if body:
            self._head(fields, False)
            self._queue(body, True)
        else:
            self._head(fields, True)

    def upgrade(self, head: ResponseHead, request_id: str, upstream: Tunneled) -> Relay:
        raise RuntimeError("no WebSocket relay over HTTP/2")  # (its requests have no upgrade)

    def start_relay(self, relay: Relay) -> None:
        raise RuntimeError("no WebSocket relay over HTTP/2")

    def finished(self, request: IncomingRequest, now: float) -> None:
        self.exchange = None
        self._over()

    def run(self, request: IncomingRequest, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        # The work is the task (its end seen by ``_ran``), not awaited by a wrapper: a
        # stream reset before the task's first step leaves no coroutine never awaited.
        self.exchange = None
        self.task = task = self.owner.loop.create_task(work)
        task.add_done_callback(self._ran)
        return task

    def _ran(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            self.abort()
        else:
            error = task.exception()
            if error is not None:
                log.error("request handler failed for %r", self.request, exc_info=error)
                self.abort()
        self._over()

    def _over(self) -> None:
        """The exchange is over: the stream ends after what was queued."""
        if self.finished_exchange:
            return
        self.finished_exchange = True
        self.task = None
        self.producer = None
        if not self.closed:
            if not self.answered:  # (every way through answers, or aborts)
                self.abort()
            else:
                self._end()
        self.owner.over(self)

    def abort(self) -> None:
        """Reset the stream: the answer under way never looks complete; the exchange, if
        still under way, is cut off (as a client that went away cuts it off)."""
        if self.closed:
            return
        self._close()
        self.owner.reset(self)
        self.owner.loop.call_soon(self._cut_off)

    def lost(self) -> None:
        """The client reset the stream, or the connection is gone."""
        if self.closed:
            return
        self._close()
        self._cut_off()

    def _close(self) -> None:
        self.closed = True
        self.out.clear()
        if self.out_bytes:
            self.owner.hold(-self.out_bytes)
            self.out_bytes = 0
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _cut_off(self) -> None:
        request = self.request
        if request is not None and request.body is not None:
            request.body.fail(ClientGone("the client reset the stream"))
        task = self.task
        if task is not None:
            if not task.done():
                task.cancel()  # its end (``_ran``) is the exchange's
            return
        exchange = self.exchange
        if exchange is not None:
            exchange.cancel()
        self._over()

    # -- writing (``streams.ClientSide``, and its transport) -------------------------------

    def _head(self, fields: Fields, end: bool) -> None:
        if self.closed:
            return
        self.answered = True
        if end:
            self.ending = True
        self.owner.send_head(self, fields, end)

    def _queue(self, data: bytes, end: bool = False) -> None:
        """Send ``data`` as the windows allow (then END_STREAM if ``end``)."""
        if self.closed or self.ending:
            return
        self.out.append(data)
        self.ending = end
        self.out_bytes += len(data)
        self._queued += len(data)
        self.owner.hold(len(data))
        self.owner.send_out(self)
        self.flow()

    def _end(self) -> None:
        if self.closed or self.ending:
            return
        self.ending = True
        self.owner.send_out(self)

    def flow(self) -> None:
        """Pause or resume the producer as what is queued, and the connection, allow
        (after each write, each send, and each change of the connection's socket)."""
        full = self.out_bytes > OUT_HIGH_WATER or self.owner.writing_paused
        if full == self._paused or self.closed:
            return
        self._paused = full
        producer = self.producer
        if full:
            if producer is not None:
                producer.pause_reading()
            if self._send_timeout and self._send_timer is None:
                self._arm_send_timer()
        else:
            # The timer stays while the stream holds an answer it sent none of since: it
            # resumed only because the connection's other streams hold less.
            timer = self._send_timer
            if timer is not None and (
                not self.out_bytes or self._queued - self.out_bytes > self._sent_mark
            ):
                timer.cancel()
                self._send_timer = None
            if producer is not None:
                producer.resume_reading()

    def _arm_send_timer(self) -> None:
        self._sent_mark = self._queued - self.out_bytes
        self._send_timer = self.owner.loop.call_later(self._send_timeout, self._send_timed_out)

    def _send_timed_out(self) -> None:
        """``send_timeout`` after the stream paused: reset unless it sent some of its
        answer since, or is neither paused nor holding any."""
        self._send_timer = None
        if self.closed:
            return
        if self._queued - self.out_bytes > self._sent_mark:
            if self._paused:
                self._arm_send_timer()
            return
        if self._paused or self.out_bytes:
            log.debug("client left stream %d unread for %ss", self.stream_id, self._send_timeout)
            self.send_timed_out = True
            self.abort()

    @property
    def transport(self) -> asyncio.Transport | None:
        return None if self.closed else cast(asyncio.Transport, self)

    @property
    def writing_paused(self) -> bool:
        return self._paused

    def write(self, data: bytes | memoryview) -> None:
        if data:
            self._queue(bytes(data))  # a copy: a view of a read buffer is never held

    def writelines(self, chunks: list[bytes | memoryview]) -> None:
        self.write(b"".join(chunks))

    def flush(self) -> None:
        """Nothing is held back (``ClientSide``)."""

    def socket_fd(self) -> int:
        return -1

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def __repr__(self) -> str:
        return (
            f"<H2Stream {self.stream_id} {self.request!r} queued={self.out_bytes} "
            f"ended={self.ended} closed={self.closed}>"
        )
