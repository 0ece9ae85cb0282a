"""The admin listener: HTTP/1.1 on an asyncio protocol, parsed by llhttp (``httptools``).

One ``AdminConnection`` a client connection. Requests are answered one at a time, in the
order they came (pipelined ones wait, with the socket's reading paused); each is answered
by ``App.handle``. A client that goes away cancels the handler of its request (what
aiohttp calls handler cancellation).

Limits, each refused with the app's JSON error and the connection closed:
- a head over ``MAX_HEAD`` bytes or ``MAX_FIELDS`` fields: 431;
- a request not read whole within ``READ_TIMEOUT`` from its first byte: 408;
- a body over the app's ``max_body``: 413 when the handler reads it (``web.Request.read``),
  before ``100 Continue`` is sent, and the body is never buffered past the limit;
- a malformed request (llhttp's verdict): 400.

A connection idle for ``IDLE_TIMEOUT`` between requests is closed. ``AdminListener.stop``
stops accepting, runs the app's shutdown hooks (streams end), lets the requests in progress
finish for up to ``grace`` seconds, then cancels them and closes every connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from gateway import listen

from .web import App, Headers, HTTPError, Request, Response, StreamResponse

log = logging.getLogger("gateway.admin")

MAX_HEAD = 32 * 1024
"""Bytes of a request's target and header fields together."""
MAX_FIELDS = 100
READ_TIMEOUT = 30.0
"""Seconds from a request's first byte to its last."""
IDLE_TIMEOUT = 75.0
"""Seconds a kept connection may wait for its next request."""
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Refused(Exception):
    """Raised in a parser callback: the request is refused with ``error``."""

    def __init__(self, error: HTTPError) -> None:
        self.error = error


class _Incoming:
    """One request's body as it arrives: what ``Request.read`` waits on."""

    __slots__ = ("_conn", "answered", "chunks", "complete", "continued", "done", "error",
                 "expects", "size")  # fmt: skip

    def __init__(self, conn: AdminConnection, expects: bool, declared: int | None) -> None:
        self._conn = conn
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.expects = expects
        self.continued = False
        self.answered = False  # a stream's head was written
        self.done: asyncio.Future[None] = conn.loop.create_future()
        self.error: HTTPError | None = None
        if declared is not None and declared > conn.app.max_body:
            self.error = _too_large(conn.app)

    def add(self, data: bytes) -> None:
        if self.error is not None:
            return
        self.size += len(data)
        if self.size > self._conn.app.max_body:
            self.chunks.clear()
            self.fail(_too_large(self._conn.app))
            return
        self.chunks.append(data)

    def finish(self) -> None:
        self.complete = True
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, error: HTTPError) -> None:
        if self.error is None:
            self.error = error
        if not self.done.done():
            self.done.set_result(None)

    async def read_body(self) -> bytes:
        if self.error is None and not self.complete:
            if self.expects and not self.continued and self.size == 0:
                self.continued = True
                self._conn.write(CONTINUE)
            self._conn.resume()
            await self.done
        if self.error is not None:
            raise self.error
        return b"".join(self.chunks)

    def write(self, data: bytes) -> None:
        self.answered = True
        self._conn.write(data)

    async def drain(self) -> None:
        await self._conn.drain()


def _too_large(app: App) -> HTTPError:
    return HTTPError(413, f"the body is larger than the {app.max_body} bytes accepted")


