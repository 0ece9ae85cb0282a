"""TLS over an accepted connection: the protocol on its TCP transport, and the transport its
``ClientConnection`` reads from and writes to.

Each connection a TLS listener accepts gets a ``TlsConnection``. It runs the handshake with
OpenSSL through two memory BIOs (for at most ``handshake_timeout``), counts how it ended
(``HandshakeTally``), and then hands itself to the ``ClientConnection`` as its transport
(or, if ALPN chose ``h2``, to the HTTP/2 connection its ``http2`` makes):
what the client sends is decrypted and passed on (``data_received``, or into the buffers of
a ``BufferedProtocol`` set by ``set_protocol`` while a body is spliced), what the connection
writes is encrypted and written to the TCP transport. Flow control is the TCP transport's:
its pause and resume go to the connection, the connection's reads pause it.

Closing is a plain connection's, over TLS: ``write_eof`` sends close_notify and shuts the
TCP write side, so ``ClientConnection`` lingers on a TLS connection as on a plain one (reads
are still decrypted, and discarded, until the client closes); ``close`` sends close_notify
and closes once what was written is sent. A client's close_notify, or its FIN without one,
is the end of what it sends (``eof_received``).

Why not uvloop's ``start_tls``: it tells nothing of a handshake that failed, and per
connection it costs a 256 KiB read buffer, an SSLProtocol and an app transport and a waiter
future (a large part of what a resumed handshake cost beside nginx's). This makes the
public ``ssl.SSLObject`` (``SSLContext.wrap_bio``) and reads it only while records are
waiting, so a read that would block raises nothing.

Connections in their handshake count against ``limits.max_connections`` like any other: a
connection over the limit is closed before its handshake (no bytes: it cannot be told why
in plain text on a TLS port).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any, Final, cast

from ..proxy.http1_downstream import ClientConnection, ConnectionGate, SwitchToHttp2
from .certificates import CertificateStore
from .handshake import HandshakeTally, failure_reason

_PLAIN_HTTP_BODY: Final = b"The plain HTTP request was sent to an HTTPS port.\n"
PLAIN_HTTP_ANSWER: Final = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s" % (len(_PLAIN_HTTP_BODY), _PLAIN_HTTP_BODY)
)
"""What a client that speaks plain HTTP to the TLS port gets (nginx's answer, in text)."""

READ_SIZE: Final = 16384
"""The most a TLS record carries: one ``read`` takes one record's data."""

_HANDSHAKE: Final = 0
_OPEN: Final = 1
_SHUT: Final = 2
"""close_notify sent and the TCP write side shut (``write_eof``): still reading."""
_CLOSED: Final = 3


class TlsConnection(asyncio.Protocol):
    """One accepted TLS connection: its handshake, then its connection's transport."""

    __slots__ = (
        "_app",
        "_buffered",
        "_conn",
        "_context",
        "_gate",
        "_http2",
        "_incoming",
        "_loop",
        "_made",
        "_outgoing",
        "_paused",
        "_ssl",
        "_state",
        "_tally",
        "_tcp",
        "_timeout",
        "_timer",
    )

    def __init__(
        self,
        conn: ClientConnection,
        context: ssl.SSLContext,
        timeout: float,
        gate: ConnectionGate,
        tally: HandshakeTally,
        loop: asyncio.AbstractEventLoop,
        http2: SwitchToHttp2 | None = None,
    ) -> None:
        self._conn = conn
        self._http2 = http2
        """Where the connection goes if ALPN chose ``h2``."""
        self._app: Any = conn
        """Who gets what is read: ``conn``, or what ``set_protocol`` put in its place."""
        self._buffered = False
        self._context = context
        self._timeout = timeout
        self._gate = gate
        self._tally = tally
        self._loop = loop
        self._tcp: asyncio.Transport | None = None
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl: Any = None
        """OpenSSL's connection (an ``ssl.SSLObject``): what ``ssl_object`` gives."""
        self._timer: asyncio.TimerHandle | None = None
        self._state = _HANDSHAKE
        self._made = False
        """The connection was handed this transport (``connection_made``)."""
        self._paused = False

    # -- the TCP transport's protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)
        gate = self._gate
        if gate.open >= gate.limit:
            self._state = _CLOSED
            tcp.abort()
            return
        gate.open += 1
        self._tcp = tcp
        self._ssl = self._context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        if self._timeout:
            self._timer = self._loop.call_later(self._timeout, self._timed_out)

    def data_received(self, data: bytes) -> None:
        self._incoming.write(data)
        state = self._state
        if state == _HANDSHAKE:
            self._handshake()
        elif state != _CLOSED:
            self._read()

    def eof_received(self) -> bool | None:
        if self._state == _HANDSHAKE:
            self._failed("closed")
            return None
        if self._state == _CLOSED:
            return None
        self._read()  # what came before the FIN
        if self._state == _CLOSED:
            return None
        return cast(bool | None, self._app.eof_received())

    def connection_lost(self, exc: BaseException | None) -> None:
        state = self._state
        self._state = _CLOSED
        self._tcp = None
        if state == _HANDSHAKE:
            self._end_handshake()
            self._tally.failed[failure_reason(exc) if exc is not None else "closed"] += 1
        if self._made:
            self._made = False
            self._app.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._state != _HANDSHAKE:
            self._app.pause_writing()

    def resume_writing(self) -> None:
        if self._state != _HANDSHAKE:
            self._app.resume_writing()

    # -- the handshake ------------------------------------------------------------------------

    def _handshake(self) -> None:
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except Exception as exc:  # an ssl.SSLError, or the SNI callback's own
            self._failed(failure_reason(exc))
            return
        self._end_handshake()
        self._state = _OPEN
        self._flush()  # the last flight, session tickets
        ssl_object = self._ssl
        self._tally.succeeded(ssl_object.version() or "unknown", ssl_object.session_reused)
        conn = self._conn
        conn.secure = True
        self._made = True
        switch = self._http2
        if switch is not None and ssl_object.selected_alpn_protocol() == "h2":
            switch(self, True, None)  # type: ignore[arg-type]
        else:
            conn.connection_made(self)  # type: ignore[arg-type]
        if self._state != _CLOSED and self._incoming.pending:
            self._read()  # the first request came with the client's Finished

    def _end_handshake(self) -> None:
        self._gate.open -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _failed(self, reason: str) -> None:
        """The handshake failed: what OpenSSL has to say (an alert) is sent, then close; a
        client that spoke plain HTTP is told so in plain HTTP."""
        self._state = _CLOSED
        self._end_handshake()
        self._tally.failed[reason] += 1
        if reason == "plain_http":
            self._outgoing.read()  # an alert, which that client would not read
            if self._tcp is not None:
                self._tcp.write(PLAIN_HTTP_ANSWER)
        else:
            self._flush()
        if self._tcp is not None:
            self._tcp.close()

    def _timed_out(self) -> None:
        self._timer = None
        if self._state == _HANDSHAKE:
            self._state = _CLOSED
            self._gate.open -= 1
            self._tally.failed["timeout"] += 1
            if self._tcp is not None:
                self._tcp.abort()

    # -- records ------------------------------------------------------------------------------

    def _read(self) -> None:
        """Decrypt and pass on what has come, while the connection reads."""
        incoming = self._incoming
        ssl_object = self._ssl
        while not self._paused:
            app = self._app
            try:
                if self._buffered:
                    buffer = app.get_buffer(-1)
                    n = ssl_object.read(len(buffer), buffer)
                    if not n:
                        self._peer_closed()
                        return
                    app.buffer_updated(n)
                else:
                    data = ssl_object.read(READ_SIZE)
                    if not data:
                        self._peer_closed()
                        return
                    app.data_received(data)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLError:  # a bad record, an alert: the connection cannot go on
                self._flush()
                self.abort()
                return
            if self._state == _CLOSED:
                return
            if not incoming.pending and not ssl_object.pending():
                break
        if self._outgoing.pending:
            self._flush()  # what a record read asked for (an alert, a key update)

    def _peer_closed(self) -> None:
        """The client's close_notify: the end of what it sends."""
        self._flush()
        if self._state != _CLOSED and not self._app.eof_received():
            self.close()

    def _flush(self) -> None:
        data = self._outgoing.read()
        if data and self._tcp is not None:
            self._tcp.write(data)

    def _resume(self) -> None:
        if not self._paused and self._state != _CLOSED:
            self._read()

    # -- the connection's transport -----------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._state != _OPEN or not data:
            return
        self._ssl.write(data)
        self._flush()

    def writelines(self, chunks: Any) -> None:
        self.write(b"".join(chunks))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """close_notify, then shut the TCP write side; reads go on."""
        if self._state != _OPEN:
            return
        self._state = _SHUT
        self._close_notify()
        if self._tcp is not None:
            self._tcp.write_eof()

    def close(self) -> None:
        if self._state == _CLOSED:
            return
        if self._state == _OPEN:
            self._close_notify()
        self._state = _CLOSED
        if self._tcp is not None:
            self._tcp.close()

    def abort(self) -> None:
        self._state = _CLOSED
        if self._tcp is not None:
            self._tcp.abort()

    def _close_notify(self) -> None:
        try:
            self._ssl.unwrap()
        except ssl.SSLError:
            pass  # close_notify is out; OpenSSL wants the client's, which is not waited for
        self._flush()

    def is_closing(self) -> bool:
        return self._state == _CLOSED or self._tcp is None or self._tcp.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._ssl
        if name == "sslcontext":
            return self._ssl.context if self._ssl is not None else default
        if name == "cipher":
            return self._ssl.cipher() if self._ssl is not None else default
        if name == "peercert":
            return self._ssl.getpeercert() if self._ssl is not None else default
        if self._tcp is None:
            return default
        return self._tcp.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._paused = True
        if self._tcp is not None:
            self._tcp.pause_reading()

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self._tcp is not None:
            self._tcp.resume_reading()
        if self._incoming.pending or (self._ssl is not None and self._ssl.pending()):
            self._loop.call_soon(self._resume)  # records read before the pause

    def is_reading(self) -> bool:
        return not self._paused

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self._tcp is not None:
            self._tcp.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._tcp.get_write_buffer_size() if self._tcp is not None else 0

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._app = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return cast(asyncio.BaseProtocol, self._app)


def tls_connections(
    make_conn: Callable[[], ClientConnection],
    store: CertificateStore,
    timeout: float,
    gate: ConnectionGate,
    tally: HandshakeTally,
    http2: SwitchToHttp2 | None = None,
) -> Callable[[], TlsConnection]:
    """The protocol factory of a TLS listener (made in the loop that serves it); ``http2``:
    where a connection goes whose handshake chose ``h2`` by ALPN."""
    loop = asyncio.get_running_loop()

    def protocol() -> TlsConnection:
        return TlsConnection(make_conn(), store.context, timeout, gate, tally, loop, http2)

    return protocol
