"""What a client connection reads: requests, parsed, limited and timed (``RequestReader``).

It parses requests with llhttp (``httptools``), strict: every smuggling shape llhttp knows
(Content-Length with Transfer-Encoding, duplicate Content-Length, bad chunk sizes, obs-fold,
bare LF, control characters) is a 400 and the connection is closed; the plainest whole heads
are read by ``plainhead`` instead, as llhttp would. On top of the parser:

- limits: a request line over ``max_header_size`` is 414, a header field over it, more than
  ``MAX_HEADERS`` fields, or a head over ``HEAD_LIMIT_FACTOR`` times it is 431 (``request``);
- deadlines (its base, ``deadlines.ConnectionDeadlines``): the request head within
  ``header_timeout`` and the next request within ``keepalive_timeout`` in a slot of the
  loop's ``Wheel``; each read of a body within ``body_timeout`` (and at ``body_min_rate``)
  and the reads discarded while lingering on a timer of the connection's own;
- reading pauses while a reason holds (requests queued behind the active one, a body
  buffered, an upstream that cannot take more of it), and resumes when none is left.

A large request body framed by a Content-Length is spliced to the upstream without copying
it (``splice``): its reads go to a ``splice.SplicedReads`` meanwhile.

``ClientConnection`` is the subclass that does something with what is read (``_take``,
``_refuse``) and writes; this class only reads. Invariants: a request is taken only once
its head parsed cleanly; nothing after a refused head is read as another request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

import httptools

from ..config import ListenerLimits
from ..errors import BadRequest, RequestTimeout
from ..wire import plainhead
from ..wire.http1 import HEAD_LIMIT_FACTOR
from ..wire.plainhead import PlainRequest
from ..wire.splice import RAW_BODY_MIN, Buffers, Reader, splice_reads
from .deadlines import BODY, HEAD, LINGER, ConnectionDeadlines
from .request import HOST, IncomingRequest, Refused, RequestBody, head_problem

log = logging.getLogger(__name__)

# Why reading from the client is paused (a bit each; reading resumes when none is left).
PAUSE_PIPELINE: Final = 1
_PAUSE_BODY: Final = 2
_PAUSE_UPSTREAM: Final = 4

LINGER_TIMEOUT: Final = 2.0
"""Closing after an answer while the client may still be sending (an unread body, a refused
head): the gateway shuts its side, then reads and discards for up to this long between
reads (nginx's ``lingering_timeout``), so the client's socket is not reset before it read
the answer."""
LINGER_BYTES: Final = 64 * 1024 * 1024
"""At most this much is discarded while lingering; then the connection is dropped."""


class _CheckedHost:
    """The last Host value found well formed, on any connection: clients send the same few,
    and a new connection need not match the pattern again."""

    value = b""


_checked_host: Final = _CheckedHost()


class RequestReader(ConnectionDeadlines):
    """Reads requests off one client connection: parse, limit, time out, splice bodies."""

    __slots__ = (
        "_body_started",
        "_boundary",
        "_head_bytes",
        "_last",
        "_lingered",
        "_parser",
        "_parsing",
        "_paused",
        "_raw_remaining",
        "_raw_started",
        "_reads",
        "_tunnel_data",
        "active",
        "peer",
        "tunnel",
    )

    def __init__(self, limits: ListenerLimits, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limits, loop)
        self._parser: httptools.HttpRequestParser | None = None
        self.peer: str | None = None
        self._parsing: IncomingRequest | None = None
        """The request whose head or body is being read."""
        self._head_bytes = 0
        self.active: IncomingRequest | None = None
        """The request being answered (``ClientConnection``)."""
        self._paused = 0
        self.tunnel: Callable[[bytes], None] | None = None
        """Where reads go once the connection is a WebSocket relay."""
        self._body_started = 0.0
        self._last: IncomingRequest | None = None
        """The last request taken, until answered."""
        self._tunnel_data = b""
        self._raw_remaining = 0
        self._raw_started = False
        self._boundary = True
        """llhttp is between messages and takes another (not after ``Connection: close``):
        a whole plain head may be read without it (``plainhead``)."""
        self._lingered = -1
        """Bytes discarded while lingering before the close; -1 while not lingering."""
        self._reads: Reader | None = None
        """Where reads go while a large body may be spliced upstream: made at the first
        (``read_into``), so that a connection that never sends one holds none."""

    # -- reads while a large body is spliced (``splice.SplicedReads``) -----------------------

    def read_into(self, sizehint: int) -> memoryview:
        """A splice buffer while a large body goes to an upstream, else the scratch buffer."""
        transport = None
        parsing = self._parsing
        if self._raw_started and self._lingered < 0 and self.tunnel is None:
            if parsing is not None and parsing.body is not None:
                transport = parsing.body.sink_transport()
        reads = self._reads
        if reads is None:
            reads = self._reads = Reader(self._buffers())
        return reads.buffer(transport)

    def read_done(self, nbytes: int) -> None:
        reads = self._reads
        assert reads is not None  # made by ``read_into``
        splice = reads.spliced(nbytes, self.data_received)
        if splice is None:
            return
        rest = b""
        if nbytes > self._raw_remaining:
            rest = splice.view(nbytes)[self._raw_remaining :].tobytes()  # what follows
            nbytes = self._raw_remaining
        body = self._parsing.body if self._parsing is not None else None
        assert body is not None
        self.on_body(splice.view(nbytes))
        if body.error is None:
            splice.wrote(nbytes)
        if not self._raw_remaining:
            self._raw_end(rest)

    # -- reading -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.tunnel is not None:
            self.tunnel(data)
            return
        if self._lingered >= 0:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.abort()
            else:
                self._deadline = self._loop.time() + LINGER_TIMEOUT
            return
        parsing = self._parsing
        if self._closing and (parsing is None or parsing.body is None):
            return  # closing: a body under way is still read, nothing new is begun
        if self._raw_started:
            self._raw_body(data)
            return
        if parsing is None and self._boundary and plainhead.COMPILED:
            plain = plainhead.request(data, self._limits.max_header_size)
            if plain is not None and self._plain_request(plain):
                return
        parser = self._parser
        if parser is None:
            parser = self._parser = httptools.HttpRequestParser(self)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._upgraded(data[upgrade.args[0] :])
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            if isinstance(refused, Refused):  # raised by one of our callbacks
                self._refuse(refused.status, refused.code, refused.message)
                return
            parsing = self._parsing
            if parsing is not None and parsing.body is not None:
                # The head was fine, the body's framing is not (a bad chunk size): the
                # request fails with 400 if nothing was answered yet, and nothing after it
                # is read.
                log.debug("bad request body from %s: %s", self.peer, exc)
                parsing.body.fail(BadRequest(f"the request body is not valid HTTP/1.1: {exc}"))
                self._closing = True
                self._parsing = None
                self._clear_deadline()
                if self.transport is not None:
                    self.transport.pause_reading()
                    if parsing is not self.active:
                        self.abort()
                return
            log.debug("bad request head from %s: %s", self.peer, exc)
            self._refuse(400, "bad_request", f"the request is not valid HTTP/1.1: {exc}")
        else:
            if self._raw_remaining:
                self._raw_started = True  # what comes next skips the parser (``_raw_body``)
                splice_reads(self.transport, self, True)
            elif self._parsing is not None and self._parsing.body is None:
                # Still in the head: bound it (llhttp keeps a partial field to itself), and
                # time it from now, its first read (unless an earlier read began it).
                self._head_bytes += len(data)
                if self._head_bytes > HEAD_LIMIT_FACTOR * self._limits.max_header_size:
                    self._refuse(431, "header_too_large", "the request head is too large")
                elif self._deadline_kind != HEAD:
                    self._await_head()

    def _plain_request(self, plain: PlainRequest) -> bool:
        """A whole plain request head, read without llhttp (``plainhead``): what the parser's
        callbacks would have made of it. False (nothing done) if its Host is not well formed:
        then llhttp's way refuses it."""
        method, target, block, kept, host, request_id, keep_alive, forwarded, auth, auth_at = plain
        if host and host != _checked_host.value:
            if not HOST.fullmatch(host):
                return False
            _checked_host.value = host
        request = IncomingRequest(None)
        request.raw_fields = block
        request.plain_lines = kept
        request.forwarded = forwarded
        if auth is not None:
            request.authorization = auth
            request.authorization_at = auth_at
        request.method = method
        request.target = target
        request.host = host
        request.request_id = request_id
        request.keep_alive = keep_alive
        request.last = not keep_alive
        self._boundary = keep_alive
        self._head_bytes = 0
        self._clear_deadline()
        self._take(request)
        return True

    def _raw_body(self, data: bytes) -> None:
        """A large body framed by Content-Length, past llhttp (which would copy each piece).

        llhttp is left mid-message, so the connection gets a new parser, which reads what
        follows the body (a pipelined request) as the next request.
        """
        if self._parsing is None:  # the request was given up meanwhile
            self._raw_started = False
            splice_reads(self.transport, self, False)
            self._raw_remaining = 0
            if self._reads is not None:
                self._reads.splice = None  # what the upstream's transport holds is left to it
            return
        remaining = self._raw_remaining
        rest = b""
        if len(data) > remaining:
            data, rest = data[:remaining], data[remaining:]
        self.on_body(data)
        if not self._raw_remaining:
            self._raw_end(rest)

    def _raw_end(self, rest: bytes) -> None:
        """The large body is complete: the splice closed, and ``rest`` (what followed it)
        parsed by a new parser."""
        reads = self._reads
        if reads is not None and reads.splice is not None:
            body = self._parsing.body if self._parsing is not None else None
            reads.end(body.sink_transport() if body is not None else None)
        self._raw_started = False
        splice_reads(self.transport, self, False)
        self._parser = None
        self.on_message_complete()
        if rest:
            self.data_received(rest)

    # -- parser callbacks (httptools) ---------------------------------------------------------

    def on_message_begin(self) -> None:
        # The head's deadline is set only if a read leaves it incomplete (``data_received``):
        # most heads come whole in one read.
        self._parsing = IncomingRequest([])
        self._boundary = False
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        request = self._parsing
        assert request is not None
        request.target += url
        if len(request.target) > self._limits.max_header_size:
            raise Refused(414, "uri_too_long", "the request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._parsing
        assert request is not None
        _checked_host.value = request.add_field(
            name, value, self._limits.max_header_size, _checked_host.value
        )

    def on_headers_complete(self) -> None:
        request = self._parsing
        assert request is not None
        parser = self._parser
        assert parser is not None
        request.method = parser.get_method().decode("ascii")
        request.version = parser.get_http_version()
        request.last = not parser.should_keep_alive()
        request.keep_alive = not request.last and not self._closing
        problem = head_problem(request)
        if problem is not None:
            raise Refused(*problem)
        if request.chunked or request.content_length:
            expect = any(
                n.lower() == b"expect" and v.lower() == b"100-continue" for n, v in request.headers
            )
            request.body = RequestBody(self, expect and request.version == "1.1")
            timeout = self._limits.body_timeout
            now = self._body_started = self._loop.time()
            if timeout:
                self._set_deadline(timeout, BODY, now)
            else:
                self._clear_deadline()
            length = request.content_length
            if not request.chunked and length is not None and length > RAW_BODY_MIN:
                self._raw_remaining = length
        else:
            self._clear_deadline()
        self._take(request)

    def on_body(self, data: bytes | memoryview) -> None:
        if self._raw_remaining:
            self._raw_remaining -= len(data)
        request = self._parsing
        assert request is not None
        assert request.body is not None
        request.body.feed(data)
        if self._deadline_kind == BODY:
            body = request.body
            timeout = self._limits.body_timeout
            deadline = self._loop.time() + timeout
            rate = self._limits.body_min_rate
            if rate:
                deadline = min(deadline, self._body_started + timeout + body.received / rate)
            self._deadline = deadline

    def on_message_complete(self) -> None:
        self._raw_remaining = 0
        request = self._parsing
        assert request is not None
        self._parsing = None
        self._boundary = request.keep_alive
        if request.body is not None:
            request.body.finish()
        if self.active is None and not self._closing and self._lingered < 0:
            # Answered already, from the parser's callback (a 404): idle from now on, and
            # ``_finished`` did not know it yet (the head was still being read).
            self._idle(self._loop.time())
        elif self._deadline_kind == BODY:
            self._clear_deadline()

    # -- an upgrade ----------------------------------------------------------------------------

    def _upgraded(self, rest: bytes) -> None:
        """llhttp stopped after an upgrade request's head: what follows is not HTTP/1.1.

        A WebSocket upgrade may become a relay (``start_tunnel``); any other one is served
        as a plain request. Either way the connection closes after it, as llhttp cannot go
        back to parsing requests.
        """
        request = self._last
        if request is not None:
            request.keep_alive = False
            if request.is_websocket:
                self._tunnel_data = rest
        self._pause(PAUSE_PIPELINE)

    def take_tunnel_data(self) -> bytes:
        """Bytes that followed the upgrade request's head (the first frames), once."""
        data, self._tunnel_data = self._tunnel_data, b""
        return data

    # -- flow control -------------------------------------------------------------------------

    def _pause(self, reason: int) -> None:
        if not self._paused and self.transport is not None:
            self.transport.pause_reading()
            if self._deadline_kind == BODY:
                self._clear_deadline()  # the client is not to blame for our pause
        self._paused |= reason

    def _resume(self, reason: int) -> None:
        if not self._paused & reason:
            return
        self._paused &= ~reason
        if not self._paused and self.transport is not None and not self._closing:
            self.transport.resume_reading()
            parsing = self._parsing
            if parsing is not None and parsing.body is not None and self._limits.body_timeout:
                self._set_deadline(self._limits.body_timeout, BODY, self._loop.time())

    def pause_body(self) -> None:
        """Too much of the request body is buffered (no upstream took it yet)."""
        self._pause(_PAUSE_BODY)

    def resume_body(self) -> None:
        """The request body's buffer was taken."""
        self._resume(_PAUSE_BODY)

    def pause_reading(self) -> None:
        """The upstream cannot take more of the body (its socket buffer is full)."""
        self._pause(_PAUSE_UPSTREAM)

    def resume_reading(self) -> None:
        self._resume(_PAUSE_UPSTREAM)

    # -- what a passed deadline does, and lingering ----------------------------------------

    def _body_timed_out(self) -> None:
        request = self._parsing
        if request is None or request.body is None:
            return
        limits = self._limits
        rate = f" or averaged under {limits.body_min_rate} B/s" if limits.body_min_rate else ""
        request.body.fail(
            RequestTimeout(
                f"the request body paused for over {limits.body_timeout:g} s{rate}",
                body_timeout=limits.body_timeout,
            )
        )
        self._closing = True
        if self.active is not request and self.transport is not None:
            # Queued behind another answer: nobody will answer it; drop the connection.
            self.abort()

    def _linger_reads(self) -> None:
        """Our side is shut: what still comes is read and discarded (``LINGER_TIMEOUT``)."""
        self._lingered = 0
        self._parsing = None
        self._paused = 0
        if self.transport is not None:
            self.transport.resume_reading()
        self._set_deadline(LINGER_TIMEOUT, LINGER, self._loop.time())

    # -- what the connection does (``ClientConnection``) ---------------------------------------

    def _take(self, request: IncomingRequest) -> None:
        """A request whose head was read: start it, or queue it."""
        raise NotImplementedError

    def _buffers(self) -> Buffers:
        """The read buffers of the connection's loop (``splice``)."""
        raise NotImplementedError

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer a head that cannot be served, and read nothing after it."""
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        raise NotImplementedError
