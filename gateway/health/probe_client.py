"""The HTTP probe's client: one HTTP/1.1 request on a new connection, and the answer's status
(or, for a load scrape, its status and body).

The prober needs no more of HTTP than a status, so it does without a client library (which
its process would load for nothing else): ``status`` opens a connection with an asyncio
protocol, writes one request and reads the answer with llhttp (``httptools``) up to the end of
its head. No redirect is followed, no cookie kept; ``fetch`` reads the body too, framed
(Content-Length or chunked) and bounded.

Invariants:

- Every exchange has a connection of its own, closed on every path (an answer, an error, a
  cancellation, the caller's timeout): a probe proves the upstream accepts connections now,
  which a pooled keep-alive socket would hide.
- The request is checked before anything is sent: a name, value or path that could break
  out of its line (CR, LF, NUL) is refused (``ProbeRequestInvalid``), never written raw. The
  request has no body; its framing and ``Connection: close`` are the client's own.
- The status is known at the end of the head: a HEAD answer's ``Content-Length`` is never
  waited for. Interim answers (1xx but 101) are skipped, as the final answer follows them.
- After the status, the rest of the answer is read and dropped until the upstream closes (it
  was asked to), then the connection is closed: an upstream still writing its body never
  meets a reset (``BrokenPipeError`` in its log every probe). Past ``LINGER_BYTES`` bytes or
  ``LINGER_SECONDS`` seconds the connection is aborted. This costs the probe nothing: its
  status is already answered.
- Every failure is a ``ProbeError`` or an ``OSError`` (the connect's, a reset's, a TLS
  handshake's), or an ``UpstreamTlsError`` (a TLS file that cannot be used); there is no
  timeout here: the caller bounds the whole exchange.

With ``tls`` (the service's ``upstream_tls``) the connection is made over TLS as the
service's requests' are (``wire.upstream_tls``), its handshake part of the probe.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from typing import Final, cast

import httptools

from ..wire.upstream_tls import UpstreamTls

USER_AGENT: Final = "gateway-prober"
HEAD_LIMIT: Final = 64 * 1024
"""The most bytes an answer's head may take: more is a broken answer, not a slow one."""
LINGER_BYTES: Final = 1024 * 1024
LINGER_SECONDS: Final = 5.0
"""How much of an answer's body, and for how long, is read after its status to close
cleanly; past either the connection is aborted."""

_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""A method or a header name (RFC 9110 5.6.2)."""
_OWN: Final = frozenset({"connection", "content-length", "transfer-encoding"})
"""Headers the client sets itself (a request without body, on a connection used once); a
probe's own are dropped."""
_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD"})
"""Methods sent without ``Content-Length: 0`` (their requests never have a body)."""
CLOSED_AFTER_HANDSHAKE: Final = (
    " (after the TLS handshake: does the replica require a client certificate?)"
)
"""Added to a TLS probe's closed connection: with TLS 1.3 a replica refuses a client's
certificate (or its absence) after the client's handshake is done, and its alert reaches
no protocol (asyncio and uvloop report a close)."""
BODY_LIMIT: Final = 4 * 1024 * 1024
"""The most of a body ``fetch`` reads (a model server's metrics run to a few hundred KB)."""


class ProbeError(Exception):
    """An HTTP probe that got no status."""


class ProbeRequestInvalid(ProbeError, ValueError):
    """The request cannot be written safely (nothing was sent)."""


class ProbeConnectionClosed(ProbeError, ConnectionError):
    """The upstream closed the connection before the answer's head was complete."""


class ProbeTlsRefused(ProbeError):
    """The TLS handshake was done, but its outcome cannot be used (ALPN: ``h2`` refused)."""


class ProbeInvalidResponse(ProbeError):
    """What the upstream sent is not an HTTP/1.x answer."""


def request_head(method: str, path: str, authority: str, headers: Mapping[str, str]) -> bytes:
    """The whole request: its line, ``Host`` (``authority`` unless ``headers`` has one, in any
    case), the probe's ``headers``, a ``User-Agent`` unless given, ``Content-Length: 0``
    for a method other than GET and HEAD, ``Connection: close``.

    Raises ``ProbeRequestInvalid`` if any part would not stay on its line.
    """
    if not _TOKEN.fullmatch(method):
        raise ProbeRequestInvalid(f"not a method: {method!r}")
    if not path.startswith("/") or " " in path or _breaks_line(path):
        raise ProbeRequestInvalid(f"not a request path: {path!r}")
    given = {name.lower() for name in headers}
    lines = []
    if "host" not in given:
        if _breaks_line(authority):
            raise ProbeRequestInvalid(f"not a host: {authority!r}")
        lines.append(f"Host: {authority}\r\n")
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ProbeRequestInvalid(f"not a header name: {name!r}")
        if _breaks_line(value):
            raise ProbeRequestInvalid(f"the value of {name} holds CR, LF or NUL")
        if name.lower() not in _OWN:
            lines.append(f"{name}: {value}\r\n")
    if "user-agent" not in given:
        lines.append(f"User-Agent: {USER_AGENT}\r\n")
    if method not in _NO_BODY_METHODS:
        lines.append("Content-Length: 0\r\n")
    lines.append("Connection: close\r\n\r\n")
    # UTF-8, as aiohttp wrote it; a path beyond ASCII is percent-encoded (as yarl did), so the
    # request line stays ASCII.
    target = path.encode()
    if not target.isascii():
        target = b"".join(b"%%%02X" % c if c >= 0x80 else bytes((c,)) for c in target)
    return b"%s %s HTTP/1.1\r\n%s" % (method.encode(), target, "".join(lines).encode())


def _breaks_line(text: str) -> bool:
    return "\r" in text or "\n" in text or "\0" in text


