"""The keep-alive pool of connections to upstreams (``Connector``).

It keeps idle keep-alive connections per upstream address (``host:port``, as
``Upstream.address`` writes it), newest first, closes those idle
for longer than ``keepalive_timeout``, and opens new ones within the connect timeout. A
connection goes back to the pool only after a request whose answer arrived whole and allows
keep-alive (``UpstreamConnection.reusable``); any failure closes it.

A service with ``upstream_tls`` has its connections made over TLS (``wire.upstream_tls``):
a failed handshake is a failed connect, and its connections are kept under a key of their
own (``UpstreamTls.key``), never handed to a request of another TLS config or a plain one.
"""

from __future__ import annotations

import asyncio
from typing import Final

from ..errors import UpstreamConnectError, UpstreamTimeout
from ..pool.upstream import address_of
from ..wire.batch import WriteBatch
from ..wire.splice import Buffers
from ..wire.upstream_tls import UpstreamTls, UpstreamTlsError, handshake_failure
from .messages import ResponseHead
from .upstream_connection import UpstreamConnection, Waiter

__all__ = ["KEEPALIVE_TIMEOUT", "Connector", "ResponseHead", "UpstreamConnection", "Waiter"]

KEEPALIVE_TIMEOUT: Final = 30.0
"""Idle keep-alive connections to upstreams are closed after this long."""


class Connector:
    """Idle keep-alive connections per upstream address, and new ones on demand."""

    def __init__(
        self,
        max_idle: int = 256,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        max_header_size: int = 16 * 1024,
    ) -> None:
        self.max_idle = max_idle
        self.max_header_size = max_header_size
        self.keepalive_timeout = keepalive_timeout
        self._idle: dict[str, list[UpstreamConnection]] = {}
        """Idle connections by address (``address_of``): a string an upstream holds already,
        so a request looks its connections up without making a key."""
        self._busy: set[UpstreamConnection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        self.buffers = Buffers()
        """The read buffers of its connections (``splice``)."""
        self.batch = WriteBatch(self._busy)
        """Where request heads wait for the end of the loop's turn (``batch``); shared with
        the client connections (``ConnectionGate``)."""

    def idle(self, address: str) -> UpstreamConnection | None:
        """The newest idle connection to ``address`` (``Upstream.address``) that is still
        open, taken, or None."""
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                self._busy.add(conn)
                return conn
        return None

    async def acquire(
        self, host: str, port: int, within: float, tls: UpstreamTls | None = None
    ) -> UpstreamConnection:
        """An idle connection to ``host:port`` (over ``tls``, if given), or a new one opened
        ``within`` seconds."""
        address = address_of(host, port)
        conn = self.idle(address if tls is None else tls.key(address))
        if conn is not None:
            return conn
        return await self.connect(host, port, within, tls)

    async def connect(
        self, host: str, port: int, within: float, tls: UpstreamTls | None = None
    ) -> UpstreamConnection:
        """A new connection to ``host:port``, opened ``within`` seconds (its TLS handshake
        included, with ``tls``)."""
        loop = asyncio.get_running_loop()
        conn = self.connection(host, port, tls)
        try:
            async with asyncio.timeout(within or None):
                if tls is None:
                    await loop.create_connection(lambda: conn, host, port)
                else:
                    await loop.create_connection(
                        lambda: conn,
                        host,
                        port,
                        ssl=tls.context(loop.time()),
                        server_hostname=tls.server_hostname(host),
                    )
        except TimeoutError:
            raise UpstreamTimeout("timed out connecting to upstream", kind="connect") from None
        except UpstreamTlsError as exc:
            raise UpstreamConnectError(
                f"cannot connect to upstream {host}:{port}: {exc}", kind="connect"
            ) from None
        except OSError as exc:
            reason = handshake_failure(exc)
            raise UpstreamConnectError(
                f"cannot connect to upstream {host}:{port}: {reason}", kind="connect"
            ) from None
        self._busy.add(conn)
        return conn

    def connection(
        self, host: str, port: int, tls: UpstreamTls | None = None
    ) -> UpstreamConnection:
        """A new connection to ``host:port``, not connected yet (nor counted in use)."""
        address = address_of(host, port)
        return UpstreamConnection(
            address if tls is None else tls.key(address),
            max_header_size=self.max_header_size,
            buffers=self.buffers,
            batch=self.batch,
            forget=self.forget,
        )

    def release(self, conn: UpstreamConnection) -> None:
        """Back to the idle pool if its request ended cleanly, else closed."""
        self._busy.discard(conn)
        if self._closed or not conn.reusable:
            conn.body_producer = None
            conn.abort()  # an answer still waited for fails as its connection goes
            return
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = []
        elif len(idle) >= self.max_idle:
            conn.body_producer = None
            conn.abort()
            return
        conn.idle()
        idle.append(conn)
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.keepalive_timeout / 2, self._sweep)

    def discard(self, conn: UpstreamConnection) -> None:
        """Close ``conn``: its request failed or was cut off."""
        self._busy.discard(conn)
        conn.abort()

    def forget(self, conn: UpstreamConnection) -> None:
        """``conn`` was closed: it is neither idle nor in use any more."""
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    def _sweep(self) -> None:
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for idle in list(self._idle.values()):
            for conn in [c for c in idle if now - c.idle_since >= self.keepalive_timeout]:
                conn.abort()
        if any(self._idle.values()):
            self._sweeper = asyncio.get_running_loop().call_later(
                self.keepalive_timeout / 2, self._sweep
            )

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def close(self) -> None:
        """Close every idle connection and refuse to keep more (shutdown)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.abort()
        self._idle.clear()
        for conn in list(self._busy):
            conn.abort()

    def __repr__(self) -> str:
        return f"<Connector idle={self.idle_count()} busy={len(self._busy)}>"
