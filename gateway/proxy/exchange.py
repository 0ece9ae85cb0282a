"""The exchange: one request and its answer, across its attempts; the request's one owner.

An ``Exchange`` is made when a request's head was read, by ``Proxy.begin`` or
``Proxy.handle``, and lives until its record went to the observers. It holds what the
request has done so far (route, upstream, status, timings, bytes, retries, error) and does
what both ways through the proxy share: the failure of an attempt and whether it is retried,
the answer's head towards the client, the answer delivered or broken off, the gateway's own
error answers, and the record. It knows the client only as its ``codec.Downstream``: the
bytes of the answer and whether the connection is kept are the codec's.

The common request is served without a task (``Proxy.begin``): the exchange then is the
upstream connection's ``Waiter`` (told of the answer from its callbacks), the client's
``Downstream.exchange`` (cancelled if the client goes away) and its pool's holder of the
request in flight (aborted if a drain times out): exactly one of ``answered``, ``failed``
and ``cancel`` ends it, or hands it on to a task (``Forwarding.hand_on``), and each clears
the references to it. Anything else is ``Proxy.handle``, as the request's task, with the
same exchange.

Invariants: an exchange is recorded exactly once; the request it holds in flight without a
task is released exactly once (``_end``); a response whose upstream body broke off is
aborted, never completed short.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence

from ..config import ProxyConfig
from ..errors import (
    BadRequest,
    FailureKind,
    GatewayError,
    OwnAnswer,
    RequestTimeout,
    RequestTooLarge,
    UpstreamError,
    UpstreamProtocolError,
)
from ..observability import tracing
from ..observability.span_buffer import SpanBuffer
from ..observability.spans import Recording
from ..pool.events import NO_TOKENS, ClientTimeout, RequestObserver, RequestRecord, Tokens
from ..pool.pool import Pool
from ..pool.service_pool import ServicePool
from ..pool.upstream import Upstream
from ..wire import headers
from . import answers, messages, openai, retry
from .codec import Downstream
from .connector import Connector, ResponseHead, UpstreamConnection
from .openai import Asked
from .request import IncomingRequest
from .retry import RETRY_STATUSES, Failed
from .streams import Producer, ResponseStream
from .tokens import TokenCount, kind_of

log = logging.getLogger(__name__)


class Forwarding:
    """What the exchanges of one proxy share (``Exchange.proxy``): the pool, the upstream
    connections, the observers, the loop, and where an exchange goes on as its request's
    task (``hand_on``). ``Proxy`` makes one and holds it (``Proxy.forwarding``)."""

    loop: asyncio.AbstractEventLoop
    """The running loop (from ``open``)."""

    def __init__(
        self,
        pool: Pool,
        config: ProxyConfig,
        observers: Sequence[RequestObserver],
        hand_on: Callable[[Exchange, Failed | None], None],
        spans: SpanBuffer | None = None,
    ) -> None:
        self.pool = pool
        self.trust_forwarded = config.trust_forwarded
        """``config.trust_forwarded``, read on every request (a plain attribute: see
        ``ServicePool.configure``)."""
        self.propagate = config.tracing.propagate
        """``config.tracing.propagate``: each request gets a trace context (``tracing``)."""
        self.sample_ratio = config.tracing.sample_ratio
        self.spans = spans
        """Where the spans of sampled requests go (``spans``); None: none is recorded."""
        self.observers = tuple(observers)
        self.hand_on = hand_on
        """Go on with an exchange as its request's task (after a failed attempt, if given):
        ``Proxy.hand_on``."""
        self._connector: Connector | None = None

    def client_timeout(self, protocol: str, timeout: ClientTimeout) -> None:
        """A client given up on for slowness (``ConnectionGate.timed_out``): the observers
        told."""
        for observer in self.observers:
            try:
                observer.on_client_timeout(protocol, timeout)
            except Exception:
                log.exception("request observer %r failed", observer)

    def open(self, loop: asyncio.AbstractEventLoop, connector: Connector) -> None:
        """Forward on ``loop`` with ``connector``'s upstream connections (``Proxy.start``)."""
        self.loop = loop
        self._connector = connector

    def close(self) -> Connector | None:
        """Forward no more: the connector, to be closed, if one was open."""
        connector, self._connector = self._connector, None
        return connector

    @property
    def opened(self) -> bool:
        return self._connector is not None

    @property
    def connector(self) -> Connector:
        if self._connector is None:
            raise RuntimeError("Proxy.start() was not called")
        return self._connector


