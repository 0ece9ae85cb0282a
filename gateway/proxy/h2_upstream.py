"""The upstream leg over HTTP/2: h2c by prior knowledge to the replicas of services with
``upstream_protocol: http2`` (gRPC's), or h2 agreed by ALPN where the service has
``upstream_tls``, on a ``wire.h2_session.Session`` (its client side).

``H2Connector`` keeps, per upstream address, connections that each carry up to their cap of
streams at once (the replica's SETTINGS_MAX_CONCURRENT_STREAMS, and the gateway's own
``http2.upstream_max_concurrent_streams``); a request takes a stream on the first with room,
and a new connection is opened when all are full (one connect at a time per address: the
requests that wait for it share it). ``H2UpstreamConnection`` frames, and each request's
``UpstreamStream`` is its body's sink (sent as the replica's windows allow, the client
paused meanwhile) and the answer's producer (what the replica sends is acknowledged, so
its window opens again, only while the client takes it): both ways are bounded by windows,
never by a buffer of the gateway's.

Interpreted, and imported on a service's first HTTP/2 request (``handler``): a gateway
whose services speak HTTP/1.1 does not load it. The HTTP/1.1 leg
(``connector``, ``upstream_connection``) is untouched by it.

Invariants: a stream whose connection is lost or reset before its end fails with an
``UpstreamError`` (never an answer presented as complete); a connection that got GOAWAY
takes no new stream and closes once its streams are over.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Collection
from typing import Final, cast

from ..errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from ..pool.service_pool import ServicePool
from ..pool.upstream import Upstream
from ..wire import grpc, h2_session, headers, http2
from ..wire.h2_session import (
    ConnectionTerminated,
    DataReceived,
    Event,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from ..wire.http2 import Fields
from ..wire.upstream_tls import UpstreamTls, UpstreamTlsError, handshake_failure
from .exchange import Exchange
from .messages import ResponseHead
from .request import RequestBody
from .retry import Failed
from .streams import Producer, ResponseStream

log = logging.getLogger(__name__)

BODY_HIGH_WATER: Final = 64 * 1024
"""Request body bytes held for the replica's windows before the client is paused."""
ANSWER_HEADER_LIST_SIZE: Final = 256 * 1024
"""The most an answer's head (or trailers) may decode to (SETTINGS_MAX_HEADER_LIST_SIZE):
over it, the replica's connection is ended."""


