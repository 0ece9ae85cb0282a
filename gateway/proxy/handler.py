"""The request handler of the data plane: route, lease, forward and stream both ways.

One request:  route (404)  ->  lease a routable upstream (wait up to ``queue_timeout``, else
503)  ->  an upstream connection (``connector``)  ->  the request head with rewritten headers,
the body spliced from the client as it arrives  ->  the answer's head  ->  its body spliced
back to the client  ->  one ``RequestRecord`` to each observer. A WebSocket upgrade that the
upstream accepts turns both connections into a relay (``websocket``), holding its lease
while open.

Two ways through, with the same outcomes. ``begin`` takes the common request (no body, no
upgrade, an idle keep-alive connection to the upstream it picks) from the parser's callback
and answers it from the upstream connection's (``_Fast``): no task, no future, no coroutine,
which cost a request more than its routing and its headers together. Everything else, and
whatever goes unusually on that way (a failed attempt, to retry or answer), is ``handle``,
run as the request's task.

Retries go to a different routable upstream, within ``retries.attempts`` and
``retries.timeout``, and only while nothing is lost by them: no response byte sent to the
client and no request body byte taken from it. A connect failure is always retried; a
connection the upstream closed or reset before answering only for an idempotent request
without a body (a stale keep-alive connection); with ``retries.on_status`` a 502, 503 or 504
answer to such a request too.

Invariants:
- every lease is released, on every path, cancellation included;
- every error the gateway makes itself is JSON ``{"error", "message", "request_id", ...}``
  and carries X-Request-Id;
- a response whose upstream body breaks off is aborted (the connection dropped without the
  last chunk), never completed short, and counts against the upstream in passive detection
  (a 2xx-4xx answer is reported "ok" only once its body arrived whole);
- a slow client is the client's fault, never the upstream's: a request body that pauses past
  ``limits.body_timeout`` gets 408, a client that leaves its answer unread for
  ``limits.send_timeout`` is cut off; neither is reported to passive detection;
- cancellation (the client went away, a drain timed out) is never swallowed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from typing import Final

from .. import router
from ..config import ProxyConfig
from ..errors import (
    BadRequest,
    GatewayError,
    NoRoute,
    RequestTimeout,
    RequestTooLarge,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from ..events import RequestObserver, RequestRecord
from ..pool import Lease, Pool, ServicePool
from ..upstream import Upstream
from ..wire import headers, http1
from .client import IncomingRequest, gateway_error_response
from .connector import Connector, ResponseHead, UpstreamConnection
from .streams import ResponseStream
from .websocket import Relay

log = logging.getLogger(__name__)

IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
RETRY_STATUSES: Final = frozenset({502, 503, 504})
NO_BODY_STATUSES: Final = frozenset({204, 304})
ROUTED_CACHED: Final = 4096
"""(Host, target) pairs whose route ``Proxy`` keeps (then it starts over)."""
ROUTED_TARGET_MAX: Final = 512
"""Longer targets are routed anew each time: the cache stays small."""
_Routed = tuple[str, str, bytes]


class _Exchange:
    """What one request has done so far, across its attempts.

    Attributes read their class defaults until set: one is made per request, and setting
    each in ``__init__`` cost more than the rest of its making.
    """

    path: str = ""
    service: str = ""
    upstream: Upstream | None = None
    status: int = 0
    ttfb: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    retries: int = 0
    retry_reasons: tuple[str, ...] = ()
    error: str | None = None
    response_started: bool = False
    """Response headers went to the client: no other answer is possible."""
    complete: bool = False
    """The answer was delivered in full (a cancellation after that is no error)."""
    sp: ServicePool | None = None
    """The service, once routed."""
    target: bytes = b""
    """The request target sent upstream, once routed."""
    conn: UpstreamConnection | None = None
    """The upstream connection of ``begin``'s attempt."""

    def __init__(self, request_id: str, started: float) -> None:
        self.request_id = request_id
        self.started = started


