"""The request handler of the data plane: route, lease, forward and stream both ways.

One request:  route (404)  ->  lease a routable upstream (wait up to ``queue_timeout``, else
503)  ->  forward with rewritten headers (``headers``), the body streamed from the client as
it arrives  ->  response headers  ->  body streamed back chunk by chunk (SSE flushes per
event)  ->  one ``RequestRecord`` to each observer. A WebSocket upgrade is relayed instead
(``websocket``), holding its lease while open.

Retries go to a different routable upstream, within ``retries.attempts`` and
``retries.timeout``, and only while nothing is lost by them: no response byte sent to the
client and no request body byte taken from it. A connect failure is always retried; a
connection the upstream closed or reset before answering only for an idempotent request
without a body (a stale keep-alive connection); with ``retries.on_status`` a 502, 503 or 504
answer to such a request too.

Invariants:
- every lease is released, on every path, cancellation included;
- every error the gateway makes itself is JSON ``{"error", "message", "request_id", ...}``
  and carries X-Request-Id; library exceptions become ``GatewayError``s in ``_translate``;
- a response whose upstream body breaks off is aborted (the connection dropped without the
  last chunk), never completed short;
- cancellation (the client went away) is never swallowed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from . import headers, router
from .config import ProxyConfig
from .errors import (
    GatewayError,
    NoRoutableUpstream,
    NoRoute,
    RequestTooLarge,
    UpstreamConnectError,
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
UPSTREAM_KEEPALIVE_TIMEOUT = 30.0
"""Idle keep-alive connections to upstreams are closed after this long."""
WS_CLOSE_TIMEOUT = 10.0
"""How long a WebSocket close handshake with an upstream may take."""
_CHUNK = 64 * 1024


@dataclass(slots=True)
class _Exchange:
    """What one request has done so far, across its attempts."""

    request_id: str
    started: float
    service: str = ""
    upstream: Upstream | None = None
    status: int = 0
    ttfb: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    retries: int = 0
    retry_reasons: list[str] = field(default_factory=list)
    error: str | None = None
    body_started: bool = False
    """The request body was touched: an attempt can no longer be replayed."""
    response_started: bool = False
    """Response headers went to the client: no other answer is possible."""
    too_large: bool = False
    complete: bool = False
    """The answer was delivered in full (a cancellation after that is no error)."""


class _Failed(Exception):
    """An attempt failed before the client got anything; ``kind`` says if a retry may help."""

    def __init__(self, error: GatewayError, kind: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind


def _translate(exc: BaseException) -> tuple[GatewayError, str]:
    """An aiohttp or OS error of an upstream exchange -> (GatewayError, kind of failure).

    kind: ``connect`` (nothing reached the upstream), ``disconnect`` (closed or reset before
    an answer), ``timeout``, ``protocol`` (not HTTP) or ``other``.
    """
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(f"cannot connect to upstream: {exc.os_error}"), "connect"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamTimeout("timed out connecting to upstream"), "connect"
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout("upstream did not answer in time"), "timeout"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamConnectError("upstream closed the connection before answering"), (
            "disconnect"
        )
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamProtocolError(f"upstream sent an invalid response: {exc.message}"), (
            "protocol"
        )
    if isinstance(exc, aiohttp.ClientPayloadError):
        return UpstreamProtocolError(f"upstream response body broke off: {exc}"), "protocol"
    if isinstance(exc, aiohttp.ClientConnectionError | OSError):
        return UpstreamConnectError(f"connection to upstream failed: {exc}"), "disconnect"
    return UpstreamError(f"forwarding failed: {exc!r}"), "other"


def _subprotocols(request: web.Request) -> list[str]:
    offered = ",".join(request.headers.getall("Sec-WebSocket-Protocol", ()))
    return [p.strip() for p in offered.split(",") if p.strip()]


def _is_websocket(request: web.Request) -> bool:
    """A valid WebSocket upgrade; an invalid one is forwarded as a plain request."""
    return (
        request.method == "GET"
        and request.headers.get("Upgrade", "").lower() == "websocket"
        and web.WebSocketResponse(protocols=_subprotocols(request)).can_prepare(request).ok
    )


class Proxy:
    """Forwards requests to the routable upstreams of ``pool`` over one client session."""

    def __init__(
        self, pool: Pool, config: ProxyConfig, observers: Sequence[RequestObserver] = ()
    ) -> None:
        self.pool = pool
        self.config = config
        self.observers = tuple(observers)
        self._session: aiohttp.ClientSession | None = None
        self._relays: set[Relay] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Proxy.start() was not called")
        return self._session

    async def start(self) -> None:
        """Open the shared upstream session (idempotent)."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            keepalive_timeout=UPSTREAM_KEEPALIVE_TIMEOUT,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
            max_line_size=self.config.limits.max_header_size,
            max_field_size=self.config.limits.max_header_size,
        )

    async def close(self) -> None:
        """Close the upstream session and its connections (idempotent)."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def going_away(self) -> None:
        """Close every relayed WebSocket with 1001 (the gateway is shutting down)."""
        for relay in list(self._relays):
            relay.going_away()

    # -- the handler -------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        ex = _Exchange(headers.request_id(request.headers.get("X-Request-Id")), loop.time())
        path = router.normalize_path(request.path)
        try:
            return await self._route(request, ex, path)
        except GatewayError as exc:
            return self._error_response(exc, ex)
        except asyncio.CancelledError:
            ex.status = ex.status or 499
            if not ex.complete:
                ex.error = ex.error or "cancelled"
            raise
        finally:
            self._record(request, ex, path, loop.time())

    async def _route(self, request: web.Request, ex: _Exchange, path: str) -> web.StreamResponse:
        host = request.headers.get("Host", "")
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
        target = URL.build(path=router.forward_path(route, path)).raw_path
        query = request.rel_url.raw_query_string
        websocket = _is_websocket(request)

        lease = sp.lease()
        if lease is None:
            if not await sp.wait_routable(sp.routing.queue_timeout):
                raise sp.unavailable()
            lease = sp.lease()
            if lease is None:
                raise sp.unavailable()
        tried: set[str] = set()
        while True:
            tried.add(lease.upstream.id)
            ex.upstream = lease.upstream
            try:
                with lease:
                    if websocket:
                        return await self._websocket(request, ex, sp, lease, target, query)
                    return await self._http(request, ex, sp, lease, target, query, tried)
            except _Failed as failed:
                if not self._may_retry(failed.kind, request, ex, sp, tried):
                    raise failed.error from None
                ex.retries += 1
                ex.retry_reasons.append(failed.kind)
                next_lease = sp.lease(frozenset(tried))
                if next_lease is None:
                    raise failed.error from None
                lease = next_lease

    def _may_retry(
        self,
        kind: str,
        request: web.Request,
        ex: _Exchange,
        sp: ServicePool,
        tried: Collection[str],
    ) -> bool:
        retries = sp.routing.retries
        if ex.retries >= retries.attempts or ex.body_started or ex.response_started:
            return False
        if asyncio.get_running_loop().time() - ex.started >= retries.timeout:
            return False
        replayable = request.method in IDEMPOTENT and not request.body_exists
        if kind == "disconnect" and not replayable:
            return False
        if kind == "status" and not (retries.on_status and replayable):
            return False
        if kind not in ("connect", "disconnect", "status"):
            return False
        return any(u.id not in tried for u in sp.snapshot.routable)

    def _failed(
        self, exc: BaseException, ex: _Exchange, sp: ServicePool, upstream: Upstream
    ) -> _Failed:
        """Translate an attempt's failure and report it to passive detection."""
        if ex.too_large:
            limit = sp.routing.limits.max_body_size
            error: GatewayError = RequestTooLarge(
                f"request body is over the limit of {limit} bytes", limit=limit
            )
            return _Failed(error, "other")
        error, kind = _translate(exc)
        error.details.update(service=sp.routing.name, upstream=upstream.id)
        outcome = "connect_failure" if kind == "connect" else "5xx"
        self.pool.report(sp.routing.name, upstream.id, outcome)
        return _Failed(error, kind)

    def _url(self, upstream: Upstream, path: str, query: str) -> URL:
        return URL.build(
            scheme="http",
            host=upstream.host,
            port=upstream.port,
            path=path,
            query_string=query,
            encoded=True,
        )

    def _upstream_headers(
        self, request: web.Request, ex: _Exchange, websocket: bool = False
    ) -> CIMultiDict[str]:
        return headers.upstream_request(
            request.headers,
            peer=request.remote,
            scheme=request.scheme,
            request_id=ex.request_id,
            trust_forwarded=self.config.trust_forwarded,
            websocket=websocket,
        )

    # -- HTTP --------------------------------------------------------------------------------

    async def _body(self, request: web.Request, ex: _Exchange, limit: int) -> AsyncIterator[bytes]:
        ex.body_started = True
        async for chunk in request.content.iter_chunked(_CHUNK):
            ex.bytes_in += len(chunk)
            if limit and ex.bytes_in > limit:
                ex.too_large = True
                raise RequestTooLarge(f"request body is over the limit of {limit} bytes")
            yield chunk

    async def _http(
        self,
        request: web.Request,
        ex: _Exchange,
        sp: ServicePool,
        lease: Lease,
        path: str,
        query: str,
        tried: Collection[str],
    ) -> web.StreamResponse:
        upstream = lease.upstream
        timeouts = sp.routing.timeouts
        body = (
            self._body(request, ex, sp.routing.limits.max_body_size)
            if request.body_exists
            else None
        )
        try:
            upstream_response = await self.session.request(
                request.method,
                self._url(upstream, path, query),
                headers=self._upstream_headers(request, ex),
                data=body,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=timeouts.total or None,
                    connect=timeouts.connect or None,
                    sock_connect=timeouts.connect or None,
                    sock_read=timeouts.read or None,
                ),
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise self._failed(exc, ex, sp, upstream) from exc

        try:
            status = upstream_response.status
            ex.ttfb = asyncio.get_running_loop().time() - ex.started
            self.pool.report(sp.routing.name, upstream.id, "5xx" if status >= 500 else "ok")
            if status in RETRY_STATUSES and self._may_retry("status", request, ex, sp, tried):
                error = UpstreamError(
                    f"upstream answered {status}", service=sp.routing.name, upstream=upstream.id
                )
                raise _Failed(error, "status")
            return await self._stream(request, ex, upstream_response)
        finally:
            upstream_response.close()

    async def _stream(
        self, request: web.Request, ex: _Exchange, upstream_response: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Send the upstream's answer to the client as it arrives."""
        response = web.StreamResponse(
            status=upstream_response.status,
            reason=upstream_response.reason,
            headers=headers.client_response(upstream_response.headers, ex.request_id),
        )
        ex.status = upstream_response.status
        ex.response_started = True
        reader = upstream_response.content
        try:
            await response.prepare(request)
            while True:
                try:
                    chunk = await reader.readany()
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    # Cut the client off without the last chunk: a short body must never
                    # look complete. ``force_close`` makes aiohttp's own write_eof fail
                    # quietly instead of writing the terminating chunk.
                    ex.error = "request_too_large" if ex.too_large else _translate(exc)[0].code
                    request.protocol.force_close()
                    return response
                if not chunk:
                    break
                ex.bytes_out += len(chunk)
                await response.write(chunk)
            await response.write_eof()
            ex.complete = True
        except ConnectionError:
            ex.error = "client_disconnected"
        return response

    # -- WebSocket ---------------------------------------------------------------------------

    async def _websocket(
        self,
        request: web.Request,
        ex: _Exchange,
        sp: ServicePool,
        lease: Lease,
        path: str,
        query: str,
    ) -> web.StreamResponse:
        upstream = lease.upstream
        timeouts = sp.routing.timeouts
        protocols = _subprotocols(request)
        try:
            async with asyncio.timeout((timeouts.connect + timeouts.read) or None):
                upstream_ws = await self.session.ws_connect(
                    self._url(upstream, path, query),
                    headers=self._upstream_headers(request, ex, websocket=True),
                    protocols=protocols,
                    autoping=False,
                    autoclose=False,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT),
                )
        except aiohttp.WSServerHandshakeError as exc:
            self.pool.report(sp.routing.name, upstream.id, "5xx" if exc.status >= 500 else "ok")
            error = UpstreamProtocolError(
                f"upstream refused the WebSocket upgrade with status {exc.status}",
                service=sp.routing.name,
                upstream=upstream.id,
                upstream_status=exc.status,
            )
            raise _Failed(error, "protocol") from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise self._failed(exc, ex, sp, upstream) from exc

        try:
            self.pool.report(sp.routing.name, upstream.id, "ok")
            client_ws = web.WebSocketResponse(
                protocols=(upstream_ws.protocol,) if upstream_ws.protocol else (),
                autoping=False,
                autoclose=False,
                timeout=WS_CLOSE_TIMEOUT,
            )
            client_ws.headers["X-Request-Id"] = ex.request_id
            ex.response_started = True
            ex.status = 101
            await client_ws.prepare(request)
            relay = Relay(client_ws, upstream_ws)
            self._relays.add(relay)
            # A drain timeout (or a shutdown) closes with 1001 instead of cancelling.
            lease.abort = relay.going_away
            try:
                await relay.run()
            finally:
                self._relays.discard(relay)
                ex.bytes_in, ex.bytes_out = relay.bytes_in, relay.bytes_out
                ex.complete = relay.closed
            return client_ws
        finally:
            if not upstream_ws.closed:
                await upstream_ws.close(code=aiohttp.WSCloseCode.GOING_AWAY)

    # -- answers and records -----------------------------------------------------------------

    def _error_response(self, exc: GatewayError, ex: _Exchange) -> web.Response:
        ex.status = exc.status
        ex.error = exc.code
        body = {**exc.details, "error": exc.code, "message": exc.message}
        body["request_id"] = ex.request_id
        extra = {"X-Request-Id": ex.request_id}
        if isinstance(exc, NoRoutableUpstream):
            extra["Retry-After"] = str(exc.retry_after)
        return web.json_response(body, status=exc.status, headers=extra)

    def _record(self, request: web.Request, ex: _Exchange, path: str, now: float) -> None:
        if not self.observers:
            return
        upstream = ex.upstream
        record = RequestRecord(
            request_id=ex.request_id,
            service=ex.service,
            revision=upstream.revision if upstream is not None else None,
            upstream_id=upstream.id if upstream is not None else None,
            method=request.method,
            path=path,
            status=ex.status,
            duration=now - ex.started,
            ttfb=ex.ttfb,
            bytes_in=ex.bytes_in,
            bytes_out=ex.bytes_out,
            retries=ex.retries,
            retry_reasons=tuple(ex.retry_reasons),
            error=ex.error,
        )
        for observer in self.observers:
            try:
                observer.on_request(record)
            except Exception:
                log.exception("request observer %r failed", observer)
