"""The heads the proxy writes: a request's towards its upstream, an answer's towards the
client, and the gateway's own JSON answers; and an upstream's answer's head as read
(``ResponseHead``).

Header rules are ``wire.headers``; this module puts a request's or an answer's head
together from them, with its framing (Content-Length, chunked, or the close).
"""

from __future__ import annotations

from typing import Final

from ..errors import GatewayError, OwnAnswer
from ..wire import headers, http1
from .request import IncomingRequest

NO_BODY_STATUSES: Final = frozenset({204, 304})


class ResponseHead:
    """The status line and header fields of an upstream's answer.

    Class defaults until the head is read: one is made per answer, and an ``__init__``
    setting each cost more than the rest of its making.
    """

    status = 0
    """0 until the final head is complete."""
    phrase = b""
    fields = b""
    """The end-to-end fields, a block of lines as they came (``headers.RESPONSE_DROPPED``
    sorted out)."""
    hop: list[tuple[bytes, bytes]] = []  # noqa: RUF012 (replaced, never changed in place)
    """Connection and Upgrade fields (what a 101 passes on, and what Connection names)."""
    content_length: int | None = None
    chunked = False
    keep_alive = True


class AfterAnswer(Exception):
    """Raised from llhttp's callback: another message begins after an upstream's answer,
    which no request asked for (llhttp then reads no further)."""


class HeadTooLarge(Exception):
    """Raised from llhttp's callback: an upstream answer's head is over the limits."""


def upstream_head(
    request: IncomingRequest,
    target: bytes,
    *,
    peer: str | None,
    request_id: str,
    trust_forwarded: bool,
    address: str,
    secure: bool = False,
    drop: bytes | None = None,
    trace: bytes = b"",
) -> list[bytes]:
    """The request line and header lines sent upstream (framing not included); ``address``:
    the upstream's, the Host of a request that had none; ``drop``: a field not sent (a
    service's token, lower-cased: a plain head's lines are without it already, ``guard``);
    ``trace``: the gateway's traceparent and tracestate lines (``tracing.context``; a plain
    head's lines are without the client's then, ``IncomingRequest.traced``)."""
    plain = request.plain_lines
    if plain is not None and not (request.forwarded and trust_forwarded):
        lines = headers.plain_upstream_request(
            plain, host=request.host, peer=peer, request_id=request_id, secure=secure, trace=trace
        )
    else:
        lines = headers.upstream_request(
            request.headers,
            host=request.host,
            peer=peer,
            request_id=request_id,
            trust_forwarded=trust_forwarded,
            websocket=bool(request.upgrade) and request.is_websocket,
            secure=secure,
            drop=drop,
            trace=trace,
        )
    lines.insert(0, request.method.encode() + b" " + target + b" HTTP/1.1")
    if not request.host:
        lines.append(b"Host: " + address.encode())
    return lines


def upstream_request(
    lines: list[bytes], length: int | None, chunked: bool = False, payload: bytes = b""
) -> bytes:
    """A request's head as sent upstream, framed: ``lines`` (``upstream_head``'s), then
    ``Content-Length: length`` if ``length`` is not None, else ``Transfer-Encoding: chunked``
    if ``chunked`` (a body of no known length, streamed), else no framing (no body); then
    ``payload``, a whole body sent with its head."""
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    elif chunked:
        lines.append(b"Transfer-Encoding: chunked")
    lines.append(http1.CRLF)
    data = http1.CRLF.join(lines)
    return data + payload if payload else data


_METHODS: Final = {
    m: m.encode() + b" " for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH")
}
"""A request line's start for each method ``plainhead`` reads: made once, not per request."""


