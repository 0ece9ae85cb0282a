"""One connection to one upstream: it sends one request at a time and reads its answer.

``UpstreamConnection`` is an asyncio protocol that parses answers with llhttp
(``httptools``), or reads the plainest whole answer at once (``plainhead``). The answer's
head resolves a future, or is told to a ``Waiter`` (an ``Exchange`` served without a task); its
body goes straight into the client's ``ResponseStream`` once the proxy attached it, with
back-pressure: a client that cannot take more pauses reading from the upstream.

A large body framed by Content-Length is spliced to the client without copying it: the
connection's reads go to a ``splice.SplicedReads`` meanwhile; a chunked body after a plain
head, to a ``chunked_answer.ChunkedAnswer``.

Failures are ``GatewayError``s with a ``kind`` that says whether a retry can help:
``connect`` (nothing reached the upstream), ``disconnect`` (closed before any answer: on a
connection ``reused``, maybe a stale one), ``timeout``, ``protocol`` (not HTTP, or broken).

A request's answer must come, and each read of it follow the last, within ``read_timeout``:
one timer of the connection's, armed once and moved lazily (a later deadline only changes
``_last_read``; the timer, when it fires early, is armed again for it: no timer per request
or per read). A streamed chunked body's reads (``_chunked_read``) are counted, not timed:
each sets ``_untimed``, and the timer reads the clock; while such a body is under way the
timer looks at most ``LOOK`` of the timeout apart, and a read since its last look counts as
then: a body that stops is cut between 1 and 1 + ``LOOK`` times the timeout after its last
read, never before.

Longer than most modules: one protocol, whose parser callbacks, plain-answer reads, splice
and read timer all act on the state of the one request under way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final, Protocol, cast

import httptools

from ..errors import GatewayError, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from ..wire import http1, plainhead
from ..wire.batch import WriteBatch
from ..wire.headers import response_fields
from ..wire.splice import RAW_BODY_MIN, Buffers, Reader, splice_reads
from . import chunked_answer
from .messages import AfterAnswer, HeadTooLarge, ResponseHead
from .streams import WRITE_HIGH_WATER, Producer, ResponseStream

log = logging.getLogger(__name__)

LOOK: Final = 0.125
"""While a chunked body is under way, the read timer looks at most this fraction of the
timeout apart."""


class Waiter(Protocol):
    """Who waits for the answer without a future (an ``Exchange`` served without a task)."""

    def answered(self, conn: UpstreamConnection, head: ResponseHead) -> None:
        """The answer's final head arrived, and its whole body if ``conn.complete``."""

    def failed(self, conn: UpstreamConnection, error: GatewayError) -> None:
        """The request failed before the answer's head arrived."""


