"""The client's side of the proxy over HTTP/1.1: one ``ClientConnection`` (an asyncio
protocol) per client, which reads its requests and writes their answers.

Reading. Requests are parsed with llhttp (``httptools``), strict: every smuggling shape
llhttp knows (Content-Length with Transfer-Encoding, duplicate Content-Length, bad chunk
sizes, obs-fold, bare LF, control characters) is a 400 and the connection is closed; the
plainest whole heads are read by ``plainhead`` instead, as llhttp would. On top of the parser:

- limits: a request line over ``max_header_size`` is 414, a header field over it, more than
  ``MAX_HEADERS`` fields, or a head over ``HEAD_LIMIT_FACTOR`` times it is 431 (``request``);
- one deadline at a time: the request head within ``header_timeout`` (``HEAD``) and the next
  request within ``keepalive_timeout`` (``KEEPALIVE``) in a slot of the loop's ``Wheel``, so
  a connection is closed no earlier than its deadline and at most ``WHEEL_SLOT`` after it (an
  idle connection's slot comes first at ``park_after``, to park it: ``parking``); each read
  of a body within ``body_timeout`` and at ``body_min_rate`` (``BODY``) and the reads
  discarded while lingering (``LINGER``) on a timer of the connection's own, moved lazily (a
  later deadline only changes ``_deadline``; the timer, when it fires early, is armed again);
- reading pauses while a reason holds (requests queued behind the active one, a body
  buffered, an upstream that cannot take more of it), and resumes when none is left.

A large request body framed by a Content-Length is spliced to the upstream without copying
it (``splice``): its reads go to a ``splice.SplicedReads`` meanwhile.

Running. Each request is handed to the proxy when its head is complete, so a body streams to
the upstream while it arrives: ``begin`` serves the common request without a task of its own
(its ``exchange``), anything else runs as one task of ``handler``. Pipelined requests wait
their turn. The answer (``streams.ResponseStream``) is written as it comes, the writes of one
loop turn together (``batch``), with back-pressure: a full socket buffer here pauses reading
from the upstream (``producer``), and a client that leaves its answer unread for
``send_timeout`` is cut off. A client that goes away cancels its request's task, or its
exchange. ``max_connections``: a connection beyond it is answered 503 and closed at once.

Invariants: a request is taken only once its head parsed cleanly; nothing after a refused
head is read as another request; a response is either complete or its connection is dropped
(never a short body presented as complete); a connection closed after an answer while the
client may still send lingers first, so the client reads the answer before any reset. One
whose client said its request was the last (``Connection: close``), and sent nothing after
it, closes at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol, cast

import httptools

from ..config import ListenerLimits
from ..errors import BadRequest, ClientGone, GatewayError, OwnAnswer, RequestTimeout
from ..pool.events import ClientTimeout
from ..wire import http1, http2, plainhead
from ..wire.batch import WriteBatch
from ..wire.http1 import HEAD_LIMIT_FACTOR
from ..wire.plainhead import PlainRequest
from ..wire.splice import RAW_BODY_MIN, Buffers, Reader, splice_reads
from . import messages, openai
from .codec import Begin, Cancellable, Downstream, Handler, Tunneled
from .limits import Limits, limits_of
from .messages import ResponseHead
from .request import HOST, IncomingRequest, Refused, RequestBody, head_problem
from .streams import WRITE_HIGH_WATER, Producer, ResponseStream
from .websocket import Relay
from .wheel import Deadlined, wheel_of

log = logging.getLogger(__name__)

# What the connection's one deadline is for.
NONE: Final = 0
HEAD: Final = 1
KEEPALIVE: Final = 2
BODY: Final = 3
LINGER: Final = 4

# Why reading from the client is paused (a bit each; reading resumes when none is left).
_PAUSE_PIPELINE: Final = 1
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


class Parks(Protocol):
    """Where idle connections are parked (``parking.Parking``)."""

    def park(self, fd: int, deadline: float, park_after: float) -> bool: ...

    def close(self) -> None: ...


class ConnectionGate:
    """Counts open client connections against ``limit``; holds what they share: the read
    buffers, and the batch their writes wait in until the end of the loop's turn (the
    connector's; a batch of its own, which knows of no request in flight, never holds a
    write)."""

    __slots__ = (
        "batch",
        "buffers",
        "http2",
        "limit",
        "loop",
        "model_prefix",
        "open",
        "parked",
        "parking",
        "timed_out",
        "trace",
    )

    def __init__(
        self,
        limit: int,
        batch: WriteBatch | None = None,
        trace: bool = True,
        buffers: Buffers | None = None,
    ) -> None:
        self.limit = limit
        self.trace = trace
        """Requests are traced (``tracing.propagate``): a plain head's traceparent and
        tracestate are read, not passed on as they are (``plainhead.request``)."""
        self.open = 0
        """Connections in the loop (``ClientConnection``s)."""
        self.parked = 0
        """Connections out of it, idle (``parking``): they count against ``limit`` too."""
        self.parking: Parks | None = None
        """Where the plain listener's idle connections are parked (None: not parked)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The running loop, kept at the first connection (Python 3.11's
        ``get_running_loop`` makes a system call, ``getpid``)."""
        self.buffers = buffers if buffers is not None else Buffers()
        """The read buffers (``splice``): the connector's, so that both legs share one."""
        self.batch = batch if batch is not None else WriteBatch()
        self.model_prefix: str | None = None
        """``models.path_prefix``: a head refused under it is answered in OpenAI's shape."""
        self.http2: SwitchToHttp2 | None = None
        """Where a connection that opens with the HTTP/2 preface goes (h2c by prior
        knowledge); None: the preface is refused as any other bad head."""
        self.timed_out: Callable[[str, ClientTimeout], None] | None = None
        """Told of each client given up on for slowness, with its protocol
        (``Forwarding.client_timeout``: the observers count it)."""