async def status(
    host: str,
    port: int,
    method: str,
    path: str,
    headers: Mapping[str, str],
    *,
    authority: str,
    tls: UpstreamTls | None = None,
) -> int:
    """Send one request to ``host``:``port`` on a new connection (over ``tls``, if given);
    the answer's status.

    ``authority`` is the ``Host`` sent (``host:port``, an IPv6 host in brackets) unless
    ``headers`` has one. Raises ``ProbeError`` or ``OSError``; no timeout of its own.
    """
    code, _ = await _exchange(host, port, method, path, headers, authority, 0, tls)
    return code


async def fetch(
    host: str,
    port: int,
    path: str,
    *,
    authority: str,
    limit: int = BODY_LIMIT,
    tls: UpstreamTls | None = None,
) -> tuple[int, bytes]:
    """``GET path`` on a new connection: the answer's status and its body (at most
    ``limit`` bytes, else ``ProbeInvalidResponse``). Raises as ``status``."""
    return await _exchange(host, port, "GET", path, {}, authority, limit, tls)


async def connect(
    factory: Callable[[], asyncio.Protocol], host: str, port: int, tls: UpstreamTls | None
) -> tuple[asyncio.Transport, asyncio.Protocol]:
    """A new connection to ``host:port`` for ``factory``'s protocol: plain, or over ``tls``
    (its handshake done and its outcome checked: ``ProbeTlsRefused``)."""
    loop = asyncio.get_running_loop()
    if tls is None:
        transport, protocol = await loop.create_connection(factory, host, port)
        return transport, protocol
    transport, protocol = await loop.create_connection(
        factory,
        host,
        port,
        ssl=tls.context(loop.time()),
        server_hostname=tls.server_hostname(host),
    )
    refusal = tls.refusal(transport.get_extra_info("ssl_object"))
    if refusal is not None:
        transport.abort()
        raise ProbeTlsRefused(refusal)
    return transport, protocol


async def _exchange(
    host: str,
    port: int,
    method: str,
    path: str,
    headers: Mapping[str, str],
    authority: str,
    keep: int,
    tls: UpstreamTls | None = None,
) -> tuple[int, bytes]:
    request = request_head(method, path, authority, headers)
    loop = asyncio.get_running_loop()
    exchange = _Exchange(loop, request, keep, tls is not None)
    try:
        transport, _ = await connect(lambda: exchange, host, port, tls)
    except BaseException:
        # create_connection closed the socket itself; nobody waits for the status now (its
        # error, if the close sets one, would be logged as never retrieved).
        exchange.status.cancel()
        raise
    try:
        code = await exchange.status
    except BaseException:
        # Abort, not close: the exchange is over, and a close would keep the socket until the
        # request is written, which a peer that does not read never lets happen.
        transport.abort()
        raise
    if keep:
        transport.close()
        return code, b"".join(exchange.body)
    exchange.linger(transport)
    return code, b""


class _Exchange(asyncio.Protocol):
    """One request and the head of its answer; ``status`` resolves once, with the final
    answer's status or the reason there is none. With ``keep`` (a body's most bytes), only
    once the body is read whole (into ``body``)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, request: bytes, keep: int = 0, tls: bool = False
    ) -> None:
        self._request = request
        self._tls = tls
        self._keep = keep
        self._code = 0
        self.body: list[bytes] = []
        self._kept = 0
        self._parser = httptools.HttpResponseParser(self)
        self.status: asyncio.Future[int] = loop.create_future()
        self._received = 0
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._dropped = 0

    def linger(self, transport: asyncio.Transport) -> None:
        """The status is in: read the rest until the upstream closes, within the bounds."""
        if transport.is_closing():
            return
        self._transport = transport
        self._deadline = self._loop.call_later(LINGER_SECONDS, transport.abort)

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.WriteTransport, transport).write(self._request)

    def data_received(self, data: bytes) -> None:
        if self.status.done():  # the body, or what follows an answer: dropped
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES and self._transport is not None:
                self._transport.abort()
            return
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            # After the head (a body llhttp refuses, a 101's upgrade) the status stands.
            if not self.status.done():
                self.status.set_exception(
                    ProbeInvalidResponse(f"invalid HTTP response: {type(error).__name__}: {error}")
                )
            return
        if not self.status.done() and not self._code and self._received > HEAD_LIMIT:
            self.status.set_exception(
                ProbeInvalidResponse(f"the response head is longer than {HEAD_LIMIT} bytes")
            )

    def eof_received(self) -> bool | None:
        return None  # the transport closes: connection_lost says what it came to

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self.status.done():
            return
        if isinstance(exc, OSError):
            self.status.set_exception(exc)  # a reset: its own name says it best
        elif self._code:
            self.status.set_exception(
                ProbeConnectionClosed("connection closed before the end of the response body")
            )
        elif self._received:
            self.status.set_exception(
                ProbeConnectionClosed("connection closed in the middle of the response head")
            )
        else:
            self.status.set_exception(
                ProbeConnectionClosed(
                    "connection closed before any response"
                    + (CLOSED_AFTER_HANDSHAKE if self._tls else "")
                )
            )

    # -- parser callbacks ---------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        code = self._parser.get_status_code()
        if 100 <= code < 200 and code != 101:
            return  # interim (100 Continue, 103 Early Hints): llhttp reads on to the next
        if self._keep:
            self._code = code  # resolved with its body (on_message_complete)
        elif not self.status.done():
            self.status.set_result(code)

    def on_body(self, data: bytes) -> None:
        if not self._keep or self.status.done():
            return
        self._kept += len(data)
        if self._kept > self._keep:
            self.status.set_exception(
                ProbeInvalidResponse(f"the response body is longer than {self._keep} bytes")
            )
            return
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self._keep and self._code and not self.status.done():
            self.status.set_result(self._code)