class UpstreamConnection(asyncio.Protocol):
    """One connection to one upstream: one request at a time."""

    def __init__(
        self,
        key: str,
        *,
        max_header_size: int,
        buffers: Buffers,
        batch: WriteBatch,
        forget: Callable[[UpstreamConnection], None],
    ) -> None:
        self.key = key  # its upstream's address (``address_of``): where it is kept idle
        self._batch = batch
        self._forget = forget
        """Told when the connection is lost (its ``Connector``)."""
        self._loop = asyncio.get_running_loop()
        self._read_timeout = 0.0
        self._last_read = 0.0
        self._untimed = False
        """A chunked body was read since ``_last_read`` (counted, not timed: ``LOOK``)."""
        self._reading_paused = False
        """Paused by the client side: the upstream is not late meanwhile."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        """When ``_timer`` fires (its ``when()``, kept: a call a request less)."""
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._held: bytes | None = None
        """A request head ``send`` holds until the end of the loop's turn (``batch``)."""
        self.idle_since = 0.0
        self.reused = False  # it went idle once: a request may meet the upstream closing it
        self._head: ResponseHead | None = None
        self._max_field = max_header_size
        self._head_buf = b""
        """What the upstream sent of the answer while its head is not complete."""
        self._head_at = 0
        """Where in ``_head_buf`` the head being parsed begins (after interim answers)."""
        self._in_head = False
        self._head_future: asyncio.Future[ResponseHead] | None = None
        self.waiter: Waiter | None = None
        """Told of the answer's head instead of ``_head_future`` (see ``Waiter``)."""
        self._asked = False
        """A request was sent and its answer is not over: the upstream may speak."""
        self._done: asyncio.Future[None] | None = None
        self._interim = False
        self._head_bytes = 0
        self._raw_remaining = 0
        self._raw_started = False
        self._head_only = False
        self._sink: ResponseStream | None = None
        self._buffer: list[bytes] = []  # the body read before it has a sink (llhttp's pieces)
        self._whole = b""  # or all of it, a plain answer's, read with its head (no list)
        self.complete = False
        self.failed = False
        self.body_producer: Producer | None = None
        self._body_chunked = False
        self.request_sent = True
        self.tunnel: Callable[[bytes], None] | None = None
        self.tunnel_data = b""
        self.on_lost: Callable[[], None] | None = None
        self._reads = Reader(buffers)
        """Where reads go: the scratch buffer, or the splice of a large body to the client."""
        self._chunked: chunked_answer.ChunkedAnswer | None = None
        """The chunked body under way after a plain head."""

    # -- reads while a large body is spliced (``splice.SplicedReads``) -----------------------

    def read_into(self, sizehint: int) -> memoryview:
        """A splice buffer while a large body goes to a client, else the scratch buffer."""
        sink = self._sink
        return self._reads.buffer(
            sink.conn.transport if sink is not None and self._raw_started else None
        )

    def read_done(self, nbytes: int) -> None:
        splice = self._reads.spliced(nbytes, self.data_received)
        if splice is None:
            return
        self._last_read = self._loop.time()
        if nbytes > self._raw_remaining:
            self._broken("upstream sent more than its Content-Length")
            return
        self._raw_remaining -= nbytes
        sink = self._sink
        assert sink is not None
        sink.response_data(splice.view(nbytes))
        splice.wrote(nbytes)
        if not self._raw_remaining:
            self._raw_done()

    def _raw_done(self) -> None:
        """The large body ended: a new parser (see ``_raw_body``), the splice closed."""
        self._raw_started = False
        splice_reads(self.transport, self, False)
        self._parser = httptools.HttpResponseParser(self)
        self._reads.end(self._sink.conn.transport if self._sink is not None else None)
        self._message_done()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self._held = None
        self._forget(self)
        self._stop_timer()
        if self.on_lost is not None:
            self.on_lost()
            return
        head = self._head
        if self._asked and (head is None or not head.status):
            self._fail(
                UpstreamConnectError(
                    "upstream closed the connection before answering", kind="disconnect"
                )
            )
        elif head is not None and not self.complete:
            if head.content_length is None and not head.chunked and not self._head_only:
                self._message_done()  # the body was delimited by the close
            else:
                self._fail(
                    UpstreamProtocolError("upstream response body broke off", kind="protocol")
                )

    def data_received(self, data: bytes) -> None:
        if self.tunnel is not None:
            self.tunnel(data)
            return
        head = self._head
        if head is not None and head.status == 101:
            self.tunnel_data += data  # the relay is not installed yet
            return
        if not self._asked:
            # Nothing was asked: an idle connection must stay silent.
            self.abort()
            return
        answer = self._chunked
        if answer is not None:
            self._chunked_read(answer, data, 0)
            return
        if self._head is None and not self._head_only and plainhead.COMPILED:
            # The answer's first read: most are the whole answer, of the plainest shape. (Its
            # time is not read: the answer is over, and it went idle as good as when sent.)
            plain = plainhead.answer(data, self._max_field)
            if plain is not None:
                self._plain_answer(plain, data)
                return
        self._last_read = self._loop.time()
        if self._raw_remaining and self._raw_started:
            self._raw_body(data)
            return
        if self._in_head:
            self._head_buf += data  # the head is read whole from here (``on_headers_complete``)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self.tunnel_data += data[upgrade.args[0] :]
        except httptools.HttpParserError as exc:
            if not self.complete:
                reason = exc.__context__ if isinstance(exc.__context__, HeadTooLarge) else exc
                self._broken(f"upstream sent an invalid response: {reason}")
                return
            head = self._head
            if head is not None:
                head.keep_alive = False  # refused after the answer, which stands: not reused
        if self._raw_remaining:
            self._raw_started = True  # what comes next skips the parser (``_raw_body``)
            splice_reads(self.transport, self, True)
        head = self._head
        if head is not None and head.status:
            if self._sink is None and not self.complete:
                # The body has nowhere to go until the proxy calls ``stream_to``: uvloop
                # would read on (up to 32 reads a wakeup) into memory meanwhile.
                self.pause_reading()
            waiter = self.waiter
            if waiter is not None:
                self.waiter = None
                waiter.answered(self, head)  # last: it may hand this connection on
        elif head is not None and not self._interim:
            # Still in the head: bound it (llhttp keeps a partial field to itself).
            self._head_bytes += len(data)
            if self._head_bytes > http1.HEAD_LIMIT_FACTOR * self._max_field:
                self._broken("upstream sent a response head that is too large")

    def _plain_answer(self, plain: plainhead.PlainAnswer, data: bytes) -> None:
        """An answer read without llhttp (``plainhead``): what its callbacks and
        ``data_received`` would have done with it, which never saw it. A chunked body is
        read by ``chunked_answer`` from here on, starting with what came with the head."""
        status, phrase, fields, length, hop, keep_alive, body_at = plain
        head = self._head = ResponseHead()
        head.status = status
        head.phrase = phrase
        head.fields = fields
        head.hop = hop
        head.keep_alive = keep_alive
        self._in_head = False
        future = self._head_future
        if future is not None and not future.done():
            future.set_result(head)
        if length >= 0:
            head.content_length = length
            if length:
                self._whole = data[body_at:]
            self._message_done()
        else:
            head.chunked = True
            answer = self._chunked = chunked_answer.ChunkedAnswer(self)
            self._chunked_read(answer, data, body_at)
            if self.failed:
                return  # the waiter was told
            if self._chunked is not None:
                self._look_soon()  # the body goes on after the head's read
            if self._sink is None and not self.complete:
                self.pause_reading()  # until ``stream_to`` (as after llhttp's head)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            waiter.answered(self, head)  # last: it may hand this connection on

    def _chunked_read(self, answer: chunked_answer.ChunkedAnswer, data: bytes, at: int) -> None:
        """A read of the chunked body (``chunked_answer``), and what it came to."""
        self._untimed = True  # counted, not timed (``read_timeout``)
        status = answer.read(data, at, self._sink)
        if status == chunked_answer.MORE:
            return
        self._last_read = self._loop.time()  # when it went idle (``idle``), if it does
        self._untimed = False
        self._chunked = None
        if status == chunked_answer.BAD:
            self._broken(f"upstream sent an invalid response: {answer.error}")
            return
        if status == chunked_answer.AFTER and self._head is not None:
            self._head.keep_alive = False  # bytes after the answer: not used again
        self._message_done()

    def eof_received(self) -> bool | None:
        return None  # close: half-closed upstreams are not kept

    def pause_writing(self) -> None:
        if self.body_producer is not None:
            self.body_producer.pause_reading()

    def resume_writing(self) -> None:
        if self.body_producer is not None:
            self.body_producer.resume_reading()

    # -- parser callbacks ---------------------------------------------------------------------

    # No ``on_status`` or ``on_header``: llhttp checks the head, then ``on_headers_complete``
    # takes its fields from the bytes at once (a callback per field cost more than the rest of
    # the answer's handling).

    def on_message_begin(self) -> None:
        if self.complete:
            # More after the answer, which no request asked for: the answer stands, the
            # connection is not used again, and llhttp reads no further.
            if self._head is not None:
                self._head.keep_alive = False
            raise AfterAnswer
        self._head = ResponseHead()
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        head = self._head
        assert head is not None
        # The head's fields, from its bytes (llhttp accepted them).
        buf, at = self._head_buf, self._head_at
        end = buf.find(b"\r\n\r\n", at)  # llhttp saw it: the head's first blank line
        status_line, _, block = buf[at:end].partition(b"\r\n")
        self._head_at = end + 4
        head.phrase = status_line[13:]  # after "HTTP/1.1 200 " (llhttp checked the shape)
        if block.count(b"\n") >= http1.MAX_HEADERS:
            raise HeadTooLarge("upstream sent too many response header fields")
        if len(block) > self._max_field and any(
            len(name) + len(value.strip(b" \t")) > self._max_field
            for name, _, value in (line.partition(b":") for line in block.split(b"\r\n"))
        ):
            raise HeadTooLarge("upstream sent a response header field that is too large")
        head.fields, head.content_length, head.chunked, head.hop = response_fields(block)
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue, 103 Early Hints: not passed on
            return
        self._interim = False
        self._in_head = False
        self._head_buf = b""
        head.status = status
        head.keep_alive = parser.should_keep_alive()
        future = self._head_future
        if future is not None and not future.done():
            future.set_result(head)
        if status == 101:
            self.pause_reading()  # until the relay is in place
        if self._head_only or status == 101:
            # A HEAD answer's Content-Length describes a body that is not sent; llhttp
            # cannot be told, so the answer ends here and the connection is not reused.
            head.keep_alive = False
            self._message_done()
        elif head.content_length is not None and head.content_length > RAW_BODY_MIN:
            self._raw_remaining = head.content_length

    def on_body(self, data: bytes) -> None:
        if self._raw_remaining:
            self._raw_remaining -= len(data)
        sink = self._sink
        if sink is not None:
            sink.response_data(data)
        else:
            self._buffer.append(data)

    def _raw_body(self, data: bytes) -> None:
        """A large body framed by Content-Length, past llhttp (which would copy each piece).

        llhttp is left mid-message, so the connection gets a new parser for its next
        request; bytes beyond the length are a broken answer.
        """
        if len(data) > self._raw_remaining:
            self._broken("upstream sent more than its Content-Length")
            return
        self.on_body(data)
        if not self._raw_remaining:
            self._raw_done()

    def on_message_complete(self) -> None:
        self._raw_remaining = 0
        if self._interim:
            self._interim = False
            return
        if not self.complete:
            self._message_done()

    # -- one request and its answer ----------------------------------------------------------

    def send(
        self,
        head: bytes,
        *,
        body: bool,
        chunked: bool,
        head_only: bool,
        read_timeout: float,
        now: float,
        waiter: Waiter | None = None,
    ) -> asyncio.Future[ResponseHead] | None:
        """Write a request head; the future resolves with the answer's head.

        ``read_timeout`` runs from ``now``, the loop's time as the caller read it. With a
        ``waiter``, no future: the waiter is told instead, from this connection's
        callbacks (once the answer's head, or all of the answer that was read with it, is in).
        """
        assert self.transport is not None
        # A connection is new, or back from ``Connector.release`` after a complete answer:
        # the body's state (splice, raw body, buffer, sink) is reset already.
        loop = self._loop
        self._head = None
        self._head_at = 0
        self._in_head = True
        self._asked = True
        self.waiter = waiter
        self._head_future = loop.create_future() if waiter is None else None
        self._head_only = head_only
        self.complete = False
        self._body_chunked = chunked
        self.request_sent = not body
        self._arm(now, read_timeout)
        if not body and self._batch.hold(self):
            self._held = head
        else:
            self.transport.write(head)  # a body follows it, written as it comes
        return self._head_future

    def stream_to(self, sink: ResponseStream) -> asyncio.Future[None] | None:
        """Write the answer's head (``sink.head``) and then its body to ``sink``'s client.

        Returns None if the body is complete already (then head and body went in one write),
        else a future that resolves when it is.
        """
        if self.complete and not sink.chunked:
            data = self.take_body()
            sink.bytes_out += len(data)
            sink.write_head(data)
            return None
        sink.write_head()
        assert not self._whole  # only a complete answer framed by its length has one: above
        buffer, self._buffer = self._buffer, []
        for data in buffer:  # as they came (chunks that came with the head stay as they were)
            sink.response_data(data)
        if self.complete:
            sink.response_end()
            return None
        if self.failed:
            raise self._error
        self._sink = sink
        self._done = self._loop.create_future()
        if not sink.conn.writing_paused:
            self.resume_reading()  # else once the client took what it was sent before
        return self._done

    def take_body(self) -> bytes:
        """The whole body of a complete answer, read already (instead of ``stream_to``)."""
        whole = self._whole
        if whole:
            self._whole = b""
            return whole
        buffer = self._buffer
        self._buffer = []
        return b"".join(buffer)

    def _message_done(self) -> None:
        self.complete = True
        if self._sink is not None:
            self._sink.response_end()
        done = self._done
        if done is not None and not done.done():
            done.set_result(None)

    _error: GatewayError = UpstreamProtocolError("upstream request failed")

    def _broken(self, message: str) -> None:
        """The answer is not HTTP (any more): fail the request, drop the connection."""
        self._fail(UpstreamProtocolError(message, kind="protocol"))
        self.abort()

    def _fail(self, error: GatewayError) -> None:
        if self.failed:
            return
        self.failed = True
        self._error = error
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            waiter.failed(self, error)
        for future in (self._head_future, self._done):
            if future is not None and not future.done():
                future.set_exception(error)
                # The proxy may be past waiting on it: no "never retrieved" warning.
                future.exception()

    # -- the request body (BodySink) ----------------------------------------------------------

    def body_data(self, data: bytes | memoryview) -> None:
        if self.transport is not None:
            http1.write_body(self.transport, data, chunked=self._body_chunked)

    def body_end(self) -> None:
        self.request_sent = True
        if self._body_chunked and self.transport is not None:
            self.transport.write(http1.LAST_CHUNK)

    def body_error(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, GatewayError) else UpstreamConnectError(str(exc))
        error.kind = "client"
        self._fail(error)
        self.abort()

    # -- reading, pausing ----------------------------------------------------------------------

    def pause_reading(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            self._last_read = self._loop.time()
            if self.transport is not None:
                self.transport.resume_reading()

    # -- the read timeout: one timer, re-armed lazily (``LOOK``) ------------------------------

    def _arm(self, now: float, read_timeout: float) -> None:
        """A request sent at ``now`` (the loop's time as the caller read it): its answer is
        due within ``read_timeout`` (0: never)."""
        self._read_timeout = read_timeout
        self._last_read = now
        self._untimed = False
        if read_timeout:
            self._due_by(now + read_timeout)

    def _due_by(self, at: float) -> None:
        """The timer fires at ``at`` or earlier (an earlier one is kept: it re-arms)."""
        timer = self._timer
        if timer is not None:
            if self._timer_at <= at:
                return
            timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _look_soon(self) -> None:
        """A chunked body goes on after its head's read, now; its reads are counted, not
        timed: the timer looks at them within ``LOOK`` times the timeout."""
        timeout = self._read_timeout
        if not timeout or self._answer_over():
            return
        now = self._last_read = self._loop.time()
        self._untimed = False
        self._due_by(now + timeout * LOOK)

    def _on_timer(self) -> None:
        # Armed once and re-armed while requests go on: no timer per request.
        self._timer = None
        if not self._read_timeout or self._answer_over():
            return
        now = self._loop.time()
        timeout = self._read_timeout
        if self._untimed:
            self._untimed = False  # read since the last look: at most LOOK * timeout ago
            self._last_read = now
        deadline = self._last_read + timeout
        if self._reading_paused or now < deadline:
            # Armed for an earlier request or read: due at the last one's. A paused read is
            # the client's doing, the upstream is not late: half a timeout more from now.
            paused = self._reading_paused
            at = max(deadline, now + timeout * 0.5) if paused else deadline
            if self._streaming():
                at = min(at, now + timeout * LOOK)
            self._due_by(at)  # (no timer now: armed at ``at``)
            return
        self._timed_out()

    def _answer_over(self) -> bool:
        return self.complete or self.failed or self.transport is None

    def _streaming(self) -> bool:
        return self._chunked is not None

    def _timed_out(self) -> None:
        self._fail(UpstreamTimeout("upstream did not answer in time", kind="timeout"))
        self.abort()

    def idle(self) -> float:
        """Its request is over and it is kept for another: forget the answer, read again (a
        connection that is idle must read: an upstream closing it is noticed). Returns when
        it went idle: its answer's last read, now or as good as."""
        self._sink = None
        self._head_future = None
        self._done = None
        self._asked = False
        self.body_producer = None
        if self._reading_paused:
            self.resume_reading()  # paused by the last client
        self.idle_since = self._last_read
        self.reused = True
        return self.idle_since

    @property
    def reusable(self) -> bool:
        head = self._head
        return (
            self.transport is not None
            and self.complete
            and not self.failed
            and self.request_sent
            and self.tunnel is None
            and head is not None
            and head.keep_alive
        )

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.flush()
            self.transport.write(data)

    def flush(self) -> None:
        """Write the head ``send`` holds now: before anything else uses the transport."""
        head = self._held
        if head is not None:
            self._held = None
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(head)

    def close_transport(self) -> None:
        """Close once what was written is sent (the WebSocket relay's end)."""
        if self.transport is not None:
            self.flush()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.flush()
            self.transport.abort()

    def __repr__(self) -> str:
        return f"<UpstreamConnection {self.key} complete={self.complete}>"