class UpstreamStream:
    """One request on an upstream HTTP/2 connection: its body's sink, its answer's producer."""

    transport: asyncio.Transport | None = None
    """``streams.BodySink``'s: never a transport (the body is framed, copied, not spliced)."""

    def __init__(self, conn: H2UpstreamConnection, stream_id: int) -> None:
        self.conn = conn
        self.stream_id = stream_id
        loop = conn.loop
        self.head: asyncio.Future[ResponseHead] = loop.create_future()
        self.done: asyncio.Future[Fields] = loop.create_future()
        """The answer ended: its trailers (empty if none); or the stream's error."""
        self.body_producer: Producer | None = None
        """The client, paused while the request body waits for the replica's windows."""
        self.sink: ResponseStream | None = None
        self.early: list[tuple[bytes, int]] = []
        """Answer data that came before ``attach`` (the head not passed on yet)."""
        self._out: deque[bytes] = deque()
        self._out_bytes = 0
        self._ending = False
        self.sent_end = False
        """END_STREAM went (with the head, or after the body)."""
        self._client_paused = False
        self._paused = False
        self._unacknowledged = 0
        self.trailers: Fields = []
        self.bytes_out = 0
        self.request_body: RequestBody | None = None
        """The request's body, whose trailers (``RequestBody.trailers``) follow it."""

    # -- the request body (``streams.BodySink``) ------------------------------------------

    def body_data(self, data: bytes | memoryview) -> None:
        self._out.append(bytes(data))
        self._out_bytes += len(data)
        self.send_pending()

    def body_end(self) -> None:
        self._ending = True
        self.send_pending()

    def body_error(self, exc: BaseException) -> None:
        """The request body broke off (the client's doing: ``upstream_connection``'s rule)."""
        error = exc if isinstance(exc, GatewayError) else UpstreamError(str(exc))
        error.kind = "client"
        self.conn.reset(self, h2_session.CANCEL)
        self.fail(error)

    def send_pending(self) -> None:
        """Send what the body holds, as the windows allow (then END_STREAM if it ended)."""
        if self.done.done():
            return
        self.conn.send_body(self, self._out, self._ending)
        self._out_bytes = sum(map(len, self._out))
        producer = self.body_producer
        full = self._out_bytes > BODY_HIGH_WATER
        if producer is not None and full != self._client_paused:
            self._client_paused = full
            if full:
                producer.pause_reading()
            else:
                producer.resume_reading()

    # -- the answer (``streams.Producer``) ------------------------------------------------

    def attach(self, sink: ResponseStream) -> None:
        """The answer's body goes to ``sink`` from now on: the head pending in it (an
        HTTP/1.1 client's codec leaves it there), then what came already."""
        self.sink = sink
        sink.write_head()
        early, self.early = self.early, []
        for data, size in early:
            self.data(data, size)

    def data(self, data: bytes, size: int) -> None:
        """A DATA frame's ``data`` (``size`` bytes of the flow-control windows)."""
        sink = self.sink
        if sink is None:
            self.early.append((data, size))
            return
        if data:
            sink.response_data(data)
            self.bytes_out += len(data)
        if self._paused:
            self._unacknowledged += size
        else:
            self.conn.acknowledge(self, size)

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        self._paused = False
        size, self._unacknowledged = self._unacknowledged, 0
        if size:
            self.conn.acknowledge(self, size)

    def end(self, trailers: Fields) -> None:
        if not self.done.done():
            self.trailers = trailers
            self.done.set_result(trailers)

    def fail(self, exc: BaseException) -> None:
        for future in (self.head, self.done):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # (retrieved: whoever awaits it sees it all the same)

    def cancel(self) -> None:
        """The exchange is cut off: reset the stream unless it ended."""
        if not self.done.done():
            self.conn.reset(self, h2_session.CANCEL)
            self.fail(UpstreamError("the request was cut off"))