class SwitchToHttp2(Protocol):
    """Serves a connection over HTTP/2 from now on (``server``: ``h2_downstream``)."""

    def __call__(self, transport: asyncio.Transport, secure: bool, read: bytes | None) -> None:
        """``read``: what was read of it (the preface and what followed); None: nothing."""


_TOO_MANY: Final = http1.json_response(
    503,
    {"error": "too_many_connections", "message": "the gateway is at its connection limit"},
    close=True,
)


class ClientConnection(asyncio.Protocol, Downstream):
    """One client connection over HTTP/1.1: read its requests, run each in turn, write the
    answers (the ``Downstream`` of its active request), close."""

    # Slots: ten thousand idle connections each save a __dict__.
    __slots__ = (
        "_begin",
        "_body_started",
        "_boundary",
        "_closing",
        "_connections",
        "_deadline",
        "_deadline_kind",
        "_gate",
        "_handler",
        "_head_bytes",
        "_held",
        "_last",
        "_limits",
        "_lingered",
        "_loop",
        "_over",
        "_parser",
        "_parsing",
        "_paused",
        "_pipeline",
        "_raw_remaining",
        "_raw_started",
        "_reads",
        "_send_timer",
        "_timer",
        "_timer_at",
        "_tunnel_data",
        "_uncounted",
        "_wheel_at",
        "_wheel_slot",
        "_writing_paused",
        "active",
        "exchange",
        "grpc_status",
        "on_lost",
        "park_after",
        "peer",
        "producer",
        "secure",
        "send_timed_out",
        "task",
        "transport",
        "tunnel",
    )

    def __init__(
        self,
        handler: Handler,
        limits: ListenerLimits,
        gate: ConnectionGate,
        connections: set[ClientConnection],
        begin: Begin | None = None,
    ) -> None:
        loop = gate.loop
        if loop is None:
            loop = gate.loop = asyncio.get_running_loop()
        self._limits: Limits = limits_of(limits)
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._closing = False
        self._deadline = 0.0
        self._deadline_kind = NONE
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._wheel_slot: set[Deadlined] | None = None
        """The ``Wheel`` slot this connection is in, if any (idle, or was since it fired)."""
        self._wheel_at = 0.0
        """When ``_wheel_slot`` was asked for (its slot ends within ``WHEEL_SLOT`` of it)."""
        self.park_after = self._limits.park_after
        """Idle this long, it is parked (``_park``); 0: never. The listener's ``park_after``,
        or longer for a connection that came back soon from parking (``parking``)."""
        self._parser: httptools.HttpRequestParser | None = None
        self.peer: str | None = None
        self._parsing: IncomingRequest | None = None
        """The request whose head or body is being read."""
        self._head_bytes = 0
        self.active: IncomingRequest | None = None
        """The request being answered."""
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
        self._handler = handler
        self._begin = begin
        self._gate = gate
        self._connections = connections
        self._held: bytes | None = None
        """What ``write`` holds until the end of the loop's turn (``batch``)."""
        self._uncounted = False
        """Not counted in the gate: refused at accept, or parked (``connection_lost`` has
        nothing to undo)."""
        self._pipeline: deque[IncomingRequest] | None = None
        """Requests read behind the active one, made at the first: an empty deque is 760
        bytes, a fifth of what an idle keep-alive connection holds."""
        self.task: asyncio.Task[None] | None = None
        self.exchange: Cancellable | None = None
        """The active request's exchange while it runs without a task (``Begin``)."""
        self._over: list[asyncio.Future[None]] | None = None
        """``request_over`` futures to resolve once no request is active."""
        self._writing_paused = False
        self.producer: Producer | None = None
        """The upstream connection whose answer is being written here (paused with us)."""
        self.on_lost: Callable[[], None] | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self.send_timed_out = False
        """The client left its answer unread for ``send_timeout`` and was cut off."""
        self.secure = False
        """Over TLS (set by ``tls.handshake`` before ``connection_made``)."""
        self.grpc_status: str | None = None
        """Always None: no gRPC over HTTP/1.1 (``Downstream``)."""

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport subclass
        gate = self._gate
        if gate.open + gate.parked >= gate.limit:
            self._uncounted = True
            log.debug("connection refused: %d open, %d parked", gate.open, gate.parked)
            tcp.write(_TOO_MANY)
            tcp.close()
            return
        gate.open += 1
        self._connections.add(self)
        tcp.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.transport = tcp
        peer = tcp.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        self._await_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._uncounted:
            return
        self._gate.open -= 1
        self._connections.discard(self)
        self.transport = None
        self._held = None
        self._closing = True
        self._stop_timer()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        for request in (self._parsing, self.active, *(self._pipeline or ())):
            if request is not None and request.body is not None:
                request.body.fail(ClientGone("the client closed the connection"))
        if self._pipeline is not None:
            self._pipeline.clear()
        if self.on_lost is not None:
            self.on_lost()
        elif self.task is not None and not self.task.done():
            self.task.cancel()
        elif self.exchange is not None:
            self.exchange.cancel()
        if self._over is not None:
            self._resolve_over()

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self.producer is not None:
            self.producer.pause_reading()
        timeout = self._limits.send_timeout
        if timeout and self._send_timer is None:
            self._send_timer = self._loop.call_later(timeout, self._send_timeout)

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self.producer is not None:
            self.producer.resume_reading()

    # -- requests -----------------------------------------------------------------------------

    def _buffers(self) -> Buffers:
        return self._gate.buffers

    def _take(self, request: IncomingRequest) -> None:
        """A request whose head was read: started now, or queued behind the active one."""
        self._last = request
        if self.active is None:
            self._start(request)
        else:
            if self._pipeline is None:
                self._pipeline = deque()
            self._pipeline.append(request)
            self._pause(_PAUSE_PIPELINE)

    def _start(self, request: IncomingRequest) -> None:
        self.active = request
        if self._begin is None or not self._begin(self, request):
            self.task = self._loop.create_task(self._run(request, self._handler(self, request)))

    def run(self, request: IncomingRequest, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Go on with the active request in a task of its own, running ``work``."""
        self.exchange = None
        self.task = task = self._loop.create_task(self._run(request, work))
        return task

    def finished(self, request: IncomingRequest, now: float) -> None:
        """The active request, served without a task, was answered; ``now``: the loop's
        time, read as it was (the keep-alive deadline runs from it)."""
        self.exchange = None
        self._finished(request, now)

    async def _run(self, request: IncomingRequest, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception:
            log.exception("request handler failed for %r", request)
            self.abort()
            return
        self._finished(request, self._loop.time())

    def request_over(self) -> asyncio.Future[None]:
        """A future resolved once no request is active here: the active one was answered
        or cut off, with a task of its own or without (shutdown waits for it)."""
        future = self._loop.create_future()
        if self.active is None or self.transport is None:
            future.set_result(None)
        else:
            if self._over is None:
                self._over = []
            self._over.append(future)
        return future

    def _resolve_over(self) -> None:
        waiting, self._over = self._over, None
        for future in waiting or ():
            if not future.done():
                future.set_result(None)

    def _finished(self, request: IncomingRequest, now: float) -> None:
        """The answer to ``request`` was written: next request, keep-alive or close."""
        if self._over is not None:
            self._resolve_over()
        self.active = None
        self.task = None
        self.exchange = None
        self.producer = None
        if self._last is request:
            self._last = None  # an idle connection holds no finished request
        transport = self.transport
        if transport is None or self.tunnel is not None:
            return
        body = request.body
        if not request.keep_alive or self._closing or (body is not None and not body.complete):
            if request.last and not self._closing and self._nothing_after(request):
                # The client sends nothing more, and all it sent was read: a plain close
                # resets nothing (nginx closes here too), and saves lingering's wake-up.
                self.close_transport()
                return
            self._linger()
            return
        pipeline = self._pipeline
        if pipeline:
            self._start(pipeline.popleft())
            if not pipeline:
                self._resume(_PAUSE_PIPELINE)
        elif self._parsing is None:
            self._idle(now)

    def _park(self) -> bool:
        """Idle for ``park_after``: handed to the listener's ``Parking`` if nothing is under
        way or buffered either way, and not over TLS (whose state is the transport's)."""
        parking = self._gate.parking
        transport = self.transport
        if (
            parking is None
            or transport is None
            or self.secure
            or self._closing
            or self.active is not None
            or self._parsing is not None
            or self._pipeline
            or self.tunnel is not None
            or self._paused
            or self._held is not None
            or self._raw_started
            or transport.get_write_buffer_size()
        ):
            return False
        sock = transport.get_extra_info("socket")
        if sock is None or not parking.park(sock.fileno(), self._deadline, self.park_after):
            return False
        # Out of the loop: its transport closes its own descriptor, not the connection.
        self._uncounted = True
        self._gate.open -= 1
        self._connections.discard(self)
        self._clear_deadline()
        self.transport = None
        transport.abort()
        return True

    def _nothing_after(self, request: IncomingRequest) -> bool:
        """All ``request`` sent was read, and nothing came after it."""
        body = request.body
        return (body is None or body.complete) and self._parsing is None and not self._pipeline

    def start_tunnel(self) -> None:
        """The relay took the connection over (``tunnel`` is set): read again."""
        self._clear_deadline()
        self._resume(_PAUSE_PIPELINE)

    # -- answers (``codec.Downstream``): HTTP/1.1's bytes and keep-alive -------------------

    def _kept(self, request: IncomingRequest) -> bool:
        """Whether the connection may serve another request after ``request``, as far as
        the request goes (an answer's framing may still end it): not if the client said it
        was the last, the connection is closing, or the rest of its body would have to be
        read first."""
        body = request.body
        return request.keep_alive and not self._closing and (body is None or body.complete)

    def _answer_head(
        self,
        request: IncomingRequest,
        head: ResponseHead,
        request_id: bytes,
        extra: bytes,
        producer: Producer,
        body: bytes,
    ) -> tuple[bool, bytes]:
        """The answer's head (then ``body``) as the client gets it, and whether its body is
        chunked; ``request.keep_alive`` says from now on whether the connection is kept."""
        self.producer = producer
        chunked, kept, data = messages.client_head(
            request, head, request_id, self._kept(request), extra=extra, body=body
        )
        request.keep_alive = kept
        return chunked, data

    def answer(
        self,
        request: IncomingRequest,
        head: ResponseHead,
        request_id: bytes,
        extra: bytes,
        producer: Producer,
        body: bytes,
    ) -> None:
        """A whole answer framed by its length: one ``bytes``, one write (``codec``)."""
        self.write(self._answer_head(request, head, request_id, extra, producer, body)[1])

    def open_answer(
        self,
        request: IncomingRequest,
        head: ResponseHead,
        request_id: bytes,
        extra: bytes,
        producer: Producer,
    ) -> ResponseStream:
        chunked, data = self._answer_head(request, head, request_id, extra, producer, b"")
        return ResponseStream(self, chunked, data)

    def send_error(self, request: IncomingRequest, exc: GatewayError, request_id: str) -> None:
        """The gateway's own answer; the connection closes after it if it could not be kept,
        or if the request's body broke (too slow, badly framed: the rest of it cannot be read
        as the next request)."""
        close = (
            not self._kept(request)
            or isinstance(exc, RequestTimeout | BadRequest)
            or (isinstance(exc, OwnAnswer) and exc.close)
        )
        if close:
            request.keep_alive = False
        self.write(messages.gateway_error_response(exc, request_id, close))

    def trailers(self, fields: list[tuple[bytes, bytes]]) -> None:
        """Dropped: the answer's body ends as its framing says (``codec.Downstream``)."""

    def upgrade(self, head: ResponseHead, request_id: str, upstream: Tunneled) -> Relay:
        self.write(messages.upgrade_head(head, request_id))
        relay = Relay(self, upstream)
        self.producer = upstream
        self.tunnel = relay.from_client
        self.on_lost = relay.client_lost
        return relay

    def start_relay(self, relay: Relay) -> None:
        if self.transport is None:
            relay.client_lost()
        early = self.take_tunnel_data()
        if early:
            relay.from_client(early)
        self.start_tunnel()

    def send_continue(self) -> None:
        """``100 Continue``: the client waits for it before it sends its body."""
        self.write(http1.CONTINUE)

    # -- writing ------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Write ``data``: at once if it is the turn's first write (or the only request is in
        flight), else at the end of the turn with the turn's other writes (``batch``)."""
        transport = self.transport
        if transport is None:
            return
        held = self._held
        if held is not None:
            self._held = held + data  # rare: a second answer in one turn (pipelining)
        elif self._gate.batch.hold(self):
            self._held = data
        else:
            transport.write(data)

    def flush(self) -> None:
        """Write what ``write`` holds now: before anything else uses the transport."""
        data = self._held
        if data is not None:
            self._held = None
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(data)

    def close_transport(self) -> None:
        """Close once what was written is sent (the WebSocket relay's end, an idle timeout)."""
        if self.transport is not None:
            self.flush()
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once: whatever response was under way is cut off."""
        self._closing = True
        if self.transport is not None:
            self.flush()
            self.transport.abort()

    def close(self) -> None:
        """Close now if idle, else after the answer under way (shutdown)."""
        self._closing = True
        if self.active is None and self.tunnel is None:
            self.close_transport()

    @property
    def closing(self) -> bool:
        return self._closing

    def socket_fd(self) -> int:
        transport = self.transport
        if transport is None or self.secure:
            return -1
        sock = transport.get_extra_info("socket")
        return -1 if sock is None else int(sock.fileno())

    @property
    def writing_paused(self) -> bool:
        """The transport holds more than its high-water mark (``producer`` is paused)."""
        return self._writing_paused

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer a head that cannot be served, and stop reading: nothing after it counts.
        On a model path (as far as its target was read) the answer is in OpenAI's shape."""
        self._closing = True
        self._clear_deadline()
        refused, self._parsing = self._parsing, None
        if self._pipeline is not None:
            self._pipeline.clear()
        if self.transport is None:
            return
        if self.active is None:
            answer = (
                None
                if refused is None
                else openai.refused_head(
                    self._gate.model_prefix, refused.target, status, code, message
                )
            )
            if answer is not None:
                self.write(http1.plain_response(status, answer.body, answer.headers, close=True))
            else:
                body = {"error": code, "message": message}
                self.write(http1.json_response(status, body, close=True))
            self._linger()
            return
        # else: the answer under way finishes, then ``_finished`` closes (``_closing``).
        self.transport.pause_reading()

    def _linger(self) -> None:
        """Close after what was written: shut our side, discard what still comes, then close."""
        transport = self.transport
        self._closing = True
        if transport is None:
            return
        if self._lingered >= 0:
            return  # already lingering
        self.flush()
        if not transport.can_write_eof():
            transport.close()
            return
        if self._pipeline is not None:
            self._pipeline.clear()
        transport.write_eof()
        self._linger_reads()

    def _send_timeout(self) -> None:
        self._send_timer = None
        if self._writing_paused:
            log.debug("client left its response unread for %ss", self._limits.send_timeout)
            self.send_timed_out = True
            self._timed_out("send")
            self.abort()

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
            plain = plainhead.request(data, self._limits.max_header_size, self._gate.trace)
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
            if self._gate.http2 is not None and self._preface(data):
                return
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
        (
            method,
            target,
            block,
            kept,
            host,
            request_id,
            keep_alive,
            forwarded,
            auth,
            auth_at,
            traceparent,
            tracestate,
        ) = plain
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
        if traceparent is not None:
            request.traceparent = traceparent
        if tracestate is not None:
            request.tracestate = tracestate
        if self._gate.trace:
            request.traced = True
        request.keep_alive = keep_alive
        request.last = not keep_alive
        self._boundary = keep_alive
        self._head_bytes = 0
        self._clear_deadline()
        self._take(request)
        return True

    def _preface(self, data: bytes) -> bool:
        """llhttp stopped at the HTTP/2 preface (it pauses there): if it began this
        connection's reads, or a read after an answer, the connection goes to HTTP/2 with
        the preface and what followed it (``data`` is the read that ended it)."""
        parsing = self._parsing
        if parsing is None or parsing.target != b"*" or self.active is not None:
            return False
        before = self._head_bytes  # of the preface, in earlier reads (a head's reads count)
        tail = len(http2.PREFACE) - before
        if tail <= 0 or not data.startswith(http2.PREFACE[before:]):
            return False
        switch = self._gate.http2
        transport = self.transport
        if switch is None or transport is None or self._pipeline:
            return False
        # Out of this listener's books: the HTTP/2 connection counts itself.
        self._uncounted = True
        self._gate.open -= 1
        self._connections.discard(self)
        self._stop_timer()
        self._clear_deadline()
        self._parsing = None
        self._parser = None
        self._closing = True
        self.transport = None
        switch(transport, self.secure, http2.PREFACE + data[tail:])
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
        self._pause(_PAUSE_PIPELINE)

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
        self._timed_out("body")
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

    # -- deadlines: one at a time, of one kind (``_deadline_kind``) ---------------------------

    def _set_deadline(self, timeout: float, kind: int, now: float) -> None:
        """Due ``timeout`` after ``now``, the loop's time (``loop.time()``) as the caller
        read it: an answer's end gives its own to the keep-alive deadline after it."""
        if not timeout:
            self._clear_deadline()
            return
        when = now + timeout
        self._deadline = when
        self._deadline_kind = kind
        timer = self._timer
        if kind == KEEPALIVE or kind == HEAD:  # in a slot of the loop's wheel, no timer
            if timer is not None:
                timer.cancel()
                self._timer = None
            if kind == KEEPALIVE:
                park_after = self.park_after
                if park_after and park_after < timeout:
                    when = now + park_after  # its slot comes first to park it (``on_wheel``)
            slot = self._wheel_slot
            if slot is None:
                self._into_wheel(when)
            elif when < self._wheel_at:  # its slot is later: moved
                slot.discard(self)
                self._into_wheel(when)
            # else its slot comes by ``when`` (within a slot) and puts it back (``on_wheel``)
            return
        if timer is None or self._timer_at > when:
            if timer is not None:
                timer.cancel()
            self._timer_at = when
            self._timer = self._loop.call_at(when, self._on_timer)

    def _into_wheel(self, when: float) -> None:
        """In the loop's wheel, in the slot that comes by ``when`` (out of none now)."""
        self._wheel_slot = wheel_of(self._loop).add(self, when)
        self._wheel_at = when

    def _clear_deadline(self) -> None:
        self._deadline = 0.0
        self._deadline_kind = NONE

    def on_wheel(self) -> None:
        """The ``Wheel`` slot this connection was in came (it is out of the wheel now)."""
        self._wheel_slot = None
        kind = self._deadline_kind
        if (kind != KEEPALIVE and kind != HEAD) or self.transport is None:
            return  # busy (a body's deadline has a timer), or closed
        now = self._loop.time()
        deadline = self._deadline
        if now < deadline:  # due later than when it was put in
            when = deadline
            if kind == KEEPALIVE and self.park_after:
                park_at = deadline - self._limits.keepalive_timeout + self.park_after
                if park_at <= now and self._park():
                    return
                if now < park_at < deadline:
                    when = park_at  # idle since less than ``park_after``
            self._into_wheel(when)
            return
        self._clear_deadline()
        if kind == HEAD:
            self._head_timed_out()
            return
        self._closing = True
        self.close_transport()

    def _on_timer(self) -> None:
        self._timer = None
        if self._deadline_kind == NONE or self.transport is None:
            return
        if self._deadline_kind == KEEPALIVE or self._deadline_kind == HEAD:
            if self._wheel_slot is None:  # the wheel's (``_set_deadline``), not ours
                self._into_wheel(self._deadline)
            return
        if self._loop.time() < self._deadline:
            self._timer_at = self._deadline
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        kind = self._deadline_kind
        self._clear_deadline()
        if kind == BODY:
            self._body_timed_out()
        elif kind == LINGER:
            self.close_transport()

    def _head_timed_out(self) -> None:
        log.debug("request head not received within %ss: closing", self._limits.header_timeout)
        self._timed_out("header")
        self.abort()

    def _timed_out(self, timeout: ClientTimeout) -> None:
        timed_out = self._gate.timed_out
        if timed_out is not None:
            timed_out("http/1.1", timeout)

    def _await_head(self) -> None:
        """A request head is due within ``header_timeout``."""
        self._set_deadline(self._limits.header_timeout, HEAD, self._loop.time())

    def _idle(self, now: float) -> None:
        """No request now: the next is due within ``keepalive_timeout`` of ``now``."""
        self._set_deadline(self._limits.keepalive_timeout, KEEPALIVE, now)

    def _stop_timer(self) -> None:
        """The connection is closed: no timer of its own, out of the wheel."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wheel_slot is not None:
            self._wheel_slot.discard(self)
            self._wheel_slot = None

    def __repr__(self) -> str:
        return (
            f"<ClientConnection peer={self.peer} active={self.active!r} "
            f"queued={len(self._pipeline or ())} closing={self._closing}>"
        )