def _no_route(request: IncomingRequest, path: str) -> NoRoute:
    host = request.host.decode("latin-1")
    return NoRoute(f"no route for host {host!r} and path {path!r}", host=host, path=path)


class _Failed(Exception):
    """An attempt failed before the client got anything; ``kind`` says if a retry may help."""

    def __init__(self, error: GatewayError, kind: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind


class _Fast:
    """An exchange ``Proxy.begin`` started: told of its answer by the upstream connection
    (``connector.Waiter``), cancelled by the client connection (the client went away) or its
    pool (``abort``: a drain timed out). Exactly one of ``answered``, ``failed`` and
    ``cancel`` ends it, or hands it on to the request's task; each clears the references
    to it. It holds the request in flight itself (``ServicePool.hold``): no ``Lease``."""

    __slots__ = ("ex", "held", "proxy", "request", "sink")

    def __init__(self, proxy: Proxy, request: IncomingRequest, ex: _Exchange) -> None:
        self.proxy = proxy
        self.request = request
        self.ex = ex
        self.sink: ResponseStream | None = None
        """Where the answer's body goes while it streams."""
        self.held: str | None = None
        """The upstream this holds the request in flight on, until ``_end``."""

    def abort(self) -> None:
        """A drain of its upstream timed out (``pool.Holder``)."""
        self.cancel()

    def answered(self, conn: UpstreamConnection, head: ResponseHead) -> None:
        proxy, request, ex = self.proxy, self.request, self.ex
        sp, upstream = ex.sp, ex.upstream
        assert sp is not None
        assert upstream is not None
        now = proxy._loop.time()
        ex.ttfb = now - ex.started
        if head.status >= 500:
            failed = proxy._answered(request, ex, sp, conn, head, (upstream.id,))
            if failed is not None:
                self._retry(failed)
                return
        chunked, data = proxy._client_head(request, ex, conn, head)
        if conn.complete and not chunked:  # the whole answer, at once (most)
            body = conn.take_body()
            request.conn.write(data + body)
            self._delivered(len(body), now)
            return
        sink = ResponseStream(request.conn, chunked)
        done = conn.stream_to(sink, data)  # never raises: the connection has not failed
        if done is None:
            self._delivered(sink.bytes_out, now)
        else:
            self.sink = sink
            done.add_done_callback(self._streamed)

    def _streamed(self, done: asyncio.Future[None]) -> None:
        """The body of the answer ended, whole or broken off (unless cut off before)."""
        sink = self.sink
        if self.request.conn.exchange is not self or sink is None:
            return  # cancelled meanwhile
        self.sink = None
        error = None if done.cancelled() else done.exception()
        if error is None:
            self._delivered(sink.bytes_out, self.proxy._loop.time())
            return
        proxy, request, ex = self.proxy, self.request, self.ex
        assert ex.sp is not None
        assert ex.conn is not None
        if not isinstance(error, GatewayError):
            error = UpstreamProtocolError(f"upstream response failed: {error!r}")
        proxy._broke_off(request, ex, ex.sp, ex.conn, sink, error)
        self._end()
        proxy._record(request, ex, proxy._loop.time())

    def _delivered(self, bytes_out: int, now: float) -> None:
        proxy, request, ex = self.proxy, self.request, self.ex
        assert ex.sp is not None
        assert ex.conn is not None
        proxy._delivered(request, ex, ex.sp, ex.conn, bytes_out)
        self._end()
        proxy._record(request, ex, now)
        request.conn.finished(request)

    def failed(self, conn: UpstreamConnection, error: GatewayError) -> None:
        proxy, ex = self.proxy, self.ex
        assert ex.sp is not None
        conn.abort()
        self._retry(proxy._failed(error, ex, ex.sp))

    def cancel(self) -> None:
        """Cut the exchange off: the client went away, or a drain timed out."""
        proxy, request, ex = self.proxy, self.request, self.ex
        client = request.conn
        if client.exchange is not self:
            return  # over already
        conn = ex.conn
        self.sink = None
        if conn is not None:
            conn.waiter = None
            conn.abort()  # not through the connector, which is gone when the gateway stops
        self._end()
        ex.status = ex.status or 499
        ex.error = "client_too_slow" if client.send_timed_out else ex.error or "cancelled"
        proxy._record(request, ex, proxy._loop.time())
        client.abort()

    def _retry(self, failed: _Failed) -> None:
        """The attempt failed (its connection is gone): retry it, or answer, in a task.

        Nothing is held across: if the task is cancelled before it starts, nothing leaks.
        """
        self._end()
        proxy = self.proxy
        proxy.handed_on += 1
        self.request.conn.run(self.request, proxy.handle(self.request, self.ex, failed))

    def _end(self) -> None:
        """No longer in flight; drop the references that made this a cycle."""
        ex = self.ex
        held = self.held
        if held is not None:
            self.held = None
            assert ex.sp is not None
            ex.sp.unhold(held, self)
        ex.conn = None
        self.request.conn.exchange = None


class Proxy:
    """Forwards requests to the routable upstreams of ``pool``.

    Two counters say which way requests went, for tests and debugging (the compiled
    modules call methods directly: a spy on one sees nothing):

    - ``task_free``: requests ``begin`` sent upstream itself, from the parser's callback;
    - ``handed_on``: requests ``begin`` handed to a task: no idle connection to the
      upstream it picked, or a total timeout, or the attempt it sent failed (then counted
      in both). A request ``begin`` declined (a body, an upgrade) is in neither.
    """

    _loop: asyncio.AbstractEventLoop
    """The running loop (from ``start``)."""

    def __init__(
        self, pool: Pool, config: ProxyConfig, observers: Sequence[RequestObserver] = ()
    ) -> None:
        self.pool = pool
        self.config = config
        self.observers = tuple(observers)
        self._connector: Connector | None = None
        self._relays: set[Relay] = set()
        self._routed: dict[tuple[bytes, bytes], _Routed] = {}
        """Where recent (Host, target) pairs went (``_route``), for the route table
        ``_routed_for``: most traffic asks for the same few targets again and again."""
        self._routed_for: router.RouteTable | None = None
        self.task_free = 0
        self.handed_on = 0

    @property
    def connector(self) -> Connector:
        if self._connector is None:
            raise RuntimeError("Proxy.start() was not called")
        return self._connector

    async def start(self) -> None:
        """Open the upstream connection pool (idempotent)."""
        self._loop = asyncio.get_running_loop()
        if self._connector is None:
            self._connector = Connector(
                max_idle=self.config.upstream_keepalive,
                max_header_size=self.config.limits.max_header_size,
            )

    async def close(self) -> None:
        """Close the upstream connections (idempotent)."""
        connector, self._connector = self._connector, None
        if connector is not None:
            connector.close()

    def going_away(self) -> None:
        """Close every relayed WebSocket with 1001 (the gateway is shutting down)."""
        for relay in list(self._relays):
            relay.going_away()

    # -- the handler -------------------------------------------------------------------------

    def begin(self, request: IncomingRequest) -> bool:
        """Serve ``request`` without a task of its own if it can start at once; else False.

        The common request (no body, no upgrade, an upstream routable now and an idle
        keep-alive connection to it, no ``timeouts.total``) is sent from the parser's
        callback, and its answer written from the upstream's: no task, no future, no
        coroutine. Anything else, or anything unusual on the way (a failed attempt to retry,
        an answer still streaming), goes on in ``handle`` as the request's task, from where
        this left off. Errors the gateway answers itself (404, 400) are written here.
        """
        if request.body is not None or request.upgrade:
            return False
        ex = self._exchange_for(request)
        try:
            sp, target = self._prepare(request, ex)
        except GatewayError as exc:
            self._error_response(request, exc, ex)
            self._record(request, ex, self._loop.time())
            request.conn.finished(request)
            return True
        upstream = None if sp.routing.timeouts.total else sp.pick()
        conn = None
        if upstream is not None:
            connector = self._connector
            assert connector is not None
            conn = connector.idle(upstream.host, upstream.port)
        if conn is None:
            # The task connects (to the upstream picked: a pick is not undone) or waits.
            ex.upstream = upstream
            self.handed_on += 1
            request.conn.run(request, self.handle(request, ex))
            return True
        assert upstream is not None
        ex.upstream = upstream
        ex.conn = conn
        fast = _Fast(self, request, ex)
        sp.hold(upstream.id, fast)
        fast.held = upstream.id
        request.conn.exchange = fast
        self.task_free += 1
        head = self._request_head(request, ex, target, upstream)
        if request.content_length is not None:
            head.append(b"Content-Length: 0")
        head.append(http1.CRLF)
        conn.send(
            http1.CRLF.join(head),
            body=False,
            chunked=False,
            head_only=request.method == "HEAD",
            read_timeout=sp.routing.timeouts.read,
            waiter=fast,
        )
        return True

    def _exchange_for(self, request: IncomingRequest) -> _Exchange:
        candidate = request.request_id
        return _Exchange(
            headers.request_id(candidate.decode("latin-1") if candidate else None),
            self._loop.time(),
        )

    async def handle(
        self, request: IncomingRequest, ex: _Exchange | None = None, failed: _Failed | None = None
    ) -> None:
        """Answer ``request`` (run as its own task by its ``ClientConnection``).

        ``ex`` is given when ``begin`` started the request: it is routed (``ex.sp``), and
        ``ex.upstream`` is the upstream it picked, if any; with ``failed``, the attempt on it
        failed (retry, or answer the error).
        """
        if ex is None:
            ex = self._exchange_for(request)
        try:
            if ex.sp is None:
                sp, ex.target = self._prepare(request, ex)
                await self._attempts(request, ex, sp, None)
            else:
                await self._attempts(request, ex, ex.sp, failed)
        except GatewayError as exc:
            self._error_response(request, exc, ex)
        except asyncio.CancelledError:
            ex.status = ex.status or 499
            if request.conn.send_timed_out:
                ex.error = "client_too_slow"
            elif not ex.complete:
                ex.error = ex.error or "cancelled"
            raise
        finally:
            self._record(request, ex, self._loop.time())

    def _prepare(self, request: IncomingRequest, ex: _Exchange) -> tuple[ServicePool, bytes]:
        """Route ``request`` and check its limits: its service and the target sent upstream."""
        routes = self.pool.routes
        if routes is not self._routed_for:
            self._routed.clear()  # a new route table: what was worked out may differ
            self._routed_for = routes
        key = (request.host, request.target)
        routed = self._routed.get(key)
        if routed is None:
            routed = self._route(request, routes, ex)
            if len(request.target) <= ROUTED_TARGET_MAX:
                if len(self._routed) >= ROUTED_CACHED:
                    self._routed.clear()
                self._routed[key] = routed
        service, ex.path, ex.target = routed
        sp = self.pool.services.get(service)
        if sp is None:
            raise _no_route(request, ex.path)
        ex.service = service
        limit = sp.routing.limits.max_body_size
        length = request.content_length
        if limit and length is not None and length > limit:
            raise RequestTooLarge(
                f"request body of {length} bytes is over the limit of {limit}", limit=limit
            )
        body = request.body
        if body is not None:
            body.set_limit(limit)
            if isinstance(body.error, GatewayError):
                raise body.error  # a broken body is refused before any upstream sees it
        ex.sp = sp
        return sp, ex.target

    def _route(self, request: IncomingRequest, routes: router.RouteTable, ex: _Exchange) -> _Routed:
        """Where a request target on a Host goes: (service, normalised path, target sent
        upstream). Raises the 400 or 404 it gets instead (``ex.path`` is set for its record)."""
        target = request.target.decode("latin-1")
        path, query, plain = router.split_target(target)
        ex.path = path
        problem = None if plain else router.path_problem(target)
        if problem is not None:
            raise BadRequest(f"the request is refused: {problem}")
        route = router.resolve(routes, request.host.decode("latin-1"), path)
        if route is None:
            raise _no_route(request, path)
        forward = router.forward_path(route, path)
        if not plain:
            forward = router.quote_path(forward)
        wire = (f"{forward}?{query}" if query else forward).encode("latin-1")
        return route.service, path, wire

    async def _attempts(
        self, request: IncomingRequest, ex: _Exchange, sp: ServicePool, failed: _Failed | None
    ) -> None:
        """Lease an upstream and forward, retrying while ``_may_retry`` allows.

        ``ex.upstream``: the upstream ``begin`` picked; ``failed``: its attempt failed already.
        """
        tried: set[str] = set()
        lease = None
        picked = ex.upstream
        if failed is not None:
            assert picked is not None
            tried.add(picked.id)
        else:
            if picked is not None and picked in sp.snapshot.routable:
                # Still routable since ``begin`` picked it.
                lease = sp.lease_of(picked, asyncio.current_task())
            else:
                lease = sp.lease()
            if lease is None:
                if not await sp.wait_routable(sp.routing.queue_timeout):
                    raise sp.unavailable()
                lease = sp.lease()
                if lease is None:
                    raise sp.unavailable()
        websocket = bool(request.upgrade) and request.is_websocket
        while True:
            if failed is not None:
                if not self._may_retry(failed.kind, request, ex, sp, tried):
                    raise failed.error from None
                ex.retries += 1
                ex.retry_reasons += (failed.kind,)
                lease = sp.lease(frozenset(tried))
                if lease is None:
                    raise failed.error from None
                failed = None
            assert lease is not None
            tried.add(lease.upstream.id)
            ex.upstream = lease.upstream
            try:
                with lease:
                    if websocket:
                        return await self._websocket(request, ex, sp, lease, ex.target)
                    return await self._http(request, ex, sp, lease, ex.target, tried)
            except _Failed as exc:
                failed = exc

    def _may_retry(
        self,
        kind: str,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        tried: Collection[str],
    ) -> bool:
        retries = sp.routing.retries
        body = request.body
        if ex.retries >= retries.attempts or ex.response_started:
            return False
        if body is not None and (body.started or body.error is not None):
            return False
        if self._loop.time() - ex.started >= retries.timeout:
            return False
        replayable = request.method in IDEMPOTENT and body is None
        if kind == "disconnect" and not replayable:
            return False
        if kind == "status" and not (retries.on_status and replayable):
            return False
        if kind not in ("connect", "disconnect", "status"):
            return False
        return any(u.id not in tried for u in sp.snapshot.routable)

    def _failed(self, error: GatewayError, ex: _Exchange, sp: ServicePool) -> _Failed:
        """An attempt's failure, reported to passive detection unless the client caused it."""
        kind = error.kind
        if kind == "client" or isinstance(error, RequestTooLarge | RequestTimeout | BadRequest):
            return _Failed(error, "client")
        upstream = ex.upstream
        assert upstream is not None
        error.details.update(service=sp.routing.name, upstream=upstream.id)
        outcome = "connect_failure" if kind == "connect" else "5xx"
        self.pool.report(sp.routing.name, upstream.id, outcome)
        return _Failed(error, kind)

    # -- HTTP --------------------------------------------------------------------------------

    def _request_head(
        self, request: IncomingRequest, ex: _Exchange, target: bytes, upstream: Upstream
    ) -> list[bytes]:
        """The request line and header lines sent upstream (framing not included)."""
        plain = request.plain_lines
        if plain is not None and not (request.forwarded and self.config.trust_forwarded):
            lines = headers.plain_upstream_request(
                plain, host=request.host, peer=request.peer, request_id=ex.request_id
            )
        else:
            lines = headers.upstream_request(
                request.headers,
                host=request.host,
                peer=request.peer,
                request_id=ex.request_id,
                trust_forwarded=self.config.trust_forwarded,
                websocket=bool(request.upgrade) and request.is_websocket,
            )
        lines.insert(0, request.method.encode() + b" " + target + b" HTTP/1.1")
        if not request.host:
            lines.append(b"Host: " + upstream.address.encode())
        return lines

    async def _http(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        lease: Lease,
        target: bytes,
        tried: Collection[str],
    ) -> None:
        upstream = lease.upstream
        timeouts = sp.routing.timeouts
        connector = self.connector
        conn = connector.idle(upstream.host, upstream.port)
        if conn is None:
            try:
                conn = await connector.connect(upstream.host, upstream.port, timeouts.connect)
            except GatewayError as exc:
                raise self._failed(exc, ex, sp) from None
        try:
            if timeouts.total:
                async with asyncio.timeout(timeouts.total):
                    await self._exchange(request, ex, sp, conn, target, tried)
            else:
                await self._exchange(request, ex, sp, conn, target, tried)
        except TimeoutError:
            connector.discard(conn)
            if ex.response_started:
                ex.error = "upstream_timeout"
                request.conn.abort()
                return
            error = UpstreamTimeout("upstream did not answer in time", kind="timeout")
            raise self._failed(error, ex, sp) from None
        except BaseException:
            connector.discard(conn)
            raise

    async def _exchange(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        conn: UpstreamConnection,
        target: bytes,
        tried: Collection[str],
    ) -> None:
        upstream = ex.upstream
        assert upstream is not None
        body = request.body
        if body is not None and body.error is not None:
            error = body.error
            raise _Failed(error, "client") if isinstance(error, GatewayError) else error
        lines = self._request_head(request, ex, target, upstream)
        payload = b""
        if body is None:
            if request.content_length is not None:
                lines.append(b"Content-Length: 0")
        elif body.complete and not body.started and body.error is None:
            payload = body.take()  # whole already: framed by length, one write
            lines.append(b"Content-Length: %d" % len(payload))
        elif request.chunked:
            lines.append(b"Transfer-Encoding: chunked")
        else:
            lines.append(b"Content-Length: %d" % (request.content_length or 0))
        lines.append(http1.CRLF)
        streamed = body is not None and not payload
        head_future = conn.send(
            http1.CRLF.join(lines) + payload,
            body=streamed,
            chunked=request.chunked,
            head_only=request.method == "HEAD",
            read_timeout=sp.routing.timeouts.read,
        )
        if body is not None:
            ex.bytes_in = body.received
            if streamed:
                conn.body_producer = request.conn
                try:
                    body.attach(conn)
                except GatewayError as exc:
                    raise self._failed(exc, ex, sp) from None
        assert head_future is not None
        try:
            head = await head_future
        except GatewayError as exc:
            if body is not None:
                body.detach()
            raise self._failed(exc, ex, sp) from None
        ex.ttfb = self._loop.time() - ex.started
        failed = self._answered(request, ex, sp, conn, head, tried)
        if failed is not None:
            raise failed
        await self._respond(request, ex, sp, conn, head)

    def _answered(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        conn: UpstreamConnection,
        head: ResponseHead,
        tried: Collection[str],
    ) -> _Failed | None:
        """The answer's head arrived (``ex.ttfb`` is set): passive detection, and the failure
        if it is retried."""
        upstream = ex.upstream
        assert upstream is not None
        status = head.status
        if status >= 500:
            self.pool.report(sp.routing.name, upstream.id, "5xx")
            if status in RETRY_STATUSES and self._may_retry("status", request, ex, sp, tried):
                self.connector.discard(conn)
                error = UpstreamError(
                    f"upstream answered {status}", service=sp.routing.name, upstream=upstream.id
                )
                return _Failed(error, "status")
        return None

    async def _respond(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        conn: UpstreamConnection,
        head: ResponseHead,
    ) -> None:
        """Send the upstream's answer to the client as it arrives."""
        chunked, data = self._client_head(request, ex, conn, head)
        sink = ResponseStream(request.conn, chunked)
        try:
            done = conn.stream_to(sink, data)
            if done is not None:
                await done
        except GatewayError as exc:
            self._broke_off(request, ex, sp, conn, sink, exc)
            return
        self._delivered(request, ex, sp, conn, sink.bytes_out)

    def _client_head(
        self, request: IncomingRequest, ex: _Exchange, conn: UpstreamConnection, head: ResponseHead
    ) -> tuple[bool, bytes]:
        """The head of the answer as the client gets it, and whether its body is chunked."""
        client = request.conn
        body = request.body
        status = head.status
        keep_alive = request.keep_alive and not client.closing
        if body is not None and not body.complete:
            keep_alive = False  # the rest of the body would have to be read first
        ex.status = status
        ex.response_started = True
        client.producer = conn
        hop = head.hop
        length = head.content_length
        if (
            keep_alive
            and length is not None
            and status != 204
            and request.version == "1.1"
            and not (hop and headers.names_fields(hop))
        ):
            # Most answers: what the steps below make of them, in one step.
            fields = head.fields
            return False, b"".join(
                [
                    http1.STATUS_LINE_START[status],
                    head.phrase,
                    b"\r\n",
                    fields,
                    b"\r\n" if fields else b"",
                    b"X-Request-Id: ",
                    ex.request_id.encode(),
                    b"\r\nContent-Length: ",
                    str(length).encode(),
                    b"\r\n\r\n",
                ]
            )
        chunked = False
        lines = headers.client_response(head.fields, head.hop, ex.request_id)
        if head.content_length is not None and status != 204:
            # Also on a HEAD or 304 answer: the size of the body that is not sent.
            lines.append(b"Content-Length: %d" % head.content_length)
        elif request.method == "HEAD" or status in NO_BODY_STATUSES:
            pass  # no body follows
        elif request.version == "1.1":
            chunked = True
            lines.append(b"Transfer-Encoding: chunked")
        else:
            keep_alive = False  # framed by the close, as the upstream did
        if not keep_alive:
            lines.append(b"Connection: close")
        elif request.version == "1.0":
            lines.append(b"Connection: keep-alive")
        request.keep_alive = keep_alive
        return chunked, http1.response_head(status, head.phrase, lines)

    def _broke_off(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        conn: UpstreamConnection,
        sink: ResponseStream,
        exc: GatewayError,
    ) -> None:
        """The answer's body broke off: cut the client off without its end, so it must never
        look complete."""
        ex.bytes_out = sink.bytes_out
        ex.error = exc.code
        request.conn.abort()
        self.connector.discard(conn)
        if exc.kind != "client":
            self.pool.report(sp.routing.name, ex.upstream.id if ex.upstream else "", "5xx")

    def _delivered(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        conn: UpstreamConnection,
        bytes_out: int,
    ) -> None:
        """The answer went to the client whole: the upstream connection is free again."""
        ex.bytes_out = bytes_out
        body = request.body
        if body is not None:
            ex.bytes_in = body.received
        ex.complete = True
        if ex.status < 500 and ex.upstream is not None:
            self.pool.succeeded(sp, ex.upstream.id)
        connector = self._connector
        assert connector is not None
        connector.release(conn)

    # -- WebSocket ---------------------------------------------------------------------------

    async def _websocket(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        lease: Lease,
        target: bytes,
    ) -> None:
        upstream = lease.upstream
        timeouts = sp.routing.timeouts
        connector = self.connector
        try:
            conn = await connector.acquire(upstream.host, upstream.port, timeouts.connect)
        except GatewayError as exc:
            raise self._failed(exc, ex, sp) from None
        try:
            lines = self._request_head(request, ex, target, upstream)
            lines.append(http1.CRLF)
            future = conn.send(
                http1.CRLF.join(lines),
                body=False,
                chunked=False,
                head_only=False,
                read_timeout=timeouts.connect + timeouts.read,
            )
            assert future is not None
            try:
                head = await future
            except GatewayError as exc:
                raise self._failed(exc, ex, sp) from None
            if head.status != 101:
                outcome = "5xx" if head.status >= 500 else "ok"
                self.pool.report(sp.routing.name, upstream.id, outcome)
                error = UpstreamProtocolError(
                    f"upstream refused the WebSocket upgrade with status {head.status}",
                    service=sp.routing.name,
                    upstream=upstream.id,
                    upstream_status=head.status,
                )
                raise _Failed(error, "protocol")
            self.pool.report(sp.routing.name, upstream.id, "ok")
            await self._relay(request, ex, lease, conn, head)
        finally:
            if conn.transport is not None and conn.tunnel is None:
                connector.discard(conn)

    async def _relay(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        lease: Lease,
        conn: UpstreamConnection,
        head: ResponseHead,
    ) -> None:
        client = request.conn
        lines = headers.client_response(head.fields, head.hop, ex.request_id, upgrade=True)
        ex.status = 101
        ex.response_started = True
        client.write(http1.response_head(101, head.phrase, lines))
        relay = Relay(client, conn)
        client.producer = conn
        conn.body_producer = client
        client.tunnel = relay.from_client
        client.on_lost = relay.client_lost
        conn.tunnel = relay.from_upstream
        conn.on_lost = relay.upstream_lost
        if client.transport is None:
            relay.client_lost()
        if conn.transport is None:
            relay.upstream_lost()
        if conn.tunnel_data:
            relay.from_upstream(conn.tunnel_data)
        early = client.take_tunnel_data()
        if early:
            relay.from_client(early)
        conn.resume_reading()
        client.start_tunnel()
        self._relays.add(relay)
        # A drain timeout (or a shutdown) closes with 1001 instead of cancelling.
        lease.on_abort = relay.going_away
        try:
            await relay.done
        finally:
            self._relays.discard(relay)
            ex.bytes_in, ex.bytes_out = relay.bytes_in, relay.bytes_out
            ex.complete = relay.closed_cleanly
            if client.send_timed_out:
                ex.error = "client_too_slow"
            if not relay.done.done():
                client.abort()
                conn.abort()

    # -- answers and records -----------------------------------------------------------------

    def _error_response(self, request: IncomingRequest, exc: GatewayError, ex: _Exchange) -> None:
        ex.status = exc.status
        ex.error = exc.code
        body = request.body
        close = (
            not request.keep_alive
            or request.conn.closing
            or (body is not None and not body.complete)
            or isinstance(exc, RequestTimeout | BadRequest)
        )
        if close:
            request.keep_alive = False
        request.conn.write(gateway_error_response(exc, ex.request_id, close))

    def _record(self, request: IncomingRequest, ex: _Exchange, now: float) -> None:
        if not self.observers:
            return
        upstream = ex.upstream
        # Positional, in the order of RequestRecord's fields: fourteen keywords cost more than
        # the metrics of the request do.
        record = RequestRecord(
            ex.request_id,
            ex.service,
            upstream.revision if upstream is not None else None,
            upstream.id if upstream is not None else None,
            request.method,
            ex.path,
            ex.status,
            now - ex.started,
            ex.ttfb,
            ex.bytes_in,
            ex.bytes_out,
            ex.retries,
            ex.retry_reasons,
            ex.error,
        )
        for observer in self.observers:
            try:
                observer.on_request(record)
            except Exception:
                log.exception("request observer %r failed", observer)