class H2UpstreamConnection(asyncio.Protocol):
    """One HTTP/2 connection to a replica, multiplexing its requests' streams."""

    def __init__(
        self,
        address: str,
        cap: int,
        on_gone: Callable[[H2UpstreamConnection], None],
        tls: UpstreamTls | None = None,
    ) -> None:
        self.address = address  # its key in ``H2Connector.connections``
        self._tls = tls
        self.cap = cap
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, UpstreamStream] = {}
        self.ready: asyncio.Future[None] = self.loop.create_future()
        """The replica's SETTINGS arrived (its stream cap is known)."""
        self.closing = False
        """GOAWAY came or the connection is lost: no new stream."""
        self._on_gone = on_gone
        self._flushing = False
        """A write of what the session made is due at the end of the loop's turn."""
        self._session = h2_session.Session(True, cap, ANSWER_HEADER_LIST_SIZE)

    @property
    def room(self) -> int:
        """Streams it may still open now."""
        if self.closing or self.transport is None:
            return 0
        peer = self._session.remote_max_concurrent_streams
        return min(self.cap, peer) - len(self.streams)

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass)
        if self._tls is not None:  # the handshake is done: h2 agreed, or nothing is sent
            refusal = self._tls.refusal(transport.get_extra_info("ssl_object"))
            if refusal is not None:
                log.warning("upstream %s: %s", self.address, refusal)
                self.ready.set_exception(UpstreamConnectError(refusal, kind="connect"))
                self.ready.exception()
                self.transport.abort()
                return
        self._session.initiate()
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self._session.receive(data)
        except h2_session.ProtocolError as exc:
            self._broken(UpstreamProtocolError(f"upstream broke HTTP/2: {exc}"))
            return
        for event in events:
            self._event(event)
        self._flush()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.closing = True
        if not self.ready.done():
            self.ready.set_exception(UpstreamConnectError("upstream closed the connection"))
            self.ready.exception()
        streams = list(self.streams.values())
        self.streams.clear()
        for stream in streams:
            stream.fail(UpstreamError("upstream closed the HTTP/2 connection", kind="disconnect"))
        self._on_gone(self)

    # -- events ---------------------------------------------------------------------------

    def _event(self, event: Event) -> None:
        if isinstance(event, ResponseReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None and not stream.head.done():
                stream.head.set_result(response_head(event.headers))
        elif isinstance(event, DataReceived):
            stream = self.streams.get(event.stream_id)
            size = event.flow_controlled_length
            if stream is None:
                self._session.acknowledge(event.stream_id, size)
            else:
                stream.data(event.data, size)
        elif isinstance(event, TrailersReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.trailers = event.headers
        elif isinstance(event, StreamEnded):
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                if not stream.head.done():
                    stream.fail(UpstreamProtocolError("upstream ended the stream without a head"))
                stream.end(stream.trailers)
            self._maybe_close()
        elif isinstance(event, StreamReset):
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                code = event.error_code
                refused = code == h2_session.REFUSED_STREAM
                by = "upstream" if event.remote_reset else "the gateway, for the upstream's error,"
                stream.fail(
                    UpstreamError(
                        f"{by} reset the stream (error code {code})",
                        kind="refused" if refused else "other",
                    )
                )
            self._maybe_close()
        elif isinstance(event, RemoteSettingsChanged):
            if not self.ready.done():
                self.ready.set_result(None)
            self._send_all()
        elif isinstance(event, WindowUpdated):
            self._send_all()
        elif isinstance(event, ConnectionTerminated):
            self.closing = True
            last = event.last_stream_id
            for stream_id in [i for i in self.streams if i > last]:
                self.streams.pop(stream_id).fail(
                    UpstreamError("upstream refused the stream (GOAWAY)", kind="refused")
                )
            self._maybe_close()

    def _send_all(self) -> None:
        for stream in list(self.streams.values()):
            stream.send_pending()

    # -- what streams ask for -------------------------------------------------------------

    def open(self, fields: Fields, end: bool) -> UpstreamStream:
        """A new stream sending the request head ``fields`` (``end``: no body follows)."""
        conn = self._session
        stream_id = conn.open_stream()
        stream = UpstreamStream(self, stream_id)
        self.streams[stream_id] = stream
        conn.send_headers(stream_id, fields, end)
        stream.sent_end = end
        self._flush()
        return stream

    def send_body(self, stream: UpstreamStream, out: deque[bytes], ending: bool) -> None:
        conn = self._session
        stream_id = stream.stream_id
        if stream_id not in self.streams or stream.sent_end:
            return
        body = stream.request_body
        trailers = body.trailers if body is not None else None
        try:
            while out:
                window = conn.sendable(stream_id)
                if window <= 0:
                    break
                chunk = http2.take(out, window)
                last = ending and not out and not trailers
                conn.send_data(stream_id, chunk, last)
                stream.sent_end = last
            if ending and not out and not stream.sent_end:
                if trailers:
                    conn.send_headers(stream_id, trailers, True)
                else:
                    conn.end_stream(stream_id)
                stream.sent_end = True
        except h2_session.ProtocolError:
            pass  # the stream ended meanwhile (the replica answered and reset it)
        self._flush()

    def acknowledge(self, stream: UpstreamStream, size: int) -> None:
        self._session.acknowledge(stream.stream_id, size)
        self._flush()

    def reset(self, stream: UpstreamStream, code: int) -> None:
        if self.streams.pop(stream.stream_id, None) is None:
            return
        try:
            self._session.reset_stream(stream.stream_id, code)
        except h2_session.ProtocolError:
            pass
        self._flush()
        self._maybe_close()

    # -- the connection -------------------------------------------------------------------

    def _flush(self) -> None:
        """Write what the session made at the end of the loop's turn, with the rest of the turn's
        frames (every stream's: one write, where a write each cost a call more than half
        of the gateway's CPU)."""
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._write_out)

    def _write_out(self) -> None:
        self._flushing = False
        data = self._session.take()
        if data and self.transport is not None:
            self.transport.write(data)

    def _broken(self, error: GatewayError) -> None:
        self.closing = True
        streams = list(self.streams.values())
        self.streams.clear()
        for stream in streams:
            stream.fail(error)
        if self.transport is not None:
            self.transport.abort()

    def _maybe_close(self) -> None:
        if self.closing and not self.streams and self.transport is not None:
            self._write_out()  # the last frames, before the close
            self.transport.close()

    def close(self) -> None:
        """GOAWAY, and close once the open streams are over."""
        if self.transport is None:
            return
        self.closing = True
        self._session.goaway(h2_session.NO_ERROR, 0)
        self._write_out()
        if not self.streams:
            self.transport.close()

    def __repr__(self) -> str:
        return f"<H2UpstreamConnection {self.address} streams={len(self.streams)}>"


class H2Connector:
    """The HTTP/2 connections to the upstreams, by address (and TLS settings:
    ``UpstreamTls.key``)."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self.connections: dict[str, list[H2UpstreamConnection]] = {}
        self._connecting: dict[str, asyncio.Task[H2UpstreamConnection]] = {}

    async def open(
        self,
        host: str,
        port: int,
        fields: Fields,
        end: bool,
        connect_timeout: float,
        tls: UpstreamTls | None = None,
    ) -> UpstreamStream:
        """A stream to ``host:port`` sending the request head ``fields``: on a connection
        with room, else on a new one, over ``tls`` if given: h2 agreed by ALPN
        (``UpstreamConnectError`` if it cannot be made)."""
        address = f"{host}:{port}"
        key = address if tls is None else tls.key(address)
        while True:
            for conn in self.connections.get(key, ()):
                if conn.room > 0:
                    return conn.open(fields, end)
            task = self._connecting.get(key)
            if task is None:
                task = asyncio.get_running_loop().create_task(
                    self._connect(key, host, port, connect_timeout, tls)
                )
                self._connecting[key] = task
            await asyncio.shield(task)

    async def _connect(
        self, key: str, host: str, port: int, connect_timeout: float, tls: UpstreamTls | None
    ) -> H2UpstreamConnection:
        loop = asyncio.get_running_loop()
        address = f"{host}:{port}"
        try:
            async with asyncio.timeout(connect_timeout or None):
                if tls is None:
                    _, conn = await loop.create_connection(
                        lambda: H2UpstreamConnection(key, self.max_streams, self._gone),
                        host,
                        port,
                    )
                else:
                    _, conn = await loop.create_connection(
                        lambda: H2UpstreamConnection(key, self.max_streams, self._gone, tls),
                        host,
                        port,
                        ssl=tls.context(loop.time()),
                        server_hostname=tls.server_hostname(host),
                    )
                await conn.ready
        except UpstreamConnectError as exc:
            raise UpstreamConnectError(
                f"cannot connect to upstream {address} over HTTP/2: {exc}", kind="connect"
            ) from None
        except (OSError, TimeoutError, UpstreamTlsError) as exc:
            reason = handshake_failure(exc) if isinstance(exc, OSError) else str(exc) or "timed out"
            raise UpstreamConnectError(
                f"cannot connect to upstream {address} over HTTP/2: {reason}",
                kind="connect",
            ) from None
        finally:
            self._connecting.pop(key, None)
        self.connections.setdefault(key, []).append(conn)
        return conn

    def _gone(self, conn: H2UpstreamConnection) -> None:
        conns = self.connections.get(conn.address)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self.connections[conn.address]

    def close(self) -> None:
        for task in list(self._connecting.values()):
            task.cancel()
        for conns in list(self.connections.values()):
            for conn in list(conns):
                conn.close()


def response_head(fields: Fields) -> ResponseHead:
    """An answer's HTTP/2 fields as the head the request path passes on (HTTP/1.1's form: the
    end-to-end fields a block of ``Name: value`` lines)."""
    head = ResponseHead()
    lines = []
    for name, value in fields:
        if name == b":status":
            head.status = int(value)
        elif not name.startswith(b":"):
            lines.append(name + b": " + value)
    kept, length, _, hop = headers.response_fields(b"\r\n".join(lines))
    head.fields = kept
    head.hop = hop
    head.content_length = length
    return head


async def forward(
    ex: Exchange,
    sp: ServicePool,
    upstream: Upstream,
    connector: H2Connector,
    tried: Collection[str] = (),
    tls: UpstreamTls | None = None,
) -> None:
    """One attempt of ``ex`` on ``upstream`` over HTTP/2, h2 over ``tls`` if given
    (``Proxy``'s, in the request's task): the request head, its body as it comes, the
    answer's head, its body as it comes, and its trailers. A ``grpc-timeout`` bounds the
    call (``Exchange.deadline``, from its arrival: its waits for a replica and every
    attempt): past it, DEADLINE_EXCEEDED (504 before the answer began, ``grpc-status: 4``
    in the trailers after). Raises ``Failed`` for an
    attempt that may be retried (nothing went to the client yet), ``GatewayError`` for one
    that may not (the rules of HTTP/1.1's attempts: ``retry``; ``tried``: the upstreams tried
    so far, this one included); an answer broken off is cut off at the client.

    A body already whole when the attempt begins is taken at once and kept
    (``Exchange.whole_body``), so that a stream the replica refuses can be retried with it."""
    request = ex.request
    timeouts = sp.routing.timeouts
    ex.attempting(upstream)
    body = request.body
    if body is not None and body.error is not None:
        error = body.error
        raise Failed(error, "client") if isinstance(error, GatewayError) else error
    is_grpc = grpc.is_grpc(request.headers)
    scheme = b"http" if tls is None else b"https"
    fields = http2.request_fields(ex.upstream_head(ex.target, upstream), scheme)
    try:
        stream = await connector.open(
            upstream.host, upstream.port, fields, body is None, timeouts.connect, tls
        )
    except GatewayError as exc:
        raise ex.failure(exc) from None
    sink: ResponseStream | None = None
    whole = ex.whole_body
    try:
        async with asyncio.timeout_at(ex.deadline):  # the call's, from its arrival
            if body is not None:
                stream.request_body = body
                ex.bytes_in = body.received
                if whole is None and body.complete and not body.taken:
                    whole = ex.whole_body = body.take()
                if whole is not None:
                    stream.body_data(whole)
                    stream.body_end()
                else:
                    stream.body_producer = ex.client
                    try:
                        body.attach(stream)
                    except GatewayError as exc:
                        stream.cancel()
                        raise ex.failure(exc) from None
            try:
                # A gRPC answer's head may wait on the client's messages: its deadline, not
                # the read timeout, bounds it.
                read = None if is_grpc or not timeouts.read else timeouts.read
                async with asyncio.timeout(read):
                    head = await stream.head
            except (GatewayError, TimeoutError) as exc:
                if body is not None and whole is None:
                    body.detach()
                if isinstance(exc, TimeoutError) and not isinstance(exc, GatewayError):
                    if read is None:
                        raise
                    exc = UpstreamTimeout("upstream did not answer in time", kind="timeout")
                stream.cancel()
                raise ex.failure(exc) from None
            ex.ttfb = ex.proxy.loop.time() - ex.started
            if head.status >= 500:
                failed = ex.check_answer(None, head, tried)
                if failed is not None:
                    if body is not None and whole is None:
                        body.detach()
                    raise failed  # (the stream is reset on the way out)
            if is_grpc and stream.done.done() and not stream.bytes_out and not stream.early:
                # Trailers-only (a gRPC status with no message): one HEADERS, as it came.
                stream.done.result()
                extra = ex.answering(head)
                ex.client.answer(request, head, ex.request_id_bytes(), extra, stream, b"")
                ex.delivered(None, 0)
                return
            sink = ex.open_answer(stream, head)
            stream.attach(sink)
            trailers = await stream.done
    except TimeoutError as exc:
        if isinstance(exc, GatewayError):
            raise
        stream.cancel()
        if not ex.response_started:
            raise UpstreamTimeout(
                "the call's deadline (grpc-timeout) passed", kind="timeout"
            ) from None
        ex.error = "upstream_timeout"
        assert sink is not None
        ex.bytes_out = sink.bytes_out
        ex.client.trailers(grpc.status_fields(grpc.DEADLINE_EXCEEDED, "deadline exceeded"))
        return
    except GatewayError as exc:
        stream.cancel()
        if sink is None:
            raise ex.failure(exc) from None
        ex.broke_off(None, sink, exc)
        return
    except BaseException:
        stream.cancel()
        raise
    sink.response_end()
    if trailers:
        ex.client.trailers(trailers)
    ex.delivered(None, sink.bytes_out)
