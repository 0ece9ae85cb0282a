"""The request handler of the data plane: route, lease, forward and stream both ways.

One request:  route (404)  ->  lease a routable upstream (wait up to ``queue_timeout``, else
503)  ->  an upstream connection (``connector``)  ->  the request head with rewritten headers,
the body spliced from the client as it arrives  ->  the answer's head  ->  its body spliced
back to the client  ->  one ``RequestRecord`` to each observer. A WebSocket upgrade that the
upstream accepts turns both connections into a relay (``websocket``), holding its lease
while open.

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
from dataclasses import dataclass

from . import headers, http1, router
from .config import ProxyConfig
from .connector import Connector, ResponseHead, UpstreamConnection
from .downstream import (
    IncomingRequest,
    ResponseStream,
    gateway_error_response,
)
from .errors import (
    BadRequest,
    GatewayError,
    NoRoute,
    RequestTimeout,
    RequestTooLarge,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from .events import RequestObserver, RequestRecord
from .pool import Lease, Pool, ServicePool
from .upstream import Upstream
from .websocket import Relay

log = logging.getLogger(__name__)

IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
RETRY_STATUSES = frozenset({502, 503, 504})
NO_BODY_STATUSES = frozenset({204, 304})


@dataclass(slots=True)
class _Exchange:
    """What one request has done so far, across its attempts."""

    request_id: str
    started: float
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


class _Failed(Exception):
    """An attempt failed before the client got anything; ``kind`` says if a retry may help."""

    def __init__(self, error: GatewayError, kind: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind


class Proxy:
    """Forwards requests to the routable upstreams of ``pool``."""

    def __init__(
        self, pool: Pool, config: ProxyConfig, observers: Sequence[RequestObserver] = ()
    ) -> None:
        self.pool = pool
        self.config = config
        self.observers = tuple(observers)
        self._connector: Connector | None = None
        self._relays: set[Relay] = set()

    @property
    def connector(self) -> Connector:
        if self._connector is None:
            raise RuntimeError("Proxy.start() was not called")
        return self._connector

    async def start(self) -> None:
        """Open the upstream connection pool (idempotent)."""
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

    async def handle(self, request: IncomingRequest) -> None:
        """Answer ``request`` (run as its own task by its ``ClientConnection``)."""
        loop = self.pool.loop
        candidate = request.request_id
        ex = _Exchange(
            headers.request_id(candidate.decode("latin-1") if candidate else None), loop.time()
        )
        try:
            await self._route(request, ex)
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
            self._record(request, ex, loop.time())

    async def _route(self, request: IncomingRequest, ex: _Exchange) -> None:
        target = request.target.decode("latin-1")
        path, query, plain = router.split_target(target)
        ex.path = path
        problem = None if plain else router.path_problem(target)
        if problem is not None:
            raise BadRequest(f"the request is refused: {problem}")
        host = request.host.decode("latin-1")
        route = router.resolve(self.pool.routes, host, path)
        sp = self.pool.services.get(route.service) if route is not None else None
        if route is None or sp is None:
            raise NoRoute(f"no route for host {host!r} and path {path!r}", host=host, path=path)
        ex.service = route.service
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
        forward = router.forward_path(route, path)
        if not plain:
            forward = router.quote_path(forward)
        wire_target = (f"{forward}?{query}" if query else forward).encode("latin-1")

        lease = sp.lease()
        if lease is None:
            if not await sp.wait_routable(sp.routing.queue_timeout):
                raise sp.unavailable()
            lease = sp.lease()
            if lease is None:
                raise sp.unavailable()
        websocket = bool(request.upgrade) and request.is_websocket
        tried: set[str] = set()
        while True:
            tried.add(lease.upstream.id)
            ex.upstream = lease.upstream
            try:
                with lease:
                    if websocket:
                        return await self._websocket(request, ex, sp, lease, wire_target)
                    return await self._http(request, ex, sp, lease, wire_target, tried)
            except _Failed as failed:
                if not self._may_retry(failed.kind, request, ex, sp, tried):
                    raise failed.error from None
                ex.retries += 1
                ex.retry_reasons += (failed.kind,)
                next_lease = sp.lease(frozenset(tried))
                if next_lease is None:
                    raise failed.error from None
                lease = next_lease

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
        if self.pool.loop.time() - ex.started >= retries.timeout:
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
        try:
            head = await head_future
        except GatewayError as exc:
            if body is not None:
                body.detach()
            raise self._failed(exc, ex, sp) from None
        status = head.status
        ex.ttfb = self.pool.loop.time() - ex.started
        if status >= 500:
            self.pool.report(sp.routing.name, upstream.id, "5xx")
        if status in RETRY_STATUSES and self._may_retry("status", request, ex, sp, tried):
            self.connector.discard(conn)
            error = UpstreamError(
                f"upstream answered {status}", service=sp.routing.name, upstream=upstream.id
            )
            raise _Failed(error, "status")
        await self._respond(request, ex, sp, conn, head)

    async def _respond(
        self,
        request: IncomingRequest,
        ex: _Exchange,
        sp: ServicePool,
        conn: UpstreamConnection,
        head: ResponseHead,
    ) -> None:
        """Send the upstream's answer to the client as it arrives."""
        client = request.conn
        body = request.body
        status = head.status
        keep_alive = request.keep_alive and not client.closing
        if body is not None and not body.complete:
            keep_alive = False  # the rest of the body would have to be read first
        chunked = False
        fields = headers.client_response(head.headers, head.hop, ex.request_id)
        if head.content_length is not None and status != 204:
            # Also on a HEAD or 304 answer: the size of the body that is not sent.
            fields.append((b"Content-Length", b"%d" % head.content_length))
        elif request.method == "HEAD" or status in NO_BODY_STATUSES:
            pass  # no body follows
        elif request.version == "1.1":
            chunked = True
            fields.append((b"Transfer-Encoding", b"chunked"))
        else:
            keep_alive = False  # framed by the close, as the upstream did
        if not keep_alive:
            fields.append((b"Connection", b"close"))
        elif request.version == "1.0":
            fields.append((b"Connection", b"keep-alive"))
        request.keep_alive = keep_alive
        ex.status = status
        ex.response_started = True
        sink = ResponseStream(client, chunked)
        client.producer = conn
        try:
            done = conn.stream_to(sink, http1.response_head(status, head.phrase, fields))
            if done is not None:
                await done
        except GatewayError as exc:
            # Cut the client off without the end of the body: it must never look complete.
            ex.bytes_out = sink.bytes_out
            ex.error = exc.code
            client.abort()
            self.connector.discard(conn)
            if exc.kind != "client":
                self.pool.report(sp.routing.name, ex.upstream.id if ex.upstream else "", "5xx")
            return
        ex.bytes_out = sink.bytes_out
        if body is not None:
            ex.bytes_in = body.received
        ex.complete = True
        if status < 500 and ex.upstream is not None:
            self.pool.report(sp.routing.name, ex.upstream.id, "ok")
        self.connector.release(conn)

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
        fields = headers.client_response(head.headers, head.hop, ex.request_id, upgrade=True)
        ex.status = 101
        ex.response_started = True
        client.write(http1.response_head(101, head.phrase, fields))
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
        record = RequestRecord(
            request_id=ex.request_id,
            service=ex.service,
            revision=upstream.revision if upstream is not None else None,
            upstream_id=upstream.id if upstream is not None else None,
            method=request.method,
            path=ex.path,
            status=ex.status,
            duration=now - ex.started,
            ttfb=ex.ttfb,
            bytes_in=ex.bytes_in,
            bytes_out=ex.bytes_out,
            retries=ex.retries,
            retry_reasons=ex.retry_reasons,
            error=ex.error,
        )
        for observer in self.observers:
            try:
                observer.on_request(record)
            except Exception:
                log.exception("request observer %r failed", observer)
