"""The codec seam: a client's side of a request as the request path sees it, whatever the
HTTP version on the wire (``Downstream``).

A codec reads requests off a client connection (an ``IncomingRequest`` each: its head, then
its body as it comes) and hands each to the proxy (``Begin``, else ``Handler``) with the
``Downstream`` it is answered through. ``Proxy``, ``Exchange``, routing, retries, limits and
metrics call only the methods here: the bytes on the wire, the framing of a body, and
whether the connection is kept for another request are the codec's. HTTP/1.1 on llhttp is
``http1_downstream.ClientConnection`` (one ``Downstream`` per connection, its active
request's); an HTTP/2 codec implements the same trait, one per stream.

What a codec implements (an HTTP/2 one, say, beside HTTP/1.1's):

- the request, as events: an ``IncomingRequest`` with ``method``, ``target``, ``host``,
  ``headers``, ``content_length`` (None: not given), ``chunked`` (a body of no known
  length: it goes upstream chunked), ``upgrade``/``websocket_key``/``version`` (what
  ``is_websocket`` reads) and ``request_id`` set, handed on once its head is whole; a
  ``RequestBody`` on it if a body follows, fed (``feed``), ended (``finish``) or broken
  (``fail``) as it comes. The body's source (``request.BodySource``) is paused while too
  much of it is buffered, and ``send_continue`` is HTTP/1.1's 100 Continue (nothing to send
  where the version has no such step).
- the answer, through ``Downstream``: ``answer`` (a whole one) or ``open_answer`` (one that
  streams: a ``streams.ResponseStream`` over the codec's ``streams.ClientSide``, which the
  upstream connection writes the body to and pauses with). ``ResponseStream.chunked`` says
  the client takes the upstream's chunks as they are (HTTP/1.1 chunked framing only); a
  codec whose frames are not the bytes of its socket gives a ``ClientSide`` of its own
  stream, whose ``transport`` frames what is written to it (the memoryviews of a spliced
  answer too, held no longer than its ``get_write_buffer_size`` says: ``wire.splice``) and
  whose ``socket_fd`` is -1 (nothing is written past it). The answer has ended when
  ``finished`` is called (served without a task) or the work given to ``run`` returns;
  ``abort`` cuts it off so that it never looks complete (for a stream of a shared
  connection: that stream's reset).
- ``send_error``, the gateway's own answers (the JSON body and fields
  ``messages.gateway_error_response`` puts in HTTP/1.1's bytes, in the codec's framing; to
  a gRPC request over HTTP/2, a trailers-only answer, ``wire.grpc``);
- ``trailers``, an upstream's trailers after the body (HTTP/2's last HEADERS);
- ``upgrade``/``start_relay``, a WebSocket relay (``websocket.Relay`` over a ``Side``).

What stays HTTP/1.1's special cases, set only by its codec: ``IncomingRequest.plain_lines``,
``raw_fields``, ``forwarded`` and ``authorization`` (a plain head sent upstream as its
lines, ``messages.plain_upstream_head`` and ``guard``), ``keep_alive`` and ``last`` (the
connection's reuse), the splice of a large request body from the client's socket
(``wire.splice``), and the chunked relay. The upstream leg is HTTP/1.1 whatever the
client's version (``connector``, ``messages.upstream_request``), or HTTP/2 for a service
with ``upstream_protocol: http2`` (``h2_upstream``).

A mypyc trait, not a ``typing.Protocol``: compiled, a call through a trait goes through its
vtable as a call on the class itself does, where a protocol's is a call by name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from mypy_extensions import trait

from ..errors import GatewayError
from .messages import ResponseHead
from .request import IncomingRequest
from .streams import Producer, ResponseStream
from .websocket import Relay, Side


class Tunneled(Side, Producer, Protocol):
    """The upstream connection of a relay: written to, and paused with the client."""


class Cancellable(Protocol):
    """The exchange of a request served without a task (``Begin``): cut off when the client
    goes away."""

    def cancel(self) -> None: ...


@trait
class Downstream:
    """The client's side of the request being answered: where its answer goes."""

    peer: str | None
    """The client's address (the X-Forwarded-For the upstream gets), if known."""
    secure: bool
    """Over TLS."""
    send_timed_out: bool
    """The client left its answer unread for ``send_timeout`` and was cut off."""
    exchange: Cancellable | None
    """The active request's exchange while it runs without a task (``Begin``)."""
    grpc_status: str | None
    """The gRPC status the answer to a gRPC request carried (``wire.grpc.status``: its
    trailers, a trailers-only head, or the gateway's own), once sent; None otherwise (and
    always over HTTP/1.1, which carries no gRPC)."""

    def answer(
        self,
        request: IncomingRequest,
        head: ResponseHead,
        request_id: bytes,
        extra: bytes,
        producer: Producer,
        body: bytes,
    ) -> None:
        """Send a whole answer: ``head`` (the upstream's), one more field line ``extra`` (HSTS's)
        if given, and all of its ``body``, framed by its length. ``producer``: the upstream
        connection, paused while the client cannot take more."""
        raise NotImplementedError

    def open_answer(
        self,
        request: IncomingRequest,
        head: ResponseHead,
        request_id: bytes,
        extra: bytes,
        producer: Producer,
    ) -> ResponseStream:
        """The stream an answer's body goes to as it comes, its head pending in it (written
        with the body's first piece, or alone by ``ResponseStream.write_head``)."""
        raise NotImplementedError

    def send_error(self, request: IncomingRequest, exc: GatewayError, request_id: str) -> None:
        """Answer with the gateway's own error (no answer went to the client yet)."""
        raise NotImplementedError

    def trailers(self, fields: list[tuple[bytes, bytes]]) -> None:
        """Fields (lower-cased names) that end the streamed answer under way, after its body:
        an upstream's trailers (gRPC's status). Where the version cannot carry them to this
        client they are dropped (HTTP/1.1: the gateway does not send chunked trailers)."""
        raise NotImplementedError

    def upgrade(self, head: ResponseHead, request_id: str, upstream: Tunneled) -> Relay:
        """The upstream accepted the WebSocket upgrade (its 101 is ``head``): pass the 101 on,
        and relay the client's bytes to ``upstream`` from now on (``start_relay``)."""
        raise NotImplementedError

    def start_relay(self, relay: Relay) -> None:
        """The upstream's side of ``relay`` is in place: what the client sent after its head,
        then what it sends."""
        raise NotImplementedError

    def finished(self, request: IncomingRequest, now: float) -> None:
        """The active request, served without a task, was answered; ``now``: the loop's
        time, read as it was."""
        raise NotImplementedError

    def run(self, request: IncomingRequest, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Go on with the active request in a task of its own, running ``work``."""
        raise NotImplementedError

    def abort(self) -> None:
        """Cut the answer under way off, so that it never looks complete."""
        raise NotImplementedError

    def pause_reading(self) -> None:
        """The upstream cannot take more of the request body."""
        raise NotImplementedError

    def resume_reading(self) -> None:
        raise NotImplementedError


Handler = Callable[[Downstream, IncomingRequest], Coroutine[Any, Any, None]]
"""Serves a request as a task of its own (``Proxy.handle``)."""
Begin = Callable[[Downstream, IncomingRequest], bool]
"""Serves a request without a task of its own if it can (``Proxy.begin``); False if not."""