class Exchange:
    """One request, its answer and its record, across its attempts.

    Attributes read their class defaults until set: one is made per request, and setting
    each in ``__init__`` cost more than the rest of its making.
    """

    path: str = ""
    service: str = ""
    upstream: Upstream | None = None
    """The upstream of the current (or last) attempt."""
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
    """The upstream connection while served without a task."""
    sink: ResponseStream | None = None
    """Where the answer's body goes while it streams, served without a task."""
    held: str | None = None
    """The upstream this holds the request in flight on without a task, until ``_end``."""
    affinity: bytes | None = None
    """The key ``load_balancing: hash`` hashes (``guard``), once routed."""
    openai: bool = False
    """The request came on a model path (``models``): the gateway's errors take OpenAI's
    shape."""
    asked: Asked | None = None
    """What its body asks for (model, prompt), once read on a model path."""
    tokens: TokenCount | None = None
    """Its answer's tokens, counted as they go by: on a model path, an event stream or JSON."""
    strip: bytes | None = None
    """A header (lower-cased) not sent upstream: the service's token (``guard``)."""
    rid: bytes = b""
    """``request_id`` encoded (``request_id_bytes``), once made."""
    pinned: int | None = None
    """The revision a preview route asked for: no attempt goes to another (``preview``)."""
    replayed: bool = False
    """Sent again once already after a stale kept connection (``retry.stale``)."""
    trace: bytes = b""
    """The traceparent and tracestate lines sent upstream (``tracing.context``); empty when
    not traced (the client's pass on as they are)."""
    recording: Recording | None = None
    """The spans of a sampled request while spans are exported (``spans``)."""
    deadline: float | None = None
    """The loop time a gRPC request's ``grpc-timeout`` ends its call, waits for a replica
    included (``Proxy._attempts``); None: it has none."""
    whole_body: bytes | None = None
    """The request's whole body, taken at once by an attempt over HTTP/2 (``h2_upstream``):
    sent again by the retry of a refused stream, which no replica processed."""

    def __init__(self, proxy: Forwarding, client: Downstream, request: IncomingRequest) -> None:
        self.proxy = proxy
        self.client = client
        self.request = request
        candidate = request.request_id
        if proxy.propagate:
            made, self.trace = tracing.context(
                request.traceparent, request.tracestate, proxy.sample_ratio
            )
            if proxy.spans is not None and tracing.sampled(self.trace):
                self.recording = Recording(
                    made[:32], made[33:], tracing.parent_id(request.traceparent)
                )
            if candidate is None:
                self.request_id = made
            else:
                self.request_id = headers.request_id(candidate.decode("latin-1"), made)
            if not request.traced and request.plain_lines is not None:
                request.plain_lines = None  # they hold the client's: its fields are sorted out
        else:
            self.request_id = headers.request_id(candidate.decode("latin-1") if candidate else None)
            if request.traced:
                request.plain_lines = None  # they are without the client's: sent from its fields
        self.started = proxy.loop.time()

    # -- without a task ----------------------------------------------------------------------

    def start(self, sp: ServicePool, upstream: Upstream, conn: UpstreamConnection) -> None:
        """Send the request (routed, no body) on ``conn``, an idle connection to ``upstream``,
        and be told of its answer by the connection's callbacks."""
        request = self.request
        self.upstream = upstream
        self.conn = conn
        if self.recording is not None:
            self.attempting(upstream)
        sp.hold(upstream.id, self)
        self.held = upstream.id
        client = self.client
        client.exchange = self
        if request.plain_lines is not None and not (
            request.forwarded and self.proxy.trust_forwarded
        ):
            data = messages.plain_upstream_head(
                request,
                self.target,
                peer=client.peer,
                request_id=self.request_id_bytes(),
                secure=client.secure,
                address="" if request.host else upstream.address,
                empty_body=request.content_length is not None,
                trace=self.trace,
            )
        else:
            data = messages.upstream_request(
                self.upstream_head(self.target, upstream),
                0 if request.content_length is not None else None,
            )
        conn.send(
            data,
            body=False,
            chunked=False,
            head_only=request.method == "HEAD",
            read_timeout=sp.read_timeout,
            now=self.started,  # this callback's: the exchange began in it
            waiter=self,
        )

    def answered(self, conn: UpstreamConnection, head: ResponseHead) -> None:
        """The answer's final head arrived (``connector.Waiter``)."""
        upstream = self.upstream
        assert upstream is not None
        now = self.proxy.loop.time()
        self.ttfb = now - self.started
        if head.status >= 500:
            failed = self.check_answer(conn, head, (upstream.id,))
            if failed is not None:
                self._retry(failed)
                return
        if conn.complete and head.content_length is not None:  # the whole answer (most)
            body = conn.take_body()  # framed by its length: never chunked to the client
            extra = self.answering(head)
            self.client.answer(self.request, head, self.request_id_bytes(), extra, conn, body)
            self._served(len(body), now)
            return
        sink = self.open_answer(conn, head)
        done = conn.stream_to(sink)  # never raises: the connection has not failed
        if done is None:
            self._served(sink.bytes_out, now)
        else:
            self.sink = sink
            done.add_done_callback(self._streamed)

    def failed(self, conn: UpstreamConnection, error: GatewayError) -> None:
        """The attempt failed before the answer's head arrived (``connector.Waiter``)."""
        conn.abort()
        self._retry(self.failure(error, conn.reused))

    def abort(self) -> None:
        """A drain of its upstream timed out (``pool.Holder``)."""
        self.cancel()

    def cancel(self) -> None:
        """Cut the exchange off: the client went away, or a drain timed out."""
        client = self.client
        if client.exchange is not self:
            return  # over already
        conn = self.conn
        self.sink = None
        if conn is not None:
            conn.waiter = None
            conn.abort()  # not through the connector, which is gone when the gateway stops
        self._end()
        self.status = self.status or 499
        self.error = "client_too_slow" if client.send_timed_out else self.error or "cancelled"
        self.record(self.proxy.loop.time())
        client.abort()

    def _streamed(self, done: asyncio.Future[None]) -> None:
        """The body of the answer ended, whole or broken off (unless cut off before)."""
        sink = self.sink
        if self.client.exchange is not self or sink is None:
            return  # cancelled meanwhile
        self.sink = None
        error = None if done.cancelled() else done.exception()
        if error is None:
            self._served(sink.bytes_out, self.proxy.loop.time())
            return
        conn = self.conn
        assert conn is not None
        if not isinstance(error, GatewayError):
            error = UpstreamProtocolError(f"upstream response failed: {error!r}")
        self.broke_off(conn, sink, error)
        self._end()
        self.record(self.proxy.loop.time())

    def _served(self, bytes_out: int, now: float) -> None:
        conn = self.conn
        assert conn is not None
        self.delivered(conn, bytes_out)
        self._end()
        self.record(now)
        self.client.finished(self.request, now)

    def _retry(self, failed: Failed) -> None:
        """The attempt failed (its connection is gone): retry it, or answer, in a task.

        Nothing is held across: if the task is cancelled before it starts, nothing leaks.
        """
        self._end()
        self.proxy.hand_on(self, failed)

    def _end(self) -> None:
        """No longer in flight without a task; drop the references that made this a cycle."""
        held = self.held
        if held is not None:
            self.held = None
            sp = self.sp
            assert sp is not None
            sp.unhold(held, self)
        self.conn = None
        self.client.exchange = None

    # -- both ways ---------------------------------------------------------------------------

    def attempting(self, upstream: Upstream) -> None:
        """An attempt on ``upstream`` begins: with spans recorded, its client span's id goes
        upstream as the ``traceparent``'s parent id."""
        recording = self.recording
        if recording is not None:
            span = recording.attempt(upstream, self.proxy.loop.time())
            self.trace = tracing.with_parent(self.trace, span)

    def attempt_failed(self, kind: str, status: int = 0) -> None:
        """The attempt failed with ``kind`` (its client span ends, with the error)."""
        recording = self.recording
        if recording is not None:
            recording.failed(kind, self.proxy.loop.time(), status)

    def waited(self, since: float, held: bool) -> None:
        """The request waited for an upstream from ``since`` (``held``: none was routable)."""
        recording = self.recording
        if recording is not None:
            recording.queued += self.proxy.loop.time() - since
            recording.cold_start = recording.cold_start or held

    def request_id_bytes(self) -> bytes:
        """``request_id`` encoded, once: both heads carry it."""
        rid = self.rid
        if not rid:
            rid = self.rid = self.request_id.encode()
        return rid

    def upstream_head(self, target: bytes, upstream: Upstream) -> list[bytes]:
        """The request line and header lines sent to ``upstream`` (framing not included)."""
        return messages.upstream_head(
            self.request,
            target,
            peer=self.client.peer,
            request_id=self.request_id,
            trust_forwarded=self.proxy.trust_forwarded,
            address="" if self.request.host else upstream.address,  # made only if used
            secure=self.client.secure,
            drop=self.strip,
            trace=self.trace,
        )

    def stale(self, kind: FailureKind, reused: bool) -> bool:
        """Whether the attempt that failed with ``kind`` met a stale kept connection."""
        request = self.request
        body = request.body
        return retry.stale(
            kind,
            reused=reused,
            method=request.method,
            has_body=body is not None,
            body_taken=body is not None and body.taken,
            response_started=self.response_started,
        )

    def may_retry(self, kind: FailureKind, tried: Collection[str]) -> bool:
        """Whether an attempt that failed with ``kind`` is tried again (``retry``)."""
        sp = self.sp
        assert sp is not None
        request = self.request
        body = request.body
        kept = kind == "refused" and self.whole_body is not None
        return retry.may_retry(
            kind,
            method=request.method,
            has_body=body is not None,
            body_taken=body is not None and body.taken and not kept,
            response_started=self.response_started,
            retries=self.retries,
            elapsed=self.proxy.loop.time() - self.started,
            config=sp.routing.retries,
            routable=sp.snapshot.routable,
            tried=tried,
        )

    def failure(self, error: GatewayError, reused: bool = False) -> Failed:
        """An attempt's failure, reported to passive detection unless the client caused it
        or it met a stale kept connection (``reused``: the attempt's connection had served a
        request before)."""
        kind = error.kind
        if kind == "client" or isinstance(error, RequestTooLarge | RequestTimeout | BadRequest):
            self.attempt_failed("client")
            return Failed(error, "client")
        self.attempt_failed(kind)
        upstream, sp = self.upstream, self.sp
        assert upstream is not None
        assert sp is not None
        error.details.update(service=sp.routing.name, upstream=upstream.id)
        if not self.replayed and self.stale(kind, reused):
            return Failed(error, "stale")
        outcome = "connect_failure" if kind == "connect" or kind == "refused" else "5xx"
        self.proxy.pool.report(sp.routing.name, upstream.id, outcome)
        return Failed(error, kind)

    def check_answer(
        self, conn: UpstreamConnection | None, head: ResponseHead, tried: Collection[str]
    ) -> Failed | None:
        """The answer's head arrived (``ttfb`` is set): passive detection, and the failure
        if it is retried (``conn`` is discarded then; None: an HTTP/2 stream, which its
        caller resets)."""
        upstream, sp = self.upstream, self.sp
        assert upstream is not None
        assert sp is not None
        status = head.status
        if status >= 500:
            proxy = self.proxy
            proxy.pool.report(sp.routing.name, upstream.id, "5xx")
            if status in RETRY_STATUSES and self.may_retry("status", tried):
                self.attempt_failed("status", status)
                if conn is not None:
                    proxy.connector.discard(conn)
                error = UpstreamError(
                    f"upstream answered {status}", service=sp.routing.name, upstream=upstream.id
                )
                return Failed(error, "status")
        return None

    def answering(self, head: ResponseHead) -> bytes:
        """The answer's head arrived and goes to the client: no other answer is possible.
        Returns the field line the service adds to it (HSTS's, over TLS), or nothing."""
        self.status = head.status
        self.response_started = True
        if self.client.secure:
            sp = self.sp
            hsts = sp.hsts if sp is not None else None
            if hsts is not None:
                return answers.hsts_field(hsts)
        return b""

    def open_answer(self, conn: Producer, head: ResponseHead) -> ResponseStream:
        """The answer goes to the client as it comes from ``conn``: where its body goes (its
        head with it)."""
        extra = self.answering(head)
        sink = self.client.open_answer(self.request, head, self.request_id_bytes(), extra, conn)
        if self.openai:
            kind = kind_of(head.status, head.fields)
            if kind:  # an event stream or JSON: counted
                sink.tokens = self.tokens = TokenCount(kind, self.started)
                sink.clock = self.proxy.loop.time
        return sink

    def delivered(self, conn: UpstreamConnection | None, bytes_out: int) -> None:
        """The answer went to the client whole: the upstream connection is free again (None:
        an HTTP/2 stream's, ``h2_upstream``)."""
        sp, upstream = self.sp, self.upstream
        assert sp is not None
        self.bytes_out = bytes_out
        body = self.request.body
        if body is not None:
            self.bytes_in = body.received
        self.complete = True
        proxy = self.proxy
        if self.status < 500 and upstream is not None:
            proxy.pool.succeeded(sp, upstream.id)
        if conn is not None:
            proxy.connector.release(conn)

    def broke_off(
        self, conn: UpstreamConnection | None, sink: ResponseStream, exc: GatewayError
    ) -> None:
        """The answer's body broke off: cut the client off without its end, so it must never
        look complete."""
        sp, upstream = self.sp, self.upstream
        assert sp is not None
        self.bytes_out = sink.bytes_out
        self.error = exc.code
        self.client.abort()
        proxy = self.proxy
        if conn is not None:
            proxy.connector.discard(conn)
        if exc.kind != "client":
            proxy.pool.report(sp.routing.name, upstream.id if upstream else "", "5xx")

    def error_response(self, exc: GatewayError) -> None:
        """Answer with the gateway's own error (no answer went to the client yet)."""
        self.status = exc.status
        if isinstance(exc, OwnAnswer):
            self.error = None
        else:
            self.error = exc.code
            if self.openai:
                exc = openai.error_answer(exc)
        self.client.send_error(self.request, exc, self.request_id)

    def cancelled(self) -> None:
        """The request's task was cancelled (the client went away, a drain timed out)."""
        self.status = self.status or 499
        if self.client.send_timed_out:
            self.error = "client_too_slow"
        elif not self.complete:
            self.error = self.error or "cancelled"

    def record(self, now: float) -> None:
        """Tell the observers what the exchange did (exactly once, at its end), and hand its
        spans on if it was sampled."""
        observers = self.proxy.observers
        if not observers and self.recording is None:
            return
        upstream = self.upstream
        # Positional, in the order of RequestRecord's fields: fifteen keywords cost more than
        # the metrics of the request do.
        record = RequestRecord(
            self.request_id,
            self.service,
            upstream.revision if upstream is not None else None,
            upstream.id if upstream is not None else None,
            self.request.method,
            self.path,
            self.status,
            now - self.started,
            self.ttfb,
            self.bytes_in,
            self.bytes_out,
            self.retries,
            self.retry_reasons,
            self.error,
            self.request.version,
            self.client.grpc_status,
        )
        if self.openai:
            self._model_record(record)
        else:
            for observer in observers:
                try:
                    observer.on_request(record)
                except Exception:
                    log.exception("request observer %r failed", observer)
        if self.recording is not None:
            self._spans(record, now)

    def _model_record(self, record: RequestRecord) -> None:
        """Tell the observers of a request on a model path, with its tokens."""
        count = self.tokens
        if count is None:
            figures = NO_TOKENS
        else:
            gaps = count.gaps
            figures = Tokens(
                count.ttft, count.output_tokens, gaps.counted() if count.chunks > 1 else None
            )
        for observer in self.proxy.observers:
            try:
                observer.on_model_request(record, figures)
            except Exception:
                log.exception("request observer %r failed", observer)

    def _spans(self, record: RequestRecord, now: float) -> None:
        """A sampled request's spans, to ``Forwarding.spans``."""
        recording, spans = self.recording, self.proxy.spans
        if recording is None or spans is None:
            return
        sp, upstream = self.sp, self.upstream
        if self.pinned is not None:
            recording.choice = "preview"
        elif sp is not None and upstream is not None and sp.snapshot.split is not None:
            recording.choice = (
                "canary" if upstream.revision == sp.snapshot.split.revision else "stable"
            )
        host = self.request.host.decode("latin-1")
        # Spans are stamped with the wall clock: its offset from the loop's, read now (the
        # two drift apart over a long uptime).
        spans.add(recording.finish(record, host, now, time.time() - now))
        self.recording = None  # recorded once

    def __repr__(self) -> str:
        request = self.request
        return f"<Exchange {self.request_id} {request.method} {request.target!r} {self.status}>"
