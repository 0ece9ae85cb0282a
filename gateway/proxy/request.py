"""A request as the client sent it: its head (``IncomingRequest``) and its body
(``RequestBody``), and the rules a head must meet on top of llhttp's.

A head is refused (``Refused``: status, code, message) if a field is over
``max_header_size``, there are more than ``MAX_HEADERS`` fields, a value is not UTF-8, Host
is repeated or not ``host[:port]``, or its shape is one an upstream could read differently
(``head_problem``). A body is buffered until an attempt takes it, then goes straight through.
"""

from __future__ import annotations

import asyncio
import re
from typing import Final, Protocol

from ..errors import RequestTooLarge
from ..wire import plainhead
from ..wire.headers import Fields
from ..wire.http1 import MAX_HEADERS
from .streams import BodySink

HOST: Final = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]*)(:[0-9]{0,5})?")
"""What a Host header may be (RFC 9112 3.2: anything else is a 400)."""
BODY_HIGH_WATER: Final = 256 * 1024
"""Request body bytes buffered before the client is paused (no upstream took them yet)."""

# The request fields the proxy reads (all others it only passes on).
# (Each a Final literal: compiled, a constant of the C code; a name set any other way,
# ``A, B = 1, 2`` for one, is looked up in the module's dict at every use.)
_HOST_FIELD: Final = 1
_CONTENT_LENGTH_FIELD: Final = 2
_TRANSFER_ENCODING_FIELD: Final = 3
_UPGRADE_FIELD: Final = 4
_WEBSOCKET_KEY_FIELD: Final = 5
_REQUEST_ID_FIELD: Final = 6
_TRACEPARENT_FIELD: Final = 7
_TRACESTATE_FIELD: Final = 8
_SPECIAL_FIELDS: Final = {
    b"host": _HOST_FIELD,
    b"content-length": _CONTENT_LENGTH_FIELD,
    b"transfer-encoding": _TRANSFER_ENCODING_FIELD,
    b"upgrade": _UPGRADE_FIELD,
    b"sec-websocket-key": _WEBSOCKET_KEY_FIELD,
    b"x-request-id": _REQUEST_ID_FIELD,
    b"traceparent": _TRACEPARENT_FIELD,
    b"tracestate": _TRACESTATE_FIELD,
}


class BodySource(Protocol):
    """The client connection a body comes on: paused while too much of it is buffered."""

    def pause_body(self) -> None: ...
    def resume_body(self) -> None: ...
    def send_continue(self) -> None:
        """Tell the client to send the body it holds back (``Expect: 100-continue``)."""


