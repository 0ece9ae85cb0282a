"""The client's side of the proxy: one ``ClientConnection`` (an asyncio protocol) per client.

What the connection reads is ``reader.RequestReader``'s (requests parsed, limited and timed);
this is what it does with them. Each request is handed to the proxy when its head is
complete, so a body streams to the upstream while it arrives: ``begin`` serves the common
request without a task of its own (its ``exchange``), anything else runs as one task of
``handler``. Pipelined requests wait their turn. The answer (``streams.ResponseStream``) is
written as it comes, the writes of one loop turn together (``batch``), with back-pressure:
a full socket buffer here pauses reading from the upstream (``producer``), and a client that
leaves its answer unread for ``send_timeout`` is cut off. A client that goes away cancels its
request's task, or its exchange. ``max_connections``: a connection beyond it is answered 503
and closed at once.

Invariants: a response is either complete or its connection is dropped (never a short body
presented as complete); a connection closed after an answer while the client may still send
lingers first, so the client reads the answer before any reset. One whose client said its
request was the last (``Connection: close``), and sent nothing after it, closes at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol, cast

from ..config import ListenerLimits
from ..errors import ClientGone
from ..wire import http1
from ..wire.batch import WriteBatch
from ..wire.splice import Buffers
from .reader import PAUSE_PIPELINE, RequestReader
from .request import IncomingRequest
from .streams import WRITE_HIGH_WATER, Producer

log = logging.getLogger(__name__)

Handler = Callable[["ClientConnection", IncomingRequest], Coroutine[Any, Any, None]]
"""Serves a request as a task of its own (``Proxy.handle``)."""
Begin = Callable[["ClientConnection", IncomingRequest], bool]
"""Serves a request without a task of its own if it can (``Proxy.begin``); False if not."""


class Cancellable(Protocol):
    """The exchange of a request served without a task (``Begin``): cut off when the client
    goes away."""

    def cancel(self) -> None: ...


class Parks(Protocol):
    """Where idle connections are parked (``parking.Parking``)."""

    def park(self, fd: int, deadline: float, park_after: float) -> bool: ...

    def close(self) -> None: ...


class ConnectionGate:
    """Counts open client connections against ``limit``; holds what they share: the read
    buffers, and the batch their writes wait in until the end of the loop's turn (the
    connector's; a batch of its own, which knows of no request in flight, never holds a
    write)."""

    __slots__ = ("batch", "buffers", "limit", "loop", "open", "parked", "parking")

    def __init__(self, limit: int, batch: WriteBatch | None = None) -> None:
        self.limit = limit
        self.open = 0
        """Connections in the loop (``ClientConnection``s)."""
        self.parked = 0
        """Connections out of it, idle (``parking``): they count against ``limit`` too."""
        self.parking: Parks | None = None
        """Where the plain listener's idle connections are parked (None: not parked)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The running loop, kept at the first connection (Python 3.11's
        ``get_running_loop`` makes a system call, ``getpid``)."""
        self.buffers = Buffers()
        self.batch = batch if batch is not None else WriteBatch()


_TOO_MANY: Final = http1.json_response(
    503,
    {"error": "too_many_connections", "message": "the gateway is at its connection limit"},
    close=True,
)


class ClientConnection(RequestReader):
    """One client connection: run each request in turn, write its answer, close."""

    # Slots: ten thousand idle connections each save a __dict__.
    __slots__ = (
        "_begin",
        "_connections",
        "_gate",
        "_handler",
        "_held",
        "_over",
        "_pipeline",
        "_send_timer",
        "_uncounted",
        "_writing_paused",
        "exchange",
        "on_lost",
        "producer",
        "secure",
        "send_timed_out",
        "task",
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
        super().__init__(limits, loop)
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
            self._pause(PAUSE_PIPELINE)

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
                self._resume(PAUSE_PIPELINE)
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
        self._resume(PAUSE_PIPELINE)

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
        """Answer a head that cannot be served, and stop reading: nothing after it counts."""
        self._closing = True
        self._clear_deadline()
        self._parsing = None
        if self._pipeline is not None:
            self._pipeline.clear()
        if self.transport is None:
            return
        if self.active is None:
            self.write(http1.json_response(status, {"error": code, "message": message}, close=True))
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
            self.abort()

    def __repr__(self) -> str:
        return (
            f"<ClientConnection peer={self.peer} active={self.active!r} "
            f"queued={len(self._pipeline or ())} closing={self._closing}>"
        )
