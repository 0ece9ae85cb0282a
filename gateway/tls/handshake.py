"""The TLS handshake of an accepted connection, before it is a ``ClientConnection``.

Each connection a TLS listener accepts starts as a ``Handshake``: it runs ``loop.start_tls``
with the store's context, for at most ``handshake_timeout``, and once the handshake is done
hands the TLS transport to its ``ClientConnection`` (``connection_made``), which serves it
as it serves a plain one. Doing the handshake here, rather than through ``create_server(ssl=)``,
is what lets the gateway say how each handshake ended (``HandshakeTally``): uvloop drops a
server connection whose handshake failed without a word to its protocol.

``start_tls`` must take the transport before the loop reads from it: uvloop starts reading
as soon as ``connection_made`` returns, and a ClientHello read by this protocol would be lost
to OpenSSL. So ``connection_made`` runs ``start_tls`` up to its first wait at once (driving
the coroutine itself: ``_step``), not as a task, whose first step would come after a read.

Connections in their handshake count against ``limits.max_connections`` like any other: a
connection over the limit is closed before its handshake (no bytes: it cannot be told why
in plain text on a TLS port).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Final, cast

from ..proxy.client import ClientConnection, ConnectionGate
from .certificates import CertificateStore

FAILURE_REASONS: Final = (
    "timeout",
    "plain_http",
    "unknown_name",
    "protocol",
    "closed",
)
"""Why a handshake failed, as ``gateway_tls_handshake_failures_total`` says: it did not finish
within ``handshake_timeout``; plain HTTP came to the TLS port; the server name is one no
certificate covers (``unknown_name: refuse``); anything else OpenSSL refused (no shared
version or cipher, garbage instead of a ClientHello, a client alert); the client closed."""


def failure_reason(exc: BaseException) -> str:
    """What a failed ``start_tls`` says of the handshake, as one of ``FAILURE_REASONS``."""
    if isinstance(exc, ssl.SSLError):
        if exc.reason == "HTTP_REQUEST":
            return "plain_http"
        if exc.reason == "CALLBACK_FAILED":  # the SNI callback refused the name
            return "unknown_name"
        if exc.reason in ("UNEXPECTED_EOF_WHILE_READING",):
            return "closed"
        return "protocol"
    if isinstance(exc, ConnectionAbortedError | TimeoutError):
        return "timeout"  # uvloop aborts a handshake past its timeout
    return "closed"


class HandshakeTally:
    """How handshakes ended: ``ok`` and ``resumed`` by TLS version, failures by reason."""

    __slots__ = ("failed", "ok", "resumed")

    def __init__(self) -> None:
        self.ok: dict[str, int] = {}
        self.resumed: dict[str, int] = {}
        self.failed: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)

    def succeeded(self, version: str, resumed: bool) -> None:
        counts = self.resumed if resumed else self.ok
        counts[version] = counts.get(version, 0) + 1

    def merge(self, other: HandshakeCounts) -> None:
        for mine, theirs in zip((self.ok, self.resumed, self.failed), other, strict=True):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count

    def take(self) -> HandshakeCounts:
        """The counts since the last ``take`` (a worker's report), and start again."""
        taken = (self.ok, self.resumed, {k: v for k, v in self.failed.items() if v})
        self.ok, self.resumed = {}, {}
        self.failed = dict.fromkeys(FAILURE_REASONS, 0)
        return taken


HandshakeCounts = tuple[dict[str, int], dict[str, int], dict[str, int]]
"""(ok by version, resumed by version, failed by reason)."""


class Handshake(asyncio.Protocol):
    """One accepted TLS connection until its handshake ends; then ``conn``'s."""

    __slots__ = ("_conn", "_coro", "_gate", "_store", "_tally", "_timeout")

    def __init__(
        self,
        conn: ClientConnection,
        store: CertificateStore,
        timeout: float,
        gate: ConnectionGate,
        tally: HandshakeTally,
    ) -> None:
        self._conn = conn
        self._store = store
        self._timeout = timeout
        self._gate = gate
        self._tally = tally
        self._coro: Coroutine[Any, Any, asyncio.Transport | None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)
        gate = self._gate
        if gate.open >= gate.limit:
            tcp.abort()
            return
        gate.open += 1
        loop = asyncio.get_running_loop()
        self._coro = loop.start_tls(
            tcp,
            self._conn,
            self._store.context,
            server_side=True,
            ssl_handshake_timeout=self._timeout or None,
        )
        self._step(None)

    def _step(self, _: object) -> None:
        coro = self._coro
        assert coro is not None
        try:
            waiter = coro.send(None)
        except StopIteration as done:
            self._done(cast(asyncio.Transport | None, done.value))
        except (Exception, asyncio.CancelledError) as exc:
            self._gate.open -= 1
            self._coro = None
            self._tally.failed[failure_reason(exc)] += 1
        else:
            cast(asyncio.Future[None], waiter).add_done_callback(self._step)

    def _done(self, transport: asyncio.Transport | None) -> None:
        self._gate.open -= 1
        self._coro = None
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        if transport is None or not isinstance(ssl_object, ssl.SSLObject):
            # uvloop ends start_tls with no handshake when the client closed before its
            # first byte (a port scan, a TCP health check): a close, not an error.
            self._tally.failed["closed"] += 1
            if transport is not None:
                transport.abort()
            return
        self._tally.succeeded(ssl_object.version() or "unknown", ssl_object.session_reused)
        conn = self._conn
        conn.secure = True
        conn.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        raise AssertionError("start_tls took the connection before any read")

    def connection_lost(self, exc: BaseException | None) -> None:
        pass  # before start_tls took the transport: the client left at once


def handshakes(
    make_conn: Callable[[], ClientConnection],
    store: CertificateStore,
    timeout: float,
    gate: ConnectionGate,
    tally: HandshakeTally,
) -> Callable[[], Handshake]:
    """The protocol factory of a TLS listener."""

    def protocol() -> Handshake:
        return Handshake(make_conn(), store, timeout, gate, tally)

    return protocol