class AdminConnection(asyncio.Protocol):
    """One client connection of the admin listener."""

    def __init__(self, app: App, listener: AdminListener) -> None:
        self.app = app
        self.loop = asyncio.get_running_loop()
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._queue: collections.deque[tuple[Request, _Incoming, bool]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reading = True
        self._paused_writing = False
        self._drain: asyncio.Future[None] | None = None
        self._closed = False
        self._closing = False  # the listener stops: no new request is taken
        self._current: _Incoming | None = None  # the body of the request being answered
        # The message being parsed.
        self._head = 0
        self._target: list[bytes] = []
        self._fields: list[tuple[str, str]] = []
        self._incoming: _Incoming | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._listener.connections.add(self)
        self._arm(IDLE_TIMEOUT, self._idle)

    def data_received(self, data: bytes) -> None:
        if self._closed or self._transport is None or self._transport.is_closing():
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No route upgrades: the request is answered as it is, then the connection ends.
            self._pause()
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause.error)
            else:
                log.error("admin request parser callback failed", exc_info=cause)
                self._refuse(HTTPError(500, "internal error (see the gateway log)"))
        except httptools.HttpParserError as e:
            self._refuse(HTTPError(400, f"malformed request: {e}"))

    def eof_received(self) -> bool:
        # A client's end of its side is taken as its going away (aiohttp does the same): the
        # transport closes, and so cancels the handler under way.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._listener.connections.discard(self)
        self._listener.settled()
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: so does its handler
        if self._incoming is not None:
            self._incoming.fail(HTTPError(400, "the client closed the connection"))
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- llhttp's callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._head = 0
        self._target = []
        self._fields = []
        if self.busy:
            self._pause()  # a pipelined request waits until the one before it is answered
        self._arm(READ_TIMEOUT, self._slow)

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        self._target.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value))
        if len(self._fields) >= MAX_FIELDS:
            raise _Refused(HTTPError(431, f"more than {MAX_FIELDS} header fields"))
        self._fields.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        headers = Headers(self._fields)
        length = headers.get("Content-Length")
        chunked = "Transfer-Encoding" in headers
        declared = int(length) if length is not None and length.isdigit() else None
        has_body = chunked or bool(declared)
        expects = False
        expect = headers.get("Expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                raise _Refused(HTTPError(417, f"Expect: {expect} is not supported"))
            expects = parser.get_http_version() == "1.1"
        incoming = _Incoming(self, expects, declared)
        if not has_body:
            incoming.finish()
        self._incoming = incoming
        request = Request(
            self.app,
            incoming,
            parser.get_method().decode("ascii"),
            _origin_form(b"".join(self._target).decode("latin-1")),
            parser.get_http_version(),
            headers,
            has_body,
        )
        self._target = []
        keep_alive = parser.should_keep_alive() and not parser.should_upgrade()
        self._queue.append((request, incoming, keep_alive))
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._serve())
            self._task.add_done_callback(self._listener.settled)

    def on_body(self, body: bytes) -> None:
        if self._incoming is not None:
            self._incoming.add(body)
            if self._incoming.error is not None:
                self._pause()  # the rest is not read: the connection ends after the answer

    def on_message_complete(self) -> None:
        if self._incoming is not None:
            self._incoming.finish()
            self._incoming = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _grow(self, size: int) -> None:
        self._head += size
        if self._head > MAX_HEAD:
            raise _Refused(HTTPError(431, f"the request's head is over {MAX_HEAD} bytes"))

    # -- answering ----------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _serve(self) -> None:
        while self._queue and not self._closed:
            request, incoming, keep_alive = self._queue.popleft()
            self._current = incoming
            if not self._queue and incoming.error is None:
                self.resume()
            response = await self._answer(request)
            self._current = None
            if self._closed:
                return
            close = not keep_alive or not incoming.complete or incoming.error is not None
            close = close or self._closing
            if isinstance(response, StreamResponse) and response.prepared:
                await response.write_eof()
                close = close or request.version != "1.1"
            elif incoming.answered:  # a stream began, then its handler failed: cut it short
                close = True
            else:
                self._send(request, response, close=close)
            if close:
                self._close()
                return
            # The next answer waits until this one is on its way: a client that pipelines
            # requests and reads nothing holds one answer in memory, not all of them.
            try:
                await self.drain()
            except ConnectionResetError:
                return
        if self._closing:
            self._close()  # the listener stopped while this answer was on its way
        elif not self._closed and not self.busy_reading:
            self._arm(IDLE_TIMEOUT, self._idle)

    @property
    def busy_reading(self) -> bool:
        return self._incoming is not None or bool(self._target)

    async def _answer(self, request: Request) -> Response:
        try:
            return await self.app.handle(request)
        except asyncio.CancelledError:
            raise
        except HTTPError as e:  # an app without the error middleware
            return self.app.refusal(e)
        except Exception:
            log.exception("admin %s %s failed", request.method, request.path)
            return self.app.refusal(HTTPError(500, "internal error (see the gateway log)"))

    def _send(self, request: Request, response: Response, *, close: bool) -> None:
        if not close and request.version == "1.0":  # a 1.0 client keeps it only if told so
            response.headers["Connection"] = "keep-alive"
        try:
            self._write_whole(response, close=close, head_only=request.method == "HEAD")
        except ValueError:
            log.exception("admin %s %s: an answer not safe to send", request.method, request.path)
            refusal = self.app.refusal(HTTPError(500, "internal error (see the gateway log)"))
            self._write_whole(refusal, close=close, head_only=request.method == "HEAD")

    def _write_whole(self, response: Response, *, close: bool, head_only: bool = False) -> None:
        """``response`` framed by its length; ``ValueError`` (nothing written) if a header
        field is not safe to send."""
        body = response.body
        head = response.head(length=len(body), close=close, chunked=False)
        self.write(head if head_only else head + body)

    def _refuse(self, error: HTTPError) -> None:
        """Answer ``error`` and close, unless an answer is under way (then just close)."""
        if self._closed:
            return
        if not self.busy:
            self._write_whole(self.app.refusal(error), close=True)
        self._close()

    def _slow(self) -> None:
        self._timer = None
        incoming = self._incoming
        if self.busy and (incoming is None or incoming is not self._current):
            # A pipelined request, whose reading this side paused: its time starts again.
            self._arm(READ_TIMEOUT, self._slow)
            return
        error = HTTPError(408, f"the request was not received within {READ_TIMEOUT:g} s")
        if incoming is not None and self.busy:
            incoming.fail(error)  # its handler answers 408, then the connection ends
        else:
            self._refuse(error)

    def _idle(self) -> None:
        self._timer = None
        if not self.busy and not self.busy_reading:
            self._close()

    # -- the transport ------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self._closed:
            self._transport.write(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("the client closed the connection")
        if self._paused_writing:
            self._drain = self.loop.create_future()
            await self._drain

    def resume(self) -> None:
        if not self._reading and self._transport is not None and not self._closed:
            self._reading = True
            self._transport.resume_reading()

    def _pause(self) -> None:
        if self._reading and self._transport is not None and not self._closed:
            self._reading = False
            self._transport.pause_reading()

    def _arm(self, delay: float, callback: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(delay, callback)

    def _close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def shutdown(self) -> None:
        """The listener stops: close now if idle, else after the answer under way."""
        self._closing = True
        if not self.busy:
            self._close()

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()


def _origin_form(target: str) -> str:
    """The path and query of a request target (an absolute-form one too)."""
    if target.startswith("/"):
        return target
    if "://" in target:
        parts = urlsplit(target)
        return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return "/" + target if target != "*" else "*"


class AdminListener:
    """The admin app on a listening socket: ``sock`` if given (bound on ``host``/``port``
    earlier, served from ``start``; ``stop`` closes it), else one bound by ``start``."""

    def __init__(self, app: App, host: str, port: int, sock: socket.socket | None = None) -> None:
        self.app = app
        self.host = host
        self.port = port if sock is None else sock.getsockname()[1]
        self._sock = sock
        self.connections: set[AdminConnection] = set()
        self._server: asyncio.Server | None = None
        self._settled: asyncio.Event | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock, self._sock = self._sock, None
        self._server = await listen(
            loop, lambda: AdminConnection(self.app, self), (self.host, self.port), False, sock
        )
        sockets = self._server.sockets
        if sockets and self.port == 0:
            self.port = sockets[0].getsockname()[1]

    def settled(self, _: object = None) -> None:
        """Wake ``stop`` once no connection is answering (a task's or a connection's end)."""
        if self._settled is not None and not any(c.busy for c in self.connections):
            self._settled.set()

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting; let the answers under way finish (``grace`` seconds at most)."""
        if self._sock is not None:  # never started
            self._sock.close()
            self._sock = None
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        for hook in self.app.on_shutdown:
            await hook(self.app)
        self._settled = asyncio.Event()
        for conn in list(self.connections):
            conn.shutdown()
        self.settled()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self._settled.wait()
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # let the aborted transports report their loss