class RequestBody:
    """The body of one request, from the client to the upstream of the current attempt.

    Buffered (up to ``BODY_HIGH_WATER``, then the client is paused) until an attempt
    ``attach``es its upstream connection; from then on each piece goes straight through.
    ``started`` tells whether any byte left for an upstream, after which no retry can
    replay it.
    """

    __slots__ = (
        "_buffer",
        "_buffered",
        "_conn",
        "_enough",
        "_sink",
        "_want",
        "complete",
        "error",
        "expect_continue",
        "limit",
        "received",
        "started",
        "trailers",
    )

    def __init__(self, conn: BodySource, expect_continue: bool) -> None:
        self._conn = conn
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._sink: BodySink | None = None
        self._enough: asyncio.Future[None] | None = None
        self._want = 0
        self.limit = 0
        """The service's ``max_body_size``, known once routed (``set_limit``); 0: none."""
        self.expect_continue = expect_continue
        self.received = 0
        self.started = False
        self.complete = False
        self.error: BaseException | None = None
        self.trailers: list[tuple[bytes, bytes]] | None = None
        """Fields the client sent after the body (HTTP/2 trailers), known once it is
        ``complete``: relayed to an HTTP/2 upstream, dropped by HTTP/1.1's (as nginx does)."""

    def feed(self, data: bytes | memoryview) -> None:
        """A piece of the body (a memoryview only while ``sink_transport`` is not None)."""
        if self.error is not None:
            return
        self.received += len(data)
        if self.limit and self.received > self.limit:
            self.fail(self._too_large())
            return
        sink = self._sink
        if sink is not None:
            sink.body_data(data)
            return
        self._buffer.append(bytes(data))  # kept: never a view of a buffer read into again
        self._buffered += len(data)
        if self._buffered > BODY_HIGH_WATER:
            self._conn.pause_body()
        if self._enough is not None and self._buffered >= self._want:
            self._wake()

    def _wake(self) -> None:
        enough, self._enough = self._enough, None
        if enough is not None and not enough.done():
            enough.set_result(None)

    async def read_ahead(self, size: int) -> bytes:
        """Wait until ``size`` bytes of the body are buffered, or all of it (or it failed:
        ``error``); the bytes buffered then, which stay buffered for the attempt to send
        (``size`` at most ``BODY_HIGH_WATER``, or the client is paused short of it)."""
        if self._sink is not None:
            raise RuntimeError("the body went to an upstream already")
        if not self.complete and self.error is None and self._buffered < size:
            if self.expect_continue:
                self.expect_continue = False
                self._conn.send_continue()
            self._want = size
            enough = self._enough = asyncio.get_running_loop().create_future()
            try:
                await enough
            finally:
                self._enough = None
        return b"".join(self._buffer)

    def finish(self) -> None:
        self.complete = True
        if self._enough is not None:
            self._wake()
        if self._sink is not None and self.error is None:
            self._sink.body_end()

    def fail(self, exc: BaseException) -> None:
        """The body cannot be delivered (too large, too slow, the client left)."""
        if self.error is not None or self.complete:
            return
        self.error = exc
        self._buffer.clear()
        if self._enough is not None:
            self._wake()
        if self._sink is not None:
            self._sink.body_error(exc)

    def attach(self, sink: BodySink) -> None:
        """Send the body to ``sink``: what is buffered now, the rest as it arrives."""
        if self.error is not None:
            raise self.error
        self._sink = sink
        if self._buffer:
            self.started = True
            for data in self._buffer:
                sink.body_data(data)
            self._buffer.clear()
            self._buffered = 0
            self._conn.resume_body()
        elif self.expect_continue and not self.complete:
            self._conn.send_continue()
        self.expect_continue = False
        if self.complete:
            sink.body_end()
        else:
            self.started = True

    def detach(self) -> None:
        self._sink = None

    @property
    def taken(self) -> bool:
        """A byte of it went to an upstream, or it can no longer be delivered: it cannot be
        sent again."""
        return self.started or self.error is not None

    def sink_transport(self) -> asyncio.Transport | None:
        """The transport each piece ``feed`` takes now is written to as it is, if any."""
        if self._sink is None or self.error is not None:
            return None
        return self._sink.transport

    def set_limit(self, limit: int) -> None:
        """The service's ``max_body_size`` (known once routed); 0 is no limit."""
        self.limit = limit
        if limit and self.received > limit:
            self._buffer.clear()
            self.error = self._too_large()
            raise self.error

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(
            f"request body is over the limit of {self.limit} bytes", limit=self.limit
        )

    def take(self) -> bytes:
        """The whole body, already received and buffered; it counts as sent."""
        data = b"".join(self._buffer)
        self._buffer.clear()
        self._buffered = 0
        self.started = True
        self._conn.resume_body()
        return data