def plain_upstream_head(
    request: IncomingRequest,
    target: bytes,
    *,
    peer: str | None,
    request_id: bytes,
    secure: bool,
    address: str,
    empty_body: bool,
    trace: bytes = b"",
) -> bytes:
    """The whole head sent upstream for a request with a plain head and no body: what
    ``upstream_head`` makes of it, then ``Content-Length: 0`` if ``empty_body`` and the blank
    line, in one join (a join of the lines, then a join of those, cost a copy and the
    objects of each step). Only when ``upstream_head`` would take the plain lines as they
    are (``IncomingRequest.plain_lines`` set, no X-Forwarded-* field trusted). ``trace``:
    as ``upstream_head``'s."""
    method = _METHODS.get(request.method)
    if method is None:
        method = request.method.encode() + b" "
    # At most ten pieces, each line's CRLF with the constant after it (``bytes.join``
    # allocates an array for the views of more than ten), and X-Forwarded-For's line made
    # once per client address.
    pieces = [method, target]
    kept = request.plain_lines
    if kept:
        pieces += (b" HTTP/1.1\r\n", kept)
    else:
        pieces.append(b" HTTP/1.1")  # the CRLF comes with the next line
    if peer is not None:
        forwarded_for = _FORWARDED_FOR.get(peer)
        pieces.append(_forwarded_for(peer) if forwarded_for is None else forwarded_for)
    host = request.host
    if host:
        pieces += (
            b"\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: "
            if secure
            else b"\r\nX-Forwarded-Proto: http\r\nX-Forwarded-Host: ",
            host,
            b"\r\nX-Request-Id: ",
            request_id,
        )
        if trace:
            pieces += (b"\r\n", trace)
    else:
        pieces += (
            b"\r\nX-Forwarded-Proto: https\r\nX-Request-Id: "
            if secure
            else b"\r\nX-Forwarded-Proto: http\r\nX-Request-Id: ",
            request_id,
        )
        if trace:
            pieces += (b"\r\n", trace)
        pieces += (b"\r\nHost: ", address.encode())
    pieces.append(b"\r\nContent-Length: 0\r\n\r\n" if empty_body else b"\r\n\r\n")
    return b"".join(pieces)


_FORWARDED_FOR: Final[dict[str, bytes]] = {}
"""X-Forwarded-For's line (after a CRLF) by client address, for the addresses that come
again and again: a look-up costs less than the address encoded and one more piece joined."""
FORWARDED_FOR_CACHED: Final = 1024


def _forwarded_for(peer: str) -> bytes:
    """``peer``'s X-Forwarded-For line, kept in ``_FORWARDED_FOR`` (emptied when full)."""
    line = b"\r\nX-Forwarded-For: " + peer.encode()
    if len(_FORWARDED_FOR) >= FORWARDED_FOR_CACHED:
        _FORWARDED_FOR.clear()
    _FORWARDED_FOR[peer] = line
    return line


def client_head(
    request: IncomingRequest,
    head: ResponseHead,
    request_id: bytes,
    keep_alive: bool,
    *,
    extra: bytes = b"",
    body: bytes = b"",
) -> tuple[bool, bool, bytes]:
    """The head of the answer as the client gets it: (chunked, keep_alive, bytes); the
    connection is kept alive only if ``keep_alive`` and the answer's framing allow it.

    ``extra``: one more field line (HSTS's), last. ``body``: bytes that follow the head in
    the same ``bytes`` (the whole body of a complete answer framed by its length: one join,
    not a head and then a copy of it with the body)."""
    status = head.status
    hop = head.hop
    length = head.content_length
    if (
        keep_alive
        and length is not None
        and status != 204
        and request.version == "1.1"
        and not (hop and headers.names_fields(hop))
    ):
        # Most answers: what the steps below make of them, in one step. A tuple (small ones
        # are reused, a list's items are allocated) of at most ten pieces (see
        # ``plain_upstream_head``).
        fields = head.fields
        rid = b"\r\nX-Request-Id: " if fields else b"X-Request-Id: "
        end = b"\r\n" + extra + b"\r\n\r\n" if extra else b"\r\n\r\n"
        data = b"".join(
            (
                http1.STATUS_LINE_START[status],
                head.phrase,
                b"\r\n",
                fields,
                rid,
                request_id,
                b"\r\nContent-Length: ",
                http1.decimal(length),
                end,
                body,
            )
        )
        return False, True, data
    chunked = False
    lines = headers.client_response(head.fields, head.hop, request_id.decode())
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
    if extra:
        lines.append(extra)
    data = http1.response_head(status, head.phrase, lines)
    return chunked, keep_alive, data + body if body else data


def upgrade_head(head: ResponseHead, request_id: str) -> bytes:
    """The head of an upstream's 101 as the client gets it."""
    lines = headers.client_response(head.fields, head.hop, request_id, upgrade=True)
    return http1.response_head(101, head.phrase, lines)


def gateway_error_response(exc: GatewayError, request_id: str, close: bool) -> bytes:
    """The JSON answer for a ``GatewayError`` (an ``OwnAnswer`` is its own)."""
    if isinstance(exc, OwnAnswer):
        own = {**exc.headers, "X-Request-Id": request_id}
        return http1.plain_response(exc.status, exc.body, own, close=close)
    body: dict[str, object] = {**exc.details, "error": exc.code, "message": exc.message}
    body["request_id"] = request_id
    extra = {"X-Request-Id": request_id}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        extra["Retry-After"] = str(retry_after)
    for name, value in exc.fields:
        extra[name] = value
    return http1.json_response(exc.status, body, extra, close=close)
