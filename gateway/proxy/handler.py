"""The request handler of the data plane: route, lease, forward and stream both ways.

One request:  route (404)  ->  lease a routable upstream (held up to ``queue_timeout``, else
503)  ->  an upstream connection (``connector``)  ->  the request head with rewritten headers,
the body spliced from the client as it arrives  ->  the answer's head  ->  its body spliced
back to the client  ->  one ``RequestRecord`` to each observer. A WebSocket upgrade that the
upstream accepts turns both connections into a relay (``websocket``), holding its lease
while open. Each request has one owner, its ``Exchange``, on either way through.

Two ways through, with the same outcomes. ``begin`` takes the common request (no body, no
upgrade, an idle keep-alive connection to the upstream it picks) from the parser's callback
and answers it from the upstream connection's (``Exchange.start``): no task, no future, no
coroutine, which cost a request more than its routing and its headers together. Everything
else, and whatever goes unusually on that way (a failed attempt, to retry or answer), is
``handle``, run as the request's task. Retries follow ``retry``.

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
import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ProxyConfig, StickyConfig
from ..errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    NoRoute,
    OwnAnswer,
    RequestTooLarge,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from ..observability.span_buffer import SpanBuffer
from ..pool import balancer, router
from ..pool.events import RequestObserver
from ..pool.models import model_entry
from ..pool.pool import Pool
from ..pool.service_pool import Lease, ServicePool
from ..pool.snapshot import Split
from ..wire import grpc
from ..wire.upstream_tls import UpstreamTls, alpn_of, tls_of
from . import guard, messages, openai, preview, sticky
from .answers import CHALLENGE_PREFIX, challenge_answer, https_redirect
from .codec import Downstream
from .connector import Connector, ResponseHead, UpstreamConnection
from .exchange import Exchange, Forwarding
from .request import IncomingRequest
from .retry import Failed
from .routing import Routes, Unroutable, no_route, route
from .websocket import Relay

if TYPE_CHECKING:
    from .h2_upstream import H2Connector


class Proxy:
    """Forwards requests to the routable upstreams of ``pool``.

    Two counters say which way requests went, for tests and debugging (the compiled modules
    call methods directly: a spy on one sees nothing); a request ``begin`` declined (a body,
    an upgrade) is in neither:

    - ``task_free``: requests ``begin`` sent upstream itself, from the parser's callback;
    - ``handed_on``: requests handed to a task after all: no idle connection to the upstream
      picked, or a total timeout, or the attempt sent failed (then counted in both).
    """

    def __init__(
        self,
        pool: Pool,
        config: ProxyConfig,
        observers: Sequence[RequestObserver] = (),
        spans: SpanBuffer | None = None,
    ) -> None:
        self.pool = pool
        self.config = config
        self.forwarding = Forwarding(pool, config, observers, self.hand_on, spans)
        """What its exchanges share (``Exchange.proxy``)."""
        self.task_free = 0
        self.handed_on = 0
        self._relays: set[Relay] = set()
        self._routes = Routes()
        models = config.models
        self.model_prefix: str | None = None if models is None else models.path_prefix
        """``models.path_prefix``: requests under it are routed by model; None: off."""
        self.model_read = 0 if models is None else models.max_body_read
        self._h2_connector: H2Connector | None = None
        """The HTTP/2 upstream connections, made on a service's first HTTP/2 request."""
        managed = config.tls.managed_dir
        self.challenges: Path | None = Path(managed).parent / "challenges" if managed else None
        """Where the ACME client puts its HTTP-01 answers (``answers``); None without ACME."""
        self.https_port = 443
        """Where ``https_redirect`` sends clients: the first HTTPS listener's port once one
        is bound (``TrafficServer``), else 443 (TLS ended in front of the gateway)."""

    async def start(self) -> None:
        """Open the upstream connection pool (idempotent)."""
        forwarding = self.forwarding
        if not forwarding.opened:
            connector = Connector(
                max_idle=self.config.upstream_keepalive,
                max_header_size=self.config.limits.max_header_size,
            )
            forwarding.open(asyncio.get_running_loop(), connector)

    async def close(self) -> None:
        """Close the upstream connections (idempotent)."""
        connector = self.forwarding.close()
        if connector is not None:
            connector.close()
        h2_connector, self._h2_connector = self._h2_connector, None
        if h2_connector is not None:
            h2_connector.close()

    @property
    def connector(self) -> Connector:
        """The upstream connections (once ``start``ed)."""
        return self.forwarding.connector

    def going_away(self) -> None:
        """Close every relayed WebSocket with 1001 (the gateway is shutting down)."""
        for relay in list(self._relays):
            relay.going_away()

    # -- the handler -------------------------------------------------------------------------

    def begin(self, client: Downstream, request: IncomingRequest) -> bool:
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
        forwarding = self.forwarding
        ex = Exchange(forwarding, client, request)
        try:
            sp = self._prepare(ex)
        except GatewayError as exc:
            ex.error_response(exc)
            now = forwarding.loop.time()
            ex.record(now)
            client.finished(request, now)
            return True
        total = sp.total_timeout
        upstream = ex.upstream  # a preview route's, picked already
        if upstream is None and not total:
            upstream = sp.pick(key=ex.affinity)
        conn = None
        if upstream is not None and not total:
            if sp.upstream_tls is None:
                conn = forwarding.connector.idle(upstream.address)
            else:
                tls = upstream_tls(sp)
                assert tls is not None
                conn = forwarding.connector.idle(tls.key(upstream.address))
        if conn is None:
            # The task connects (to the upstream picked: a pick is not undone) or waits.
            ex.upstream = upstream
            self.hand_on(ex, None)
            return True
        assert upstream is not None
        self.task_free += 1
        ex.start(sp, upstream, conn)
        return True

    def hand_on(self, exchange: Exchange, failed: Failed | None) -> None:
        """Go on with ``exchange`` as its request's task (after ``failed``, if given)."""
        self.handed_on += 1
        client, request = exchange.client, exchange.request
        client.run(request, self.handle(client, request, exchange, failed))

    async def handle(
        self,
        client: Downstream,
        request: IncomingRequest,
        ex: Exchange | None = None,
        failed: Failed | None = None,
    ) -> None:
        """Answer ``request`` (run as its own task by its ``Downstream``).

        ``ex`` is given when ``begin`` started the request: it is routed (``ex.sp``), and
        ``ex.upstream`` is the upstream it picked, if any; with ``failed``, the attempt on it
        failed (retry, or answer the error).
        """
        if ex is None:
            ex = Exchange(self.forwarding, client, request)
        try:
            if ex.sp is None:
                if self.model_prefix is not None and request.method == "POST":
                    await self._read_asked(ex)
                await self._attempts(ex, self._prepare(ex), None)
            else:
                await self._attempts(ex, ex.sp, failed)
        except GatewayError as exc:
            ex.error_response(exc)
        except asyncio.CancelledError:
            ex.cancelled()
            raise
        finally:
            ex.record(self.forwarding.loop.time())

    def _prepare(self, ex: Exchange) -> ServicePool:
        """Route the request and check its limits: its service (``ex.target`` is set)."""
        request = ex.request
        secure = ex.client.secure
        challenges = self.challenges
        if challenges is not None and not secure and request.target.startswith(CHALLENGE_PREFIX):
            ex.path = request.target.partition(b"?")[0].decode("latin-1")
            raise challenge_answer(challenges, request.target)
        label: tuple[bytes, int, bytes] | None = None
        by_model = None if self.model_prefix is None else self._by_model(ex)
        if by_model is not None:
            service = by_model
        else:
            try:
                service, ex.path, ex.target = self._routes.resolve(
                    self.pool.routes, request.host, request.target
                )
            except Unroutable as exc:
                ex.path = exc.path
                label = preview.labelled(request.host)
                if label is None or not isinstance(exc.error, NoRoute):
                    raise exc.error from None
                try:  # r3--hello.example.com: a preview route, if its service allows them
                    service, ex.path, ex.target = route(self.pool.routes, label[2], request.target)
                except Unroutable:
                    raise exc.error from None
        sp = self.pool.services.get(service)
        if sp is None:
            raise no_route(request.host, ex.path)
        ex.service = service
        if sp.previews or label is not None:
            self._preview(ex, sp, label)
        split = sp.snapshot.split
        if split is not None and ex.upstream is None and sp.routing.sticky is not None:
            self._sticky(ex, sp, split, sp.routing.sticky)
        if not secure and sp.https_redirect:
            raise https_redirect(request.host, request.target, self.https_port)
        if sp.guarded:
            forwarding = self.forwarding
            guard.admit(ex, sp, forwarding.trust_forwarded, forwarding.loop.time())
        limit = sp.max_body_size
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
        if sp.inference and ex.asked is not None and sp.prefix_chars:
            prompt = ex.asked.prompt
            if prompt:
                ex.affinity = prompt[: sp.prefix_chars].encode()
        ex.sp = sp
        return sp

    # -- route by model ----------------------------------------------------------------------

    def _model_path(self, target: bytes) -> str | None:
        """The normalised path of ``target`` if it is under ``models.path_prefix``."""
        prefix = self.model_prefix
        assert prefix is not None
        return openai.model_path(prefix, target)

    async def _read_asked(self, ex: Exchange) -> None:
        """A POST on a model path: read its body's beginning (``models.max_body_read`` at
        most, kept for the attempt to send) for the model and the prompt it asks for."""
        body = ex.request.body
        if body is None or self._model_path(ex.request.target) is None:
            return
        data = await body.read_ahead(self.model_read)
        ex.asked = openai.scan(data[: self.model_read])

    def _by_model(self, ex: Exchange) -> str | None:
        """The service a request on a model path goes to: by the model its body names (a
        POST), or None for the route table to say (any other method). ``GET
        {prefix}/models`` and ``GET {prefix}/models/{model}`` are answered here."""
        request = ex.request
        path = self._model_path(request.target)
        if path is None:
            return None
        ex.openai = True
        ex.path = path
        method = request.method
        if method == "GET":
            rest = path if self.model_prefix == "/" else path[len(self.model_prefix or "") :]
            if rest == "/models":
                raise OwnAnswer(
                    200, "models", {"Content-Type": "application/json"}, self.pool.models.listing
                )
            if rest.startswith("/models/"):
                name = rest[len("/models/") :]
                service = self.pool.models.service(name)
                if service is None:
                    raise ModelNotFound(f"The model {name!r} does not exist", model=name)
                entry = json.dumps(model_entry(name, service), separators=(",", ":"))
                raise OwnAnswer(200, "model", {"Content-Type": "application/json"}, entry.encode())
        if method != "POST":
            return None
        text = request.target.decode("latin-1")
        path, query, plain = router.split_target(text)
        problem = None if plain else router.path_problem(text)
        if problem is not None:
            raise BadRequest(f"the request is refused: {problem}")
        asked = ex.asked
        if asked is None or asked.model is None:
            body = request.body
            whole = body is None or (body.complete and body.received <= self.model_read)
            raise openai.model_missing(self.model_read, whole)
        model = asked.model
        service = self.pool.models.service(model)
        if service is None:
            raise ModelNotFound(f"The model {model!r} does not exist", model=model)
        forward = path if plain else router.quote_path(path)
        ex.target = (f"{forward}?{query}" if query else forward).encode("latin-1")
        return service

    def _preview(
        self, ex: Exchange, sp: ServicePool, label: tuple[bytes, int, bytes] | None
    ) -> None:
        """A request that asks for one revision (``preview``): its upstream picked now, among
        that revision's routable ones, by the service's policy; the preview token removed."""
        request = ex.request
        config = sp.routing.preview
        headers = request.headers
        revision = preview.asked(
            config, headers, label and label[0], label[1] if label is not None else None
        )
        if revision is None:
            if label is not None:  # a labelled host of a service without preview routes
                raise no_route(request.host, ex.path)
            return
        token = config.token_header.lower().encode()
        if any(name.lower() == token for name, _ in headers):
            headers[:] = [(name, value) for name, value in headers if name.lower() != token]
            request.plain_lines = None  # the head goes upstream from ``headers``
        candidates = sp.snapshot.of_revision(revision)
        sp.cursor += 1
        upstream = balancer.pick(
            sp.routing.load_balancing, candidates, sp.inflight, self.pool.rng, sp.cursor
        )
        if upstream is None:
            raise sp.unavailable(f"no routable upstream of revision {revision}")
        ex.upstream = upstream
        ex.pinned = revision

    def _sticky(self, ex: Exchange, sp: ServicePool, split: Split, config: StickyConfig) -> None:
        """A request of a sticky service while its traffic is split: the side its client's
        key draws (``sticky``), then the service's policy among that side's upstreams."""
        key = sticky.value(config, ex.request.headers)
        if key is None:
            return  # a random draw, as any request's
        sp.cursor += 1
        ex.upstream = balancer.pick(
            sp.routing.load_balancing,
            split.group(sticky.draw(key)),
            sp.inflight,
            self.pool.rng,
            sp.cursor,
        )

    async def _attempts(self, ex: Exchange, sp: ServicePool, failed: Failed | None) -> None:
        """Lease an upstream and forward, retrying while ``Exchange.may_retry`` allows.

        ``ex.upstream``: the upstream ``begin`` picked; ``failed``: its attempt failed already.
        """
        request = ex.request
        if request.version == "2" and grpc.is_grpc(request.headers):
            timeout = grpc.timeout(request.headers)
            if timeout is not None:
                ex.deadline = ex.started + timeout
        tried: set[str] = set()
        if ex.pinned is not None:  # a preview route: nor a retry goes to another revision
            tried.update(u.id for u in sp.snapshot.upstreams if u.revision != ex.pinned)
        lease = None
        picked = ex.upstream
        if failed is not None:
            assert picked is not None
            tried.add(picked.id)
        else:
            if picked is not None and picked in sp.snapshot.routable and sp.has_room(picked):
                # Still routable since ``begin`` picked it.
                lease = sp.lease_of(picked, asyncio.current_task())
            else:
                lease = sp.lease(frozenset(tried), ex.affinity)
            if lease is None:
                since = self.forwarding.loop.time()
                if not sp.snapshot.routable:
                    try:
                        async with asyncio.timeout_at(ex.deadline):  # None: no deadline
                            await sp.queue(sp.routing.queue_timeout)  # held, or the 503 raised
                    except TimeoutError:
                        raise _past_deadline() from None
                    finally:
                        ex.waited(since, held=True)
                    lease = sp.lease(frozenset(tried), ex.affinity)
                if lease is None:
                    if not sp.cap:
                        raise sp.unavailable()
                    # Every replica it may use is at its cap: wait for a slot (FIFO), or 503.
                    since = self.forwarding.loop.time()
                    try:
                        async with asyncio.timeout_at(ex.deadline):
                            lease = await sp.wait_slot(
                                sp.routing.queue_timeout, ex.affinity, frozenset(tried)
                            )
                    except TimeoutError:
                        raise _past_deadline() from None
                    finally:
                        ex.waited(since, held=False)
        websocket = bool(request.upgrade) and request.is_websocket
        fresh = False
        while True:
            if failed is not None and failed.kind == "stale":
                # Sent again once, on a new connection to the same upstream (``retry``).
                ex.replayed = True
                ex.retry_reasons += ("stale",)
                failed = Failed(failed.error, "disconnect")
                stale = ex.upstream
                if stale is not None and stale in sp.snapshot.routable and sp.has_room(stale):
                    lease, failed, fresh = sp.lease_of(stale, asyncio.current_task()), None, True
            if failed is not None:
                if not ex.may_retry(failed.kind, tried):
                    raise failed.error from None
                ex.retries += 1
                ex.retry_reasons += (failed.kind,)
                lease = sp.lease(frozenset(tried), ex.affinity)
                if lease is None:
                    raise failed.error from None
                failed = None
            assert lease is not None
            tried.add(lease.upstream.id)
            ex.upstream = lease.upstream
            try:
                with lease:
                    if websocket:
                        return await self._websocket(ex, sp, lease, fresh)
                    if sp.routing.upstream_protocol == "http2":
                        return await self._h2(ex, sp, lease, tried)
                    return await self._http(ex, sp, lease, tried, fresh)
            except Failed as exc:
                failed = exc
            fresh = False

    # -- HTTP --------------------------------------------------------------------------------

    async def _http(
        self, ex: Exchange, sp: ServicePool, lease: Lease, tried: Collection[str], fresh: bool
    ) -> None:
        """One attempt on ``lease``'s upstream: on a kept connection, or a new one (``fresh``:
        the request met a stale kept connection already)."""
        upstream = lease.upstream
        timeouts = sp.routing.timeouts
        connector = self.connector
        ex.attempting(upstream)
        tls = None if sp.upstream_tls is None else upstream_tls(sp)
        address = upstream.address if tls is None else tls.key(upstream.address)
        conn = None if fresh else connector.idle(address)
        if conn is None:
            try:
                conn = await connector.connect(upstream.host, upstream.port, timeouts.connect, tls)
            except GatewayError as exc:
                raise ex.failure(exc) from None
        try:
            if timeouts.total:
                async with asyncio.timeout(timeouts.total):
                    await self._send(ex, sp, conn, tried)
            else:
                await self._send(ex, sp, conn, tried)
        except TimeoutError:
            connector.discard(conn)
            if ex.response_started:
                ex.error = "upstream_timeout"
                ex.client.abort()
                return
            error = UpstreamTimeout("upstream did not answer in time", kind="timeout")
            raise ex.failure(error) from None
        except BaseException:
            connector.discard(conn)
            raise

    async def _h2(
        self, ex: Exchange, sp: ServicePool, lease: Lease, tried: Collection[str]
    ) -> None:
        """One attempt on ``lease``'s upstream over HTTP/2 (``upstream_protocol: http2``)."""
        from . import h2_upstream  # the HTTP/2 leg: loaded once a service asks for it

        connector = self._h2_connector
        if connector is None:
            connector = self._h2_connector = h2_upstream.H2Connector(
                self.config.http2.upstream_max_concurrent_streams
            )
        await h2_upstream.forward(ex, sp, lease.upstream, connector, tried, upstream_tls(sp))

    async def _send(
        self, ex: Exchange, sp: ServicePool, conn: UpstreamConnection, tried: Collection[str]
    ) -> None:
        """One attempt on ``conn``: the request (its body as it comes), then the answer."""
        upstream = ex.upstream
        assert upstream is not None
        request = ex.request
        body = request.body
        if body is not None and body.error is not None:
            error = body.error
            raise Failed(error, "client") if isinstance(error, GatewayError) else error
        payload = b""
        length: int | None = None  # with no body: none, unless the client sent one of 0
        if body is None:
            if request.content_length is not None:
                length = 0
        elif body.complete and not body.taken:
            payload = body.take()  # whole already: framed by length, one write
            length = len(payload)
        elif not request.chunked:
            length = request.content_length or 0
        streamed = body is not None and not payload
        head_future = conn.send(
            messages.upstream_request(
                ex.upstream_head(ex.target, upstream), length, request.chunked, payload
            ),
            body=streamed,
            chunked=request.chunked,
            head_only=request.method == "HEAD",
            read_timeout=sp.read_timeout,
            now=self.forwarding.loop.time(),
        )
        if body is not None:
            ex.bytes_in = body.received
            if streamed:
                conn.body_producer = ex.client
                try:
                    body.attach(conn)
                except GatewayError as exc:
                    raise ex.failure(exc) from None
        assert head_future is not None
        try:
            head = await head_future
        except GatewayError as exc:
            if body is not None:
                body.detach()
            raise ex.failure(exc, conn.reused) from None
        ex.ttfb = self.forwarding.loop.time() - ex.started
        failed = ex.check_answer(conn, head, tried)
        if failed is not None:
            raise failed
        await self._respond(ex, conn, head)

    async def _respond(self, ex: Exchange, conn: UpstreamConnection, head: ResponseHead) -> None:
        """Send the upstream's answer to the client as it arrives."""
        sink = ex.open_answer(conn, head)
        try:
            done = conn.stream_to(sink)
            if done is not None:
                await done
        except GatewayError as exc:
            ex.broke_off(conn, sink, exc)
            return
        ex.delivered(conn, sink.bytes_out)

    # -- WebSocket ---------------------------------------------------------------------------

    async def _websocket(self, ex: Exchange, sp: ServicePool, lease: Lease, fresh: bool) -> None:
        """The upgrade on ``lease``'s upstream, then the relay; on a kept connection, or a new
        one (``fresh``: the upgrade met a stale kept connection already)."""
        upstream = lease.upstream
        timeouts = sp.routing.timeouts
        connector = self.connector
        ex.attempting(upstream)
        tls = None if sp.upstream_tls is None else upstream_tls(sp)
        try:
            if fresh:
                conn = await connector.connect(upstream.host, upstream.port, timeouts.connect, tls)
            else:
                conn = await connector.acquire(upstream.host, upstream.port, timeouts.connect, tls)
        except GatewayError as exc:
            raise ex.failure(exc) from None
        try:
            future = conn.send(
                messages.upstream_request(ex.upstream_head(ex.target, upstream), None),
                body=False,
                chunked=False,
                head_only=False,
                read_timeout=timeouts.connect + timeouts.read,
                now=self.forwarding.loop.time(),
            )
            assert future is not None
            try:
                head = await future
            except GatewayError as exc:
                raise ex.failure(exc, conn.reused) from None
            if head.status != 101:
                ex.attempt_failed("protocol", head.status)
                outcome = "5xx" if head.status >= 500 else "ok"
                self.pool.report(sp.routing.name, upstream.id, outcome)
                error = UpstreamProtocolError(
                    f"upstream refused the WebSocket upgrade with status {head.status}",
                    service=sp.routing.name,
                    upstream=upstream.id,
                    upstream_status=head.status,
                )
                raise Failed(error, "protocol")
            self.pool.report(sp.routing.name, upstream.id, "ok")
            await self._relay(ex, lease, conn, head)
        finally:
            if conn.transport is not None and conn.tunnel is None:
                connector.discard(conn)

    async def _relay(
        self, ex: Exchange, lease: Lease, conn: UpstreamConnection, head: ResponseHead
    ) -> None:
        client = ex.client
        ex.status = 101
        ex.response_started = True
        relay = client.upgrade(head, ex.request_id, conn)
        conn.body_producer = client
        conn.tunnel = relay.from_upstream
        conn.on_lost = relay.upstream_lost
        if conn.transport is None:
            relay.upstream_lost()
        if conn.tunnel_data:
            relay.from_upstream(conn.tunnel_data)
        conn.resume_reading()
        client.start_relay(relay)
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


def _past_deadline() -> UpstreamTimeout:
    """A gRPC call's deadline (``Exchange.deadline``) passed while it waited for a replica:
    its DEADLINE_EXCEEDED (504), in place of the wait's own 503."""
    return UpstreamTimeout(
        "the call's deadline (grpc-timeout) passed while it waited for a replica", kind="timeout"
    )


def upstream_tls(sp: ServicePool) -> UpstreamTls | None:
    """The TLS to ``sp``'s replicas (``upstream_tls``), or None: plain."""
    return tls_of(sp.upstream_tls, alpn_of(sp.routing.upstream_protocol))