class IncomingRequest:
    """One request as the client sent it: its head, parsed, and its body.

    Attributes read their class defaults until the parser sets them: one is made per
    request, and setting each in ``__init__`` cost more than the rest of its making.
    """

    method = ""
    target = b""
    version = "1.1"
    host = b""
    host_seen = False
    content_length: int | None = None
    chunked = False
    upgrade = b""
    websocket_key = False
    request_id: bytes | None = None
    traceparent: bytes | None = None
    """The traceparent field (``plainhead.TWICE`` if more than one: not valid)."""
    tracestate: bytes | None = None
    """The tracestate fields, joined with ``,`` if more than one."""
    keep_alive = True
    last = False
    """The client said it sends nothing after this request (``Connection: close``, or
    HTTP/1.0 without keep-alive): its connection may close at once after the answer."""
    body: RequestBody | None = None

    raw_fields = b""
    """The field lines of a head read by ``plainhead`` (``headers`` is made of them if
    asked for)."""
    plain_lines: bytes | None = None
    """Of those, the lines that go upstream as they are (``headers.plain_upstream_request``);
    None for a head llhttp read."""
    forwarded = False
    """Whether a head read by ``plainhead`` holds an X-Forwarded-* field."""
    authorization: bytes | None = None
    """The Authorization value of a head read by ``plainhead`` (``plainhead.TWICE`` if it
    has more than one), so that ``guard`` need not search its fields again."""
    authorization_at = -1
    """Where that field's line begins in ``plain_lines`` (-1: not there)."""
    traced = False
    """Whether ``plain_lines`` are without the traceparent and tracestate fields (read with
    ``plainhead.request``'s ``trace``): the gateway writes its own (``tracing``)."""

    def __init__(self, headers: Fields | None) -> None:
        self._headers = headers

    @property
    def headers(self) -> Fields:
        """The request's fields, as they came (in order, names as spelled)."""
        headers = self._headers
        if headers is None:
            headers = self._headers = plainhead.fields(self.raw_fields)
        return headers

    @property
    def is_websocket(self) -> bool:
        """A WebSocket upgrade the proxy may relay (anything else is a plain request)."""
        return (
            self.method == "GET"
            and self.upgrade.lower() == b"websocket"
            and self.websocket_key
            and self.version == "1.1"
        )

    def add_field(self, name: bytes, value: bytes, limit: int, host_checked: bytes) -> bytes:
        """A header field llhttp read (``limit``: ``max_header_size``); raises ``Refused`` if
        the head cannot be served with it. Returns the last Host value found well formed
        (``host_checked``, or this one's): a client sends the same Host again and again."""
        if len(name) + len(value) > limit:
            raise Refused(431, "header_too_large", "a request header field is too large")
        headers = self.headers
        if len(headers) >= MAX_HEADERS:
            raise Refused(431, "header_too_large", "too many request header fields")
        headers.append((name, value))
        if not value.isascii():
            try:
                value.decode()
            except UnicodeDecodeError:
                raise Refused(
                    400, "bad_request", f"the request is refused: {name!r} is not UTF-8"
                ) from None
        special = _SPECIAL_FIELDS.get(name.lower())
        if special is None:
            return host_checked  # most fields: the proxy passes them on, reads nothing of them
        if special == _HOST_FIELD:
            if self.host_seen:  # an empty Host is one too
                raise Refused(400, "bad_request", "more than one Host header")
            self.host_seen = True
            if value != host_checked:
                if not HOST.fullmatch(value):
                    raise Refused(
                        400,
                        "bad_request",
                        "the request is refused: the Host header is not host[:port]",
                    )
                host_checked = value
            self.host = value
        elif special == _CONTENT_LENGTH_FIELD:
            self.content_length = int(value)  # llhttp checked it is a number, and one
        elif special == _TRANSFER_ENCODING_FIELD:
            self.chunked = True
        elif special == _UPGRADE_FIELD:
            self.upgrade = value
        elif special == _WEBSOCKET_KEY_FIELD:
            self.websocket_key = True
        elif special == _REQUEST_ID_FIELD:
            self.request_id = value
        elif special == _TRACEPARENT_FIELD:
            self.traceparent = value if self.traceparent is None else plainhead.TWICE
        else:
            state = self.tracestate
            self.tracestate = value if state is None else state + b"," + value
        return host_checked

    def __repr__(self) -> str:
        return f"<IncomingRequest {self.method} {self.target!r} HTTP/{self.version}>"


class Refused(Exception):
    """Raised from a parser callback: the head is refused with ``status``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def head_problem(request: IncomingRequest) -> tuple[int, str, str] | None:
    """Heads llhttp accepts but an upstream could read differently: (status, code, message)."""
    if request.version == "0.9":
        return 400, "bad_request", "the request is refused: HTTP/0.9 requests are not served"
    if request.method == "CONNECT":
        return 405, "method_not_allowed", "CONNECT is not served by this gateway"
    if request.chunked:
        if request.version != "1.1":
            return 400, "bad_request", "the request is refused: Transfer-Encoding in HTTP/1.0"
        codings = [
            c.strip().lower()
            for n, v in request.headers
            if n.lower() == b"transfer-encoding"
            for c in v.split(b",")
        ]
        if codings != [b"chunked"]:
            return 400, "bad_request", "the request is refused: a transfer coding not chunked"
    return None
